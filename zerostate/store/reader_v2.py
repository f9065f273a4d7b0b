"""Reading a committed format-2 step: ranged, verified reads from the group rows.

A read of elements ``[start, stop)`` of a tensor becomes, per owning rank, one byte range
of that rank's row ([Note: rows] in ``rows.py``). The inner chunks covering it are read
with one ranged request (they are adjacent in the object), each is checked against its
crc32c, and the requested bytes land in the destination; only the partial first and last
chunks go through scratch space. From local files, rows of small inner chunks are read
through scratch in checked blocks instead ([Note: checked blocks]). The shard index is
not needed for that (positions follow from the plan); ``verify`` reads and checks it
along with every chunk.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import crc32c
import numpy as np
import torch

from zerostate.errors import ConfigError, CorruptCheckpointError
from zerostate.layout import planner as layout_plan
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import chunk_reads, even_layout
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store import geometry as mesh_mod
from zerostate.store import refs as refs_mod
from zerostate.store.base import RangeReader
from zerostate.store.problems import Problem
from zerostate.store.row_reads import (
    RUN_NBYTES,
    _chunk_parts,
    _copy_payload,
    _failing_chunks,
    _names,
    _Piece,
    _residues,
    _runs,
    _scatter,
    _scratch,
    _split_crc32c,
    _stored_span,
)
from zerostate.store.row_verify import RowVerification
from zerostate.store.rows import CHECKSUM_NBYTES, GroupPlan, row_path
from zerostate.store.step_base import StepBase, map_failed
from zerostate.store.storage import Storage

#: Bytes verify reads per request: bounds its memory whatever the row size.
VERIFY_BLOCK_NBYTES = 64 << 20
#: The same from local files, where a fresh 64 MiB buffer per row costs more in first
#: touches than its read: ``verify`` of the 268 MB Llama step, warm, took 0.096 s with 64
#: MiB buffers and 0.045 s with 4 MiB ones (one thread).
LOCAL_VERIFY_BLOCK_NBYTES = 4 << 20
#: Results larger than this are allocated only after a one-byte read shows the data exists.
PROBE_NBYTES = 64 << 20
#: Stored bytes one block of a local read moves through scratch ([Note: checked blocks]).
BLOCK_NBYTES = 128 << 10
#: Fewest stored chunks per block for the block path; rows of larger chunks read in place.
MIN_BLOCK_CHUNKS = 4
#: Whether a local stream reads through a gap no longer than the run before it
#: ([Note: filled gaps]).
FILL_GAPS = True
#: Marks a read of a mesh tensor's stored array in ``_read_stored``'s requests.
_STORED = object()


class StepReaderV2(RowVerification, StepBase):
    """One committed format-2 step (a sibling of format 1's ``StepReader``, see
    ``step_base.py``)."""

    format_version = format2.VERSION
    supports_references = True

    def __init__(
        self,
        storage: Storage,
        directory: str,
        step: int,
        record: format2.StepRecord,
        num_threads: int,
        holders: dict[int, StepReaderV2] | None = None,
    ) -> None:
        tensors = dict(record.tensors)
        where = f"commit record of step {step}"
        #: Referenced tensor -> the step reader of the older step holding it.
        self._held_by: dict[str, StepReaderV2] = {}
        for name, (ref, k) in record.refs.items():
            holder = (holders or {}).get(k)
            if not isinstance(holder, StepReaderV2) or name in holder._held_by:
                raise CorruptCheckpointError(
                    f"{where}: {name!r} refers to step {k}, which does not store it itself"
                )
            held = holder.tensors.get(name)
            refs_mod.check_holder_entry(ref, held, where)
            tensors[name] = held
            self._held_by[name] = holder
        self._holders = dict(holders or {})
        # Mesh tensors show their logical tensor; reads go through their stored arrays
        # ([Note: mesh tensors] in store/mesh.py).
        self._meshes = {name: (mesh, tensors[name]) for name, mesh in record.meshes.items()}
        for name, (mesh, stored) in self._meshes.items():
            tensors[name] = fmt.TensorInfo(
                name, mesh.shape, stored.dtype, even_layout(mesh.numel, 1), stored.attrs
            )
        self.format_version = record.format_version
        super().__init__(step, record.world_size, record.attrs, tensors, num_threads)
        self._storage, self._dir, self._files = storage, directory, record.files
        self._plans, self._rows, self._manifests = record.plans, record.rows, record.manifests
        self._checked: set[tuple[str, int]] = set()
        self._checked_lock = threading.Lock()
        self._scratch = threading.local()  # each reading thread's block buffer

    @property
    def url(self) -> str:
        return self._storage.url_of(self._dir)

    @property
    def reads_locally(self) -> bool:  # type: ignore[override]
        return self._storage.reads_locally

    @property
    def object_count(self) -> int:
        """Objects of the step: rows, metadata documents, manifests, commit record."""
        rows = sum(r is not None for rows in self._rows.values() for r in rows)
        return rows + len(self._files) + self.world_size + 1

    def row_objects(self) -> list[tuple[str, int, int]]:
        """``(group, rank, nbytes)`` of every row object the step holds."""
        return [
            (g, r, row.nbytes)
            for g, rows in self._rows.items()
            for r, row in enumerate(rows)
            if row is not None
        ]

    @property
    def refs(self) -> dict[str, int]:
        """``{tensor: holder step}`` of the tensors this step refers to instead of storing."""
        return {name: holder.step for name, holder in self._held_by.items()}

    def close(self) -> None:
        super().close()
        for holder in self._holders.values():
            holder.close()

    def locate(self, name: str, element: int) -> tuple[str, int]:
        """Where element ``element`` of tensor ``name`` is stored: the row object's path
        (relative to the checkpoint root) and the byte offset in it (for tools and tests)."""
        if name in self._held_by:
            return self._held_by[name].locate(name, element)
        info = self.info(name)
        if not 0 <= element < info.numel:
            raise ConfigError(f"{name}: element {element} outside [0, {info.numel})")
        if name in self._meshes:  # the element's place in the stored array
            mesh, info = self._meshes[name]
            (copy,) = layout_plan.plan_logical(mesh, element, element + 1)
            element = mesh_mod.stored_start(mesh, info.layout, copy.source) + copy.source_offset
        plan = self._plans[info.group]  # type: ignore[index]
        chunk = element // info.layout.chunk_numel
        rank = info.layout.chunk_owner(chunk)
        at = info.offset + (element - chunk * info.layout.chunk_numel) * info.dtype.itemsize
        position = plan.position(rank, at // plan.inner)
        assert position is not None, "an owned byte lies in a stored inner chunk"
        offset = position * plan.stored_chunk_nbytes + at % plan.inner
        return f"{self._dir}/{row_path(plan.name, rank)}", offset

    def _row(self, plan: GroupPlan, rank: int) -> format2.RowRecord | None:
        row = self._rows[plan.name][rank]
        key = (plan.name, rank)
        if key not in self._checked:
            format2.check_row(plan, rank, row, f"commit record of {self.url}")
            with self._checked_lock:
                self._checked.add(key)
        return row

    def _row_url(self, plan: GroupPlan, rank: int) -> str:
        return self._storage.url_of(f"{self._dir}/{row_path(plan.name, rank)}")

    # ------------------------------------------------------------------- reads
    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flat tensor, verified, as a 1-D tensor.

        Only the inner chunks overlapping the range are read. If one fails its checks the
        error is raised and ``out`` may hold part of the data.
        """
        return self.read_many([(name, start, stop, out)])[0]

    def read_many(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """Several ``(name, start, stop, out)`` reads at once (see :meth:`read_range`):
        every inner chunk they need is read once, adjacent chunks of a row in one request,
        whichever tensors they serve. A loader reads all its ranges this way."""
        requests = list(requests)
        if self._meshes and any(r[0] in self._meshes for r in requests):
            return self._read_many_meshes(requests)
        if self._held_by and any(r[0] in self._held_by for r in requests):
            return self._read_many_with_refs(requests)
        return self._read_stored(requests)

    def mesh_layout(self, name: str) -> MeshLayout | None:
        """The tp x dp layout ``name`` was stored in (None: a plain format-2 tensor)."""
        entry = self._meshes.get(name)
        return entry[0] if entry is not None else None

    def _read_many_meshes(self, requests: list[tuple]) -> list[torch.Tensor]:
        """Logical reads of mesh tensors, planned by :func:`zerostate.layout.planner.plan_logical`;
        other requests are read as usual."""
        outs: list[Any] = [None] * len(requests)
        plain: list[int] = []
        planned: list[tuple[str, list, torch.Tensor]] = []
        for i, (name, start, stop, out) in enumerate(requests):
            if name not in self._meshes:
                plain.append(i)
                continue
            start, stop, out = self._check_range(self.tensors[name], start, stop, out)
            outs[i] = out
            planned.append(
                (name, layout_plan.plan_logical(self._meshes[name][0], start, stop), out)
            )
        for i, got in zip(plain, self.read_many([requests[i] for i in plain]), strict=True):
            outs[i] = got
        self._read_planned(planned)
        return outs

    def read_layout_many(self, requests: Iterable[tuple]) -> None:
        """:meth:`StepBase.read_layout_many`: a mesh tensor's range of a target tp shard is
        planned at once by :func:`zerostate.layout.planner.plan_range` (row bands: a copy per
        run of rows, where logical segments would be one read per row); other tensors are
        read by their logical segments."""
        planned: list[tuple[str, list, torch.Tensor]] = []
        rest = []
        for request in requests:
            name, target, tp_index, start, stop, out = request
            if name not in self._meshes:
                rest.append(request)
                continue
            mesh = self._meshes[name][0]
            if tuple(target.shape) != mesh.shape:
                raise ConfigError(
                    f"{name}: a layout of shape {list(target.shape)} asked of a tensor of "
                    f"shape {list(mesh.shape)}"
                )
            numel = math.prod(target.local_shape(tp_index))  # the tp shard, flattened
            shard = fmt.TensorInfo(name, (numel,), self.tensors[name].dtype, even_layout(numel, 1))
            start, stop, out = self._check_range(shard, start, stop, out)
            planned.append((name, layout_plan.plan_range(mesh, target, tp_index, start, stop), out))
        if rest:
            super().read_layout_many(rest)
        self._read_planned(planned)

    def _read_planned(self, planned: list[tuple[str, list, torch.Tensor]]) -> None:
        """Run planned copies (``(name, copies, out)``, copies from the mesh tensor's pieces
        into ``out``): one read of each source piece's stored span the copies touch; a span
        that is one contiguous range of ``out`` lands there directly, the others are copied
        into place afterwards ([Note: mesh scatter])."""
        stored: list[tuple] = []
        scatter: list[tuple[torch.Tensor, torch.Tensor, int, list]] = []
        for name, plan, out in planned:
            mesh, info = self._meshes[name]
            by_piece: dict[Any, list] = {}
            for copy in plan:
                by_piece.setdefault(copy.source, []).append(copy)
            for piece, copies in by_piece.items():
                base = mesh_mod.stored_start(mesh, info.layout, piece)
                lo = min(c.source_offset for c in copies)
                hi = max(c.source_offset + (c.rows - 1) * c.source_stride + c.numel for c in copies)
                if len(copies) == 1 and copies[0].rows == 1:  # one run: read in place
                    at = copies[0].target_offset
                    stored.append((_STORED, name, base + lo, base + hi, out[at : at + hi - lo]))
                    continue
                scratch = _scratch(hi - lo, out.dtype)
                stored.append((_STORED, name, base + lo, base + hi, scratch))
                scatter.append((out, scratch, lo, copies))
        self._read_stored(stored)
        del stored
        with torch.no_grad():
            while scatter:  # each scratch span goes once it has been copied out
                out, data, lo, copies = scatter.pop()
                _scatter(out, data, lo, copies)

    def _read_stored(self, requests: list[tuple]) -> list[torch.Tensor]:
        """:meth:`read_many` of tensors this step's own rows hold."""
        outs: list[torch.Tensor] = []
        pieces: dict[tuple[str, int], list[_Piece]] = {}
        for request in requests:
            if request[0] is _STORED:  # a mesh tensor's stored array ([Note: mesh tensors])
                _, name, start, stop, out = request
                info = self._meshes[name][1]
            else:
                name, start, stop, out = request
                info = self.info(name)
            if out is None:
                self._probe(info, start, stop)
            start, stop, out = self._check_range(info, start, stop, out)
            outs.append(out)
            if stop == start:
                continue
            dest = memoryview(out.view(torch.uint8).numpy()).cast("B")
            size = info.dtype.itemsize
            for read in chunk_reads(info.layout, start, stop):
                at, lo = read.out_start * size, info.offset + read.chunk_start * size
                key = (info.group, info.layout.chunk_owner(read.chunk_index))
                part = dest[at : at + read.numel * size]
                # Cut at multiples of RUN_NBYTES (inner chunks divide it): no fetch grows
                # past it, and no chunk is read by two of them.
                todo = pieces.setdefault(key, [])
                while part.nbytes:
                    take = min(part.nbytes, (lo // RUN_NBYTES + 1) * RUN_NBYTES - lo)
                    todo.append(_Piece(lo, lo + take, part[:take], name))
                    lo, part = lo + take, part[take:]
        jobs = []
        for (group, rank), todo in pieces.items():
            plan = self._plans[group]
            while todo:  # pieces that overlap an earlier one go in a later pass
                todo.sort(key=lambda p: p.lo)
                batch, later, end = [], [], -1
                for piece in todo:
                    (batch if piece.lo >= end else later).append(piece)
                    end = max(end, piece.hi) if piece.lo >= end else end
                jobs += [(plan, rank, run) for run in _runs(batch, plan.inner)]
                todo = later
        if self._storage.reads_ahead:
            # One ordered stream per row object ([Note: local read order]).
            streams: dict[tuple[str, int], list[tuple]] = {}
            for job in jobs:
                streams.setdefault((job[0].name, job[1]), []).append(job)
            local = self._storage.reads_locally
            self._map(self._read_stream, list(streams.values()), cpu_bound=local)
        else:
            self._map(lambda job: self._read_run(*job), jobs)
        return outs

    def _read_stream(self, jobs: list[tuple[GroupPlan, int, list[_Piece]]]) -> None:
        """The runs of one row object, in file order, through one handle.

        [Note: local read order]
        On a backend that reads ahead (local disk) each row object is one stream, read in
        file order through one handle, and the streams run on the reader's threads. One
        thread per rank, reading the objects one after the other, was tried: in repeated
        loads in one process (2 -> 3 ranks on 2 cores, cold page cache, a 128 MB Llama
        checkpoint) it was faster, 0.10 s against 0.12 s median, but in the first load of
        a fresh process, which is what a resumed run does, it was no faster on that model
        (0.129 s against 0.133 s) and slower on the report's GPT-2 model (0.26 s against
        0.22 s, 5 alternating loads each): a first load also faults in the engine's fresh
        memory, and the threads overlap that with the reads. Checks stay with the read
        that fetched them; on a separate thread they contend for the interpreter lock.
        """
        plan, rank = jobs[0][0], jobs[0][1]
        fill = FILL_GAPS and self._storage.reads_locally
        end = length = 0  # where the last run ended in the object, and its length
        with self._storage.open_ranges(f"{self._dir}/{row_path(plan.name, rank)}") as handle:
            for _, _, run in sorted(jobs, key=lambda job: job[2][0].lo):
                if map_failed():
                    return  # another stream failed: the load raises, stop reading
                span = _stored_span(plan, rank, run) if fill else None
                if span is not None and length and 0 < span[0] - end <= length:
                    self._read_through(handle, end, span[0])  # [Note: filled gaps]
                self._read_run(plan, rank, run, handle)
                if span is not None:
                    end, length = span[1], span[1] - span[0]

    def _read_through(self, handle: RangeReader, start: int, stop: int) -> None:
        """Read object bytes ``[start, stop)`` and drop them (a gap between two runs of
        one stream); a short read just ends it, the next run's read names the problem.

        [Note: filled gaps]
        A resharding load reads each row object in pieces: the new rank wants some chunks
        of every tensor in a row, not all of them, so its runs leave gaps. On local disk a
        gap costs more than its bytes: the kernel's readahead stops at the jump and the
        next run starts with a cold, synchronous request. So a local stream reads through
        a gap that is no longer than the run before it (at most doubling what it reads)
        into a scratch buffer. Measured on this 2-core machine, 2 -> 3 ranks, cold cache,
        stage 3, the report's load row (GPT-2 'io', 266 MB), two runs each way in
        alternating order: zerostate / ``cat`` 1.18x and 1.20x with the fill (0.184 s
        both) against 1.47x and 1.86x without (0.212 s, 0.275 s). A replay of the same
        byte ranges alone took 0.161 s with it and 0.174 s without (``cat`` 0.157 s). On
        Llama checkpoints of 128 and 597 MB it was within the noise (1.36x-1.48x with,
        1.20x-1.43x without; and 1.19x-1.43x with, 1.05x-1.20x without).

        The cost is bytes copied: in the read-amplification tests each new rank now reads
        1.02-1.35x the bytes it needs (1.02-1.07x without the fill). In a load by the ranks
        of one host those gap bytes are rows other ranks read too, so the disk serves them
        once and the rest come from the page cache. Ranks on many hosts reading one shared
        filesystem through local paths do move the extra bytes. Object stores never fill:
        there every byte read is a byte paid for and there is no readahead.
        """
        sink = getattr(self._scratch, "sink", None)
        if sink is None:
            sink = self._scratch.sink = memoryview(bytearray(BLOCK_NBYTES))
        while start < stop:
            n = min(BLOCK_NBYTES, stop - start)
            if handle.read_into(start, [sink[:n]]) < n:
                return
            start += n

    def _read_many_with_refs(self, requests: list[tuple]) -> list[torch.Tensor]:
        """Requests split by the step holding their bytes; results in request order."""
        by_reader: dict[int, list[int]] = {}
        readers: dict[int, StepReaderV2] = {}
        for i, request in enumerate(requests):
            reader = self._held_by.get(request[0], self)
            readers[id(reader)] = reader
            by_reader.setdefault(id(reader), []).append(i)
        outs: list[Any] = [None] * len(requests)
        for key, indices in by_reader.items():
            reader = readers[key]
            batch = [requests[i] for i in indices]
            got = reader.read_many(batch) if reader is not self else self._read_stored(batch)
            for i, out in zip(indices, got, strict=True):
                outs[i] = out
        return outs

    def _probe(self, info: format2.RowTensorInfo, start: Any, stop: Any) -> None:
        """Before allocating a large result, read the last byte it needs from each row:
        a commit record that lies about sizes fails here, not with a huge allocation."""
        try:
            nbytes = (int(stop) - int(start)) * info.dtype.itemsize
        except (TypeError, ValueError):
            return  # _check_range names the problem
        if nbytes <= PROBE_NBYTES or not 0 <= int(start) < int(stop) <= info.numel:
            return
        plan = self._plans[info.group]  # type: ignore[index]
        size = info.dtype.itemsize
        for read in chunk_reads(info.layout, int(start), int(stop)):
            rank = info.layout.chunk_owner(read.chunk_index)
            last = info.offset + read.chunk_stop * size - 1
            position = plan.position(rank, last // plan.inner)
            at = (position if position is not None else 0) + 1
            byte = memoryview(bytearray(1))
            path = f"{self._dir}/{row_path(plan.name, rank)}"
            try:
                got = self._storage.read_range_into(path, at * plan.stored_chunk_nbytes - 1, [byte])
            except FileNotFoundError:
                got = 0
            if position is None or got != 1:
                raise CorruptCheckpointError(
                    f"tensor {info.name!r}: rank {rank}'s row of group {plan.name!r} "
                    f"({self._row_url(plan, rank)}) does not hold the {nbytes} bytes the "
                    "commit record promises (missing or truncated)"
                )

    def _read_run(
        self, plan: GroupPlan, rank: int, run: list[_Piece], handle: RangeReader | None = None
    ) -> None:
        """Read the inner chunks under ``run`` (sorted pieces whose chunks are adjacent)
        with one ranged request (through ``handle`` when given), landing piece bytes in
        place, and verify every chunk."""
        row = self._row(plan, rank)
        url = self._row_url(plan, rank)
        size, stored = plan.inner, plan.stored_chunk_nbytes
        first, last = run[0].lo // size, (run[-1].hi - 1) // size
        p0, p1 = plan.position(rank, first), plan.position(rank, last)
        names = sorted({p.name for p in run})
        what = f"tensor(s) {_names(names)}: rank {rank}'s row of group {plan.name!r} ({url})"
        if row is None or p0 is None or p1 is None or p1 - p0 != last - first:
            raise CorruptCheckpointError(f"{what} does not hold the bytes they need")
        if handle is not None and BLOCK_NBYTES // stored >= MIN_BLOCK_CHUNKS:
            self._read_blocks(plan, rank, run, handle, p0, first, last, what)
            return
        parts, payloads, crcs = _chunk_parts(run, first, last, size)
        want = (last - first + 1) * stored
        try:
            if handle is not None:
                got = handle.read_into(p0 * stored, parts)
            else:
                path = f"{self._dir}/{row_path(plan.name, rank)}"
                got = self._storage.read_range_into(path, p0 * stored, parts)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{what} is missing") from None
        if got != want:
            raise CorruptCheckpointError(
                f"{what} ends early: {got} of {want} bytes at offset {p0 * stored} "
                "(truncated or overwritten)"
            )
        stored_crcs = crcs.cast("I").tolist()  # little-endian hosts only (see format.py)
        check = crc32c.crc32c
        actual_crcs = [check(p) if type(p) is memoryview else _split_crc32c(p) for p in payloads]
        if actual_crcs != stored_crcs:
            k = next(
                k for k, (a, b) in enumerate(zip(actual_crcs, stored_crcs, strict=True)) if a != b
            )
            raise self._checksum_error(plan, rank, first + k, actual_crcs[k], stored_crcs[k])

    def _read_blocks(
        self,
        plan: GroupPlan,
        rank: int,
        run: list[_Piece],
        handle: RangeReader,
        p0: int,
        first: int,
        last: int,
        what: str,
    ) -> None:
        """:meth:`_read_run` of small inner chunks from a local file: blocks of stored
        chunks through this thread's scratch, each checked by one crc32c and copied out.

        [Note: checked blocks]
        A stored inner chunk is its ``C`` payload bytes followed by their crc32c, little
        endian. The crc32c of any such chunk, taken over all ``C + 4`` bytes, is one fixed
        value whatever the payload, and the crc32c of ``k`` such chunks back to back is,
        likewise, a fixed value for each ``k`` and ``C`` (:func:`_residues`). So a block of
        ``k`` chunks is checked by one crc32c call over its stored bytes. An error inside
        one chunk changes the block's value exactly when it changes that chunk's own check
        (the block's crc is the chunk's error term shifted, and a shift is invertible
        modulo the polynomial); errors in several chunks escape with odds of about 2^-32,
        as a damaged chunk does its own check. A block that fails is checked chunk by
        chunk, so the error names the damaged chunk as before.

        Reading in place needs two buffers per chunk (payload into the destination, crc
        aside) and one check call per chunk. With 8 KiB chunks that bookkeeping, not the
        copies, bounded a warm read at about 2.5 GB/s on one core (a 40 MB row); through
        128 KiB of scratch, one call and one strided copy per block, it reads at about
        3.2 GB/s. From 32 KiB chunks up the two are even and larger chunks read in place,
        which spares the second copy. The block's read is one ``read_into`` of at most
        ``BLOCK_NBYTES``, the slice size [Note: read size] in ``local.py`` found fastest
        cold, and the check and copy of one block overlap the kernel's readahead of the
        next. ``verify``, which has every stored byte in one buffer anyway, checks blocks
        the same way on every storage (the 128 MB step, warm: 0.07-0.08 s -> 0.035 s).
        """
        size, stored = plan.inner, plan.stored_chunk_nbytes
        per = BLOCK_NBYTES // stored
        residues = _residues(size, per)
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or scratch.nbytes < per * stored:
            scratch = self._scratch.buf = np.empty(per * stored, dtype=np.uint8)
        want = (last - first + 1) * stored
        i = 0  # the first piece not yet filled
        for c in range(first, last + 1, per):
            k = min(per, last + 1 - c)
            buf = scratch[: k * stored]
            at = (p0 + c - first) * stored
            try:
                got = handle.read_into(at, [memoryview(buf)])
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{what} is missing") from None
            if got != k * stored:
                done = (c - first) * stored + got
                raise CorruptCheckpointError(
                    f"{what} ends early: {done} of {want} bytes at offset {p0 * stored} "
                    "(truncated or overwritten)"
                )
            if crc32c.crc32c(buf) != residues[k]:
                self._name_damaged_chunk(plan, rank, buf, c)
            rows = buf.reshape(k, stored)[:, :size]
            lo, hi = c * size, (c + k) * size
            j = i
            while j < len(run) and run[j].lo < hi:
                piece = run[j]
                a, z = max(piece.lo, lo), min(piece.hi, hi)
                if a < z:
                    dest = np.frombuffer(piece.dest, dtype=np.uint8)[a - piece.lo : z - piece.lo]
                    _copy_payload(rows, a - lo, z - lo, dest, size)
                if piece.hi > hi:
                    break  # it goes on in the next block
                j += 1
            i = j

    def _name_damaged_chunk(self, plan: GroupPlan, rank: int, buf: np.ndarray, c: int) -> None:
        """Raise for the first chunk of a block (stored chunks from index ``c`` on) that
        fails its own check; the block failed its check, so one does."""
        records = buf.reshape(-1, plan.stored_chunk_nbytes)
        for k, actual, stored_crc in _failing_chunks(records, plan.inner):
            raise self._checksum_error(plan, rank, c + k, actual, stored_crc)
        raise CorruptCheckpointError(  # unreachable for a crc32c, kept so nothing passes
            f"rank {rank}'s row of group {plan.name!r} ({self._row_url(plan, rank)}), inner "
            f"chunks {c}-{c + len(records) - 1}, fail their checksum: the data is damaged"
        )

    def _checksum_error(
        self, plan: GroupPlan, rank: int, chunk: int, actual: int, stored_crc: int
    ) -> CorruptCheckpointError:
        hit = _names(plan.tensors_in_chunk(rank, chunk))
        return CorruptCheckpointError(
            f"tensor(s) {hit}: rank {rank}'s row of group {plan.name!r} "
            f"({self._row_url(plan, rank)}), inner chunk {chunk}, fails its checksum "
            f"(crc32c {actual:#010x}, stored {stored_crc:#010x}): the data is damaged"
        )

    # ------------------------------------------------------------------ verify

    def _verify_row(
        self,
        plan: GroupPlan,
        rank: int,
        row: format2.RowRecord,
        report: Callable[[str | Problem], None],
    ) -> None:
        path = f"{self._dir}/{row_path(plan.name, rank)}"
        url = self._row_url(plan, rank)
        where = f"rank {rank}'s row of group {plan.name!r} ({url})"

        def problem(
            message: str, damage: str, names: Iterable[str] = (), chunk: int | None = None
        ) -> Problem:
            return Problem(message, tuple(names), rank, plan.name, chunk, damage, url)

        chunks = [j for a, b in plan.present(rank) for j in range(a, b)]
        size, stored = plan.inner, plan.stored_chunk_nbytes
        local = self._storage.reads_locally
        block = LOCAL_VERIFY_BLOCK_NBYTES if local else VERIFY_BLOCK_NBYTES
        per_read = max(1, block // stored)
        per_check = max(1, BLOCK_NBYTES // stored)  # stored chunks per crc32c call
        residues = _residues(size, per_check)
        buf = np.empty(min(len(chunks), per_read) * stored, dtype=np.uint8)
        chunk_crcs = bytearray()
        for start in range(0, len(chunks), per_read):
            batch = chunks[start : start + per_read]
            data = buf[: len(batch) * stored]
            try:
                got = self._storage.read_range_into(path, start * stored, [memoryview(data)])
            except FileNotFoundError:
                names = sorted({s.name for _, _, s in plan.spans(rank)})
                message = f"tensor(s) {_names(names)}: {where} is missing"
                report(problem(message, "is missing", names))
                return
            data[got:] = 0  # a row cut short reads as zeros past its end
            records = data.reshape(len(batch), stored)
            chunk_crcs += records[:, size:].tobytes()
            whole = min(len(batch), got // stored)  # chunks read to their last byte
            # [Note: checked blocks]: one call per block; a failing block chunk by chunk.
            bad = []
            for k0 in range(0, whole, per_check):
                k1 = min(whole, k0 + per_check)
                if crc32c.crc32c(data[k0 * stored : k1 * stored]) != residues[k1 - k0]:
                    bad += [k0 + k for k, _, _ in _failing_chunks(records[k0:k1], size)]
            for k in bad + list(range(whole, len(batch))):
                damage = "is cut short" if k >= whole else "fails its checksum"
                names = plan.tensors_in_chunk(rank, batch[k])
                message = f"tensor(s) {_names(names)}: {where}, inner chunk {batch[k]}, {damage}"
                report(problem(message, damage, names, batch[k]))
        index = plan.index_bytes(rank)
        buf = memoryview(bytearray(len(index) + CHECKSUM_NBYTES + 1))
        got = self._storage.read_range_into(path, len(chunks) * stored, [buf])
        stored_index = bytes(buf[: len(index)])
        stored_crc = int.from_bytes(buf[len(index) : len(index) + CHECKSUM_NBYTES], "little")
        if got != len(index) + CHECKSUM_NBYTES or stored_index != index:
            message = f"{where}: the shard index is damaged or the object has the wrong size"
            report(problem(message, "shard index"))
        elif crc32c.crc32c(index) != stored_crc or stored_crc != row.index_crc32c:
            report(problem(f"{where}: the shard index fails its checksum", "shard index"))
        if crc32c.crc32c(bytes(chunk_crcs)) != row.chunks_crc32c:
            message = f"{where}: its chunk checksums do not match the commit record"
            report(problem(message, "chunk checksums"))

    # -------------------------------------------------------------- rank state
    def _rank_state(self, rank: int) -> dict | None:
        """The JSON object rank ``rank`` saved as ``rank_state`` (None if it saved none),
        read from its manifest and checked against the commit record."""
        path = fmt.manifest_path(rank)
        record = self._manifests[rank]
        problem = self._check_object(path, record, f"manifest of rank {rank}")
        if problem:
            raise CorruptCheckpointError(problem)
        raw = self._storage.read(f"{self._dir}/{path}")
        where = f"manifest of rank {rank} in {self.url}"
        manifest = fmt.parse_document(raw, "zerostate_manifest", where)
        fmt.check_format_version(manifest, where, (self.format_version,))
        if (manifest.get("step"), manifest.get("rank")) != (self.step, rank):
            raise CorruptCheckpointError(f"{where} names another step or rank")
        state = manifest.get("rank_state")
        if state is not None and not isinstance(state, dict):
            raise CorruptCheckpointError(f"{where}: rank_state is not an object")
        return state
