"""Reading committed steps: listing, ranged verified reads, verification, cleanup.

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
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from zerostate.partition import chunk_reads
from zerostate.store import format as fmt
from zerostate.store import refs
from zerostate.store.format import ChunkedTensorInfo
from zerostate.store.step_base import StepBase
from zerostate.store.storage import Storage, open_storage


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One stored chunk of a step, as :meth:`StepReader.iter_chunks` yields it."""

    tensor: str
    index: int
    path: str  # relative to the step directory
    nbytes: int
    crc32c: int


class CheckpointReader:
    """A checkpoint root: a directory or URL holding ``step-<8 digits>/`` steps."""

    def __init__(self, storage: Storage, num_threads: int = 8) -> None:
        self._storage = storage
        self._num_threads = num_threads

    @property
    def url(self) -> str:
        return self._storage.url

    def scan(self) -> tuple[list[int], list[int]]:
        """``(committed, partial)`` steps, ascending: one listing of the root and one
        existence check of each step's commit record."""
        return _scan(self._storage)

    def steps(self) -> list[int]:
        """Committed steps (those with a commit record), ascending.

        A damaged commit record still lists its step; opening it raises
        CorruptCheckpointError rather than silently rolling back to an older step.
        """
        return self.scan()[0]

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` has a commit record (one existence check, no listing)."""
        return self._storage.exists(f"{fmt.step_dir(step)}/{fmt.COMMIT_PATH}")

    def latest_step(self) -> int:
        committed, partial = self.scan()
        if not committed:
            # A missing directory or bucket lists as empty: name that cause instead.
            self._storage.check_readable()
            hint = f" (only partial, uncommitted steps: {partial[-5:]})" if partial else ""
            raise CheckpointNotFoundError(f"no committed step under {self.url}{hint}")
        return committed[-1]

    def step(self, step: int | None = None) -> StepReader:
        """Open a committed step (the latest when ``step`` is None)."""
        if step is None:
            step = self.latest_step()
        directory = fmt.step_dir(step)
        where = f"commit record of {self._storage.url_of(directory)}"
        try:
            raw = self._storage.read(f"{directory}/{fmt.COMMIT_PATH}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {self.url} (committed steps: "
                f"{self.steps()[-10:]})"
            ) from None
        record = fmt.parse_document(raw, "zerostate_commit", where)
        if fmt.check_format_version(record, where) == 2:
            from zerostate.store import format2
            from zerostate.store.reader_v2 import StepReaderV2

            parsed = format2.parse_commit_record(record, step, where)
            holders = self._holders(parsed, where)
            return StepReaderV2(self._storage, directory, step, parsed, self._num_threads, holders)
        world_size, attrs, tensors, files = fmt.parse_commit_record(record, step, where)
        return StepReader(
            self._storage, directory, step, world_size, attrs, tensors, files, self._num_threads
        )

    def _holders(self, parsed: Any, where: str) -> dict[int, Any]:
        """The older steps a step refers to ([Note: tensor references] in ``refs.py``)."""
        holders = {}
        for holder in sorted({k for _, k in parsed.refs.values()}):
            names = sorted(n for n, (_, k) in parsed.refs.items() if k == holder)
            try:
                holders[holder] = self.step(holder)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                shown = ", ".join(repr(n) for n in names[:5])
                raise CorruptCheckpointError(
                    f"{where}: tensor(s) {shown}{' ...' if len(names) > 5 else ''} are held "
                    f"by step {holder}, which cannot be opened: {exc}"
                ) from exc
        return holders


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
        problems: list[str] = []
        lock = threading.Lock()

        def check_chunk(ref: ChunkRef) -> None:
            try:
                self.read_chunk(ref.tensor, ref.index)
            except CorruptCheckpointError as exc:
                with lock:
                    problems.append(str(exc))
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
        if problems:
            problems.sort()
            raise CorruptCheckpointError(
                f"step {self.step} at {self.url}: {len(problems)} problem(s): "
                + "; ".join(problems[:20])
                + (" ..." if len(problems) > 20 else "")
            )


def open_checkpoint(
    root: str, storage_options: dict | None = None, *, num_threads: int = 8
) -> CheckpointReader:
    """Open a checkpoint root (path or fsspec URL) for reading. Nothing is read yet."""
    return CheckpointReader(open_storage(root, storage_options), num_threads)


def _step_dirs(storage: Storage) -> dict[int, str]:
    out = {}
    for name in storage.list_dir(""):
        step = fmt.parse_step_dir(name)
        if step is not None:
            out[step] = name
    return out


def _scan(storage: Storage) -> tuple[list[int], list[int]]:
    committed, partial = [], []
    dirs = sorted(_step_dirs(storage).items())
    records = storage.exists_many([f"{name}/{fmt.COMMIT_PATH}" for _, name in dirs])
    for (step, _), has_record in zip(dirs, records, strict=True):
        (committed if has_record else partial).append(step)
    return committed, partial


def _delete_dir(storage: Storage, step: int) -> None:
    # The commit record goes first, so a crash while deleting leaves a partial step, never
    # a committed step with missing chunks.
    directory = fmt.step_dir(step)
    storage.remove(f"{directory}/{fmt.COMMIT_PATH}")
    storage.sync_dirs()
    storage.remove_tree(directory)


def remove_partial_steps(
    root: str,
    storage_options: dict | None = None,
    *,
    only_step: int | None = None,
    below_step: int | None = None,
) -> list[int]:
    """Delete step directories that have no commit record (crashed or abandoned saves).

    ``only_step`` limits this to one step; ``below_step`` to steps smaller than it. Never
    call it while a save of an affected step may be in flight. Returns the steps removed.
    """
    storage = open_storage(root, storage_options)
    if only_step is not None:
        directory = fmt.step_dir(only_step)
        candidates = [only_step] if directory in storage.list_dir("") else []
        partial = [s for s in candidates if not storage.exists(f"{directory}/{fmt.COMMIT_PATH}")]
    else:
        partial = _scan(storage)[1]
    removed = [s for s in partial if below_step is None or s < below_step]
    if removed:  # see [Note: tensor references] in refs.py
        referenced = refs.kept_steps(storage, set(_scan(storage)[0]))
        removed = [s for s in removed if referenced is not None and s not in referenced]
    for step in removed:
        storage.remove_tree(fmt.step_dir(step))
    storage.sync_dirs()
    return removed


def prune_steps(
    root: str,
    *,
    keep_last: int | None,
    partial_below: int | None,
    storage_options: dict | None = None,
) -> tuple[list[int], list[int]]:
    """Retention in one scan: delete partial steps below ``partial_below`` (crashed saves)
    and all but the newest ``keep_last`` committed steps (the newest is always kept).
    Returns ``(committed steps deleted, partial steps deleted)``."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
    storage = open_storage(root, storage_options)
    committed, partial = _scan(storage)
    stale = [s for s in partial if partial_below is not None and s < partial_below]
    for step in stale:
        storage.remove_tree(fmt.step_dir(step))
    old = committed[:-keep_last] if keep_last else []
    if old:  # steps the kept ones refer to stay ([Note: tensor references] in refs.py)
        kept = refs.kept_steps(storage, set(committed[-keep_last:]))
        old = [s for s in old if kept is not None and s not in kept]
    # Newest first: references point to older steps, so a crash part-way leaves no
    # committed step whose holder is already gone.
    for step in sorted(old, reverse=True):
        _delete_dir(storage, step)
    storage.sync_dirs()
    return old, stale


def delete_step(root: str, step: int, storage_options: dict | None = None) -> None:
    """Delete one step, committed or not (the commit record first)."""
    storage = open_storage(root, storage_options)
    if fmt.step_dir(step) not in storage.list_dir(""):
        raise CheckpointNotFoundError(f"no step {step} under {storage.url}")
    others = [s for s in _scan(storage)[0] if s != step]
    # A step whose references cannot be read counts as referring: deleting is undoable.
    referrers = [s for s in others if step in (refs.kept_steps(storage, {s}) or {step})]
    if referrers:
        raise CheckpointError(
            f"step {step} under {storage.url} holds tensors that steps {referrers[:10]} refer "
            "to; delete those steps first (or consolidate/reshard one of them, which writes "
            "every tensor)"
        )
    _delete_dir(storage, step)
    storage.sync_dirs()
