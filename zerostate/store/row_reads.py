"""The pieces of a format-2 row read, as free functions: which inner chunks a request
covers and the buffers they fill, coalesced runs, checked blocks' residues and failing
chunks, scratch memory and the scatter of planned mesh reads ([Note: checked blocks],
[Note: mesh scatter] in zerostate.store.reader_v2)."""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from zerostate.store.rows import CHECKSUM_NBYTES, GroupPlan

#: Most row bytes one coalesced read covers (bounds a fetch's memory on object stores).
RUN_NBYTES = 64 << 20
#: Scratch spans from this size on are pages of their own (:func:`_scratch`); smaller ones
#: come from the heap, as glibc's default mmap threshold would place them.
SCRATCH_MMAP_NBYTES = 128 << 10


@dataclass(frozen=True, slots=True)
class _Piece:
    """Row bytes ``[lo, hi)`` wanted in ``dest`` (a view of a caller's tensor)."""

    lo: int
    hi: int
    dest: memoryview
    name: str


def _chunk_parts(
    run: list[_Piece], first: int, last: int, size: int
) -> tuple[list[memoryview], list[memoryview | tuple[memoryview, ...]], memoryview]:
    """The buffers one read of inner chunks ``first..last`` fills, in file order: each
    chunk's payload (a view of a piece's destination, or pieces of them and scratch for
    bytes nobody asked for), then its 4 checksum bytes (a view of the returned ``crcs``).
    Also each chunk's payload views, for the checks."""
    count = last - first + 1
    crcs = memoryview(bytearray(CHECKSUM_NBYTES * count))
    parts: list[memoryview] = []
    payloads: list[memoryview | tuple[memoryview, ...]] = []
    i, piece = 0, run[0]
    k = 0
    while k < count:
        pos = (first + k) * size
        hi = pos + size
        while piece.hi <= pos:  # the run's last piece ends inside the last chunk
            i += 1
            piece = run[i]
        if piece.lo <= pos and hi <= piece.hi:
            # The common case: one piece covers this chunk and, usually, many after it.
            n = min(count - k, (piece.hi - pos) // size)
            at, dest = pos - piece.lo, piece.dest
            views = [dest[at + j * size : at + (j + 1) * size] for j in range(n)]
            payloads += views
            parts += [
                x
                for j, view in enumerate(views, k)
                for x in (view, crcs[j * CHECKSUM_NBYTES : (j + 1) * CHECKSUM_NBYTES])
            ]
            k += n
            continue
        segments = []
        while pos < hi:
            while i < len(run) and run[i].hi <= pos:
                i += 1
            if i < len(run) and run[i].lo <= pos:
                end = min(run[i].hi, hi)
                segments.append(run[i].dest[pos - run[i].lo : end - run[i].lo])
            else:
                end = min(run[i].lo, hi) if i < len(run) else hi
                segments.append(memoryview(bytearray(end - pos)))  # not asked for
            pos = end
        i = min(i, len(run) - 1)
        piece = run[i]
        parts += segments
        payloads.append(tuple(segments))
        parts.append(crcs[k * CHECKSUM_NBYTES : (k + 1) * CHECKSUM_NBYTES])
        k += 1
    return parts, payloads, crcs


@functools.lru_cache(maxsize=64)
def _residues(size: int, count: int) -> tuple[int, ...]:
    """``r[k]``: the crc32c of ``k`` intact stored chunks of ``size`` payload bytes back to
    back, ``k = 0..count`` ([Note: checked blocks]); found from zero chunks, as any give it."""
    zero = bytes(size)
    chunk = zero + struct.pack("<I", crc32c.crc32c(zero))
    out = [0]
    for _ in range(count):
        out.append(crc32c.crc32c(chunk, out[-1]))
    return tuple(out)


def _failing_chunks(records: np.ndarray, size: int) -> Iterator[tuple[int, int, int]]:
    """``(k, actual, stored)`` for each stored chunk ``records[k]`` (payload of ``size``
    bytes, then its little-endian crc32c) whose payload fails its checksum."""
    for k, record in enumerate(records):
        actual = crc32c.crc32c(record[:size])
        stored_crc = int.from_bytes(record[size:].tobytes(), "little")
        if actual != stored_crc:
            yield k, actual, stored_crc


def _copy_payload(rows: np.ndarray, u: int, v: int, dest: np.ndarray, size: int) -> None:
    """Copy payload bytes ``[u, v)`` of a block (``rows``: its chunks' payloads, one per
    row) into ``dest``: a partial first row, whole rows in one strided copy, a partial
    last row."""
    r0, o0 = divmod(u, size)
    r1, o1 = divmod(v, size)
    if r0 == r1:
        dest[:] = rows[r0, o0:o1]
        return
    at = 0
    if o0:
        at = size - o0
        dest[:at] = rows[r0, o0:]
        r0 += 1
    if r1 > r0:
        n = (r1 - r0) * size
        dest[at : at + n].reshape(r1 - r0, size)[:] = rows[r0:r1]
        at += n
    if o1:
        dest[at:] = rows[r1, :o1]


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Room for a stored span that is copied out piecewise: pages of its own, given back to
    the system when the last reference goes, so a long run of reads (a reshard, a
    consolidation) does not grow the C heap ([Note: reshard memory] in store/reshard.py).
    Measured: the 64 MB reshard of (tp 2 x dp 2) to one rank peaked 26.7 MB above an idle
    process with heap scratch, 15 MB with these. The cost is fresh pages for every read: the
    four dp-4 ranges of that step read again in one process took 0.07-0.08 s of CPU against
    0.03 s from the heap, while a first read in a fresh process (a resumed job) took the
    same either way (0.10-0.14 s)."""
    if numel * dtype.itemsize < SCRATCH_MMAP_NBYTES:
        return torch.empty(numel, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


def _scatter(out: torch.Tensor, data: torch.Tensor, lo: int, copies: list) -> None:
    """Apply planned copies (:class:`zerostate.layout.planner.Copy`) from ``data``, a source
    piece's elements from offset ``lo`` on, to ``out``: one copy, strided over its rows.

    [Note: mesh scatter]
    A load at another tensor-parallel degree reads, for a tensor sharded on dimension 1 (a
    row-parallel weight), one stored span per piece that holds one segment per outer row: a
    512-row weight read by 4 ranks from 2 tp shards is 128 segments of 688 elements per
    shard and rank. Each piece was read into a scratch tensor (first touches, then a second
    copy) and cut with one ``copy_`` per segment, about 9,000 per rank on the report's
    layout row. Now the planner's row bands ([Note: row bands] in zerostate.layout.planner)
    give one copy per run of rows at one stride, done as one strided copy, and a piece read
    that fills one range of ``out`` is read there directly. The layout row (296 MiB, 4 ranks,
    cold cache), the same command run back to back before and after strided copies: 0.536 s
    against 0.331 s, with ``cat`` of the same files at 0.095 s in both runs."""
    base_out, base_data = out.storage_offset(), data.storage_offset()
    for c in copies:
        src = c.source_offset - lo
        if c.rows == 1:
            out[c.target_offset : c.target_offset + c.numel].copy_(data[src : src + c.numel])
            continue
        dest = out.as_strided((c.rows, c.numel), (c.target_stride, 1), base_out + c.target_offset)
        dest.copy_(data.as_strided((c.rows, c.numel), (c.source_stride, 1), base_data + src))


def _split_crc32c(segments: tuple[memoryview, ...]) -> int:
    """crc32c of a chunk split between asked-for bytes and scratch."""
    actual = 0
    for segment in segments:
        actual = crc32c.crc32c(segment, actual)
    return actual


def _stored_span(plan: GroupPlan, rank: int, run: list[_Piece]) -> tuple[int, int] | None:
    """Object bytes ``[start, stop)`` the stored inner chunks under ``run`` occupy in
    ``rank``'s row, None when the plan does not place them (the read names that)."""
    first, last = run[0].lo // plan.inner, (run[-1].hi - 1) // plan.inner
    p0, p1 = plan.position(rank, first), plan.position(rank, last)
    if p0 is None or p1 is None:
        return None
    return p0 * plan.stored_chunk_nbytes, (p1 + 1) * plan.stored_chunk_nbytes


def _runs(pieces: list[_Piece], inner: int) -> list[list[_Piece]]:
    """Split sorted, disjoint pieces into runs whose inner chunks are adjacent (a piece may
    share a chunk with the next), each run at most ``RUN_NBYTES`` of chunks."""
    runs: list[list[_Piece]] = []
    for piece in pieces:
        if runs:
            run = runs[-1]
            gap_ok = piece.lo // inner <= (run[-1].hi - 1) // inner + 1
            if gap_ok and piece.hi - run[0].lo <= RUN_NBYTES:
                run.append(piece)
                continue
        runs.append([piece])
    return runs


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
