"""Format 1 steps: ranged verified reads and verification of chunk-per-object steps.

Listing, opening and deleting steps is ``root.py``'s (:class:`CheckpointRoot`).

Every chunk read is checked: its size against the commit record, its trailing crc32c
against the payload and against the commit record. Reads are whole chunks, so a ranged
read fetches every chunk that overlaps the range in full (the checksum covers the chunk).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from zerostate.errors import (
    CorruptCheckpointError,
)
from zerostate.layout.partition import chunk_reads
from zerostate.store import format as fmt
from zerostate.store.format import ChunkedTensorInfo
from zerostate.store.problems import Problem, raise_if_any
from zerostate.store.step_base import StepBase
from zerostate.store.storage import Storage


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One stored chunk of a step, as :meth:`StepReader.iter_chunks` yields it."""

    tensor: str
    index: int
    path: str  # relative to the step directory
    nbytes: int
    crc32c: int


class StepReader(StepBase):
    """One committed format-1 step: a read-only adapter of the step-reader protocol (a
    sibling of ``StepReaderV2``, see ``step_base.py``). Every chunk is its own object."""

    format_version = 1

    def __init__(
        self,
        storage: Storage,
        directory: str,
        step: int,
        world_size: int,
        attrs: dict,
        tensors: dict[str, ChunkedTensorInfo],
        files: dict[str, fmt.ChunkRecord],
        num_threads: int,
    ) -> None:
        super().__init__(step, world_size, attrs, tensors, num_threads)
        self._storage, self._dir = storage, directory
        self._files = files

    @property
    def url(self) -> str:
        return self._storage.url_of(self._dir)

    @property
    def object_count(self) -> int:
        """Objects of the step: chunks, metadata documents, manifests, commit record."""
        chunks = sum(len(i.chunks) for i in self._chunked.values())
        return chunks + len(self._files) + self.world_size + 1

    @property
    def _chunked(self) -> dict[str, ChunkedTensorInfo]:
        return self.tensors  # type: ignore[return-value]  # format 1 records only

    # ------------------------------------------------------------------ chunks
    def iter_chunks(self) -> Iterator[ChunkRef]:
        for name, info in self._chunked.items():
            for index, record in enumerate(info.chunks):
                yield ChunkRef(
                    name, index, fmt.chunk_path(name, index), record.nbytes, record.crc32c
                )

    def read_chunk(self, name: str, index: int) -> memoryview:
        """The verified payload of one chunk (full chunk size, edge padding included)."""
        info = self._chunked[self.info(name).name]  # info() names a missing tensor
        if not 0 <= index < len(info.chunks):
            raise IndexError(f"{name}: chunk {index} out of range [0, {len(info.chunks)})")
        record = info.chunks[index]
        path = f"{self._dir}/{fmt.chunk_path(name, index)}"
        what = f"tensor {name!r} chunk {index} ({self._storage.url_of(path)})"
        try:
            data = self._storage.read(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{what} is missing") from None
        if len(data) != record.nbytes:
            raise CorruptCheckpointError(
                f"{what} is {len(data)} bytes, the commit record says {record.nbytes} "
                "(truncated or overwritten)"
            )
        view = memoryview(data)
        payload = view[: -fmt.CHECKSUM_NBYTES]
        actual = crc32c.crc32c(payload)
        stored = int.from_bytes(view[-fmt.CHECKSUM_NBYTES :], "little")
        if actual != stored or actual != record.crc32c:
            raise CorruptCheckpointError(
                f"{what} fails its checksum (crc32c {actual:#010x}, stored {stored:#010x}, "
                f"commit record {record.crc32c:#010x}): the data is damaged"
            )
        return payload

    # ------------------------------------------------------------------- reads
    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flat tensor, verified, as a 1-D tensor.

        Only the chunks overlapping the range are read (each in full, in parallel; the
        requested bytes land in ``out`` directly). If a chunk fails its checks the error is
        raised and ``out`` may hold part of the data.
        """
        info = self.info(name)
        start, stop, out = self._check_range(info, start, stop, out)
        numel = stop - start
        if numel == 0:
            return out
        dest = memoryview(out.view(torch.uint8).numpy()).cast("B")
        size = info.dtype.itemsize

        def copy(read: Any) -> None:
            self._read_chunk_into(
                name,
                read.chunk_index,
                read.chunk_start * size,
                dest[read.out_start * size : (read.out_start + read.numel) * size],
            )

        self._map(copy, chunk_reads(info.layout, start, stop))
        return out

    def _read_chunk_into(self, name: str, index: int, offset: int, dest: memoryview) -> None:
        """Verify chunk ``index`` of ``name`` and land its payload bytes
        ``[offset, offset + len(dest))`` straight in ``dest``. The rest of the chunk is
        still read (the checksum covers all of it) but into scratch space."""
        record = self._chunked[name].chunks[index]
        path = f"{self._dir}/{fmt.chunk_path(name, index)}"
        what = f"tensor {name!r} chunk {index} ({self._storage.url_of(path)})"
        tail = record.nbytes - offset - dest.nbytes
        if offset < 0 or tail < fmt.CHECKSUM_NBYTES:
            raise CorruptCheckpointError(
                f"{what}: the commit record's size {record.nbytes} is too small for the layout"
            )
        head, rest = memoryview(bytearray(offset)), memoryview(bytearray(tail))
        try:
            size = self._storage.read_into(path, [head, dest, rest])
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{what} is missing") from None
        if size != record.nbytes:
            raise CorruptCheckpointError(
                f"{what} is {size} bytes, the commit record says {record.nbytes} "
                "(truncated or overwritten)"
            )
        body = rest[: -fmt.CHECKSUM_NBYTES]
        actual = crc32c.crc32c(body, crc32c.crc32c(dest, crc32c.crc32c(head)))
        stored = int.from_bytes(rest[-fmt.CHECKSUM_NBYTES :], "little")
        if actual != stored or actual != record.crc32c:
            raise CorruptCheckpointError(
                f"{what} fails its checksum (crc32c {actual:#010x}, stored {stored:#010x}, "
                f"commit record {record.crc32c:#010x}): the data is damaged"
            )

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Re-read every chunk and metadata document; raise listing every problem found."""
        problems: list[str | Problem] = []
        lock = threading.Lock()

        def check_chunk(ref: ChunkRef) -> None:
            try:
                self.read_chunk(ref.tensor, ref.index)
            except CorruptCheckpointError as exc:
                problem = Problem(str(exc), (ref.tensor,), chunk=ref.index, damage="chunk")
                with lock:
                    problems.append(problem)
            if progress is not None:  # logical bytes: the totals add up to info.nbytes
                info = self.tensors[ref.tensor]
                start, stop = info.layout.chunk_range(ref.index)
                progress((stop - start) * info.dtype.itemsize)

        def check_file(item: tuple[str, fmt.ChunkRecord]) -> None:
            path, record = item
            url = self._storage.url_of(f"{self._dir}/{path}")
            try:
                data = self._storage.read(f"{self._dir}/{path}")
            except FileNotFoundError:
                problem = f"metadata {url} is missing"
            else:
                ok = len(data) == record.nbytes and crc32c.crc32c(data) == record.crc32c
                problem = None if ok else f"metadata {url} does not match its checksum"
            if problem:
                with lock:
                    problems.append(problem)

        self._map(check_chunk, list(self.iter_chunks()))
        self._map(check_file, sorted(self._files.items()))
        raise_if_any(f"step {self.step} at {self.url}", problems)
