"""The copy plan from one layout of a tensor to another ([Note: tensor-parallel layouts]).

Pure: no ``torch.distributed``, no I/O. The same plan serves an online load (the target is the
engine's mesh), an offline ``reshard`` and ``consolidate`` (the target is tp 1 x dp 1): each
target piece is assembled from ranges of source pieces, and a reader fetches only those.

Three paths, all giving plans that cover every target element exactly once:

* **same tp cut** (only the data-parallel cut differs): tp shard ``t`` is the same local
  tensor on both sides, so each target piece is 1-D range intersection with the source's
  chunk grid of shard ``t`` (:func:`zerostate.partition.chunk_reads`), a few copies per piece;
* **consolidation** (target tp 1 x dp 1): the target piece is the global tensor itself, so
  every source segment is one copy to its global offset;
* **general**: every source segment sorted by global start, and each target segment walks
  the sorted list from a bisection (sorted interval intersection).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

from zerostate.errors import LayoutError
from zerostate.layout import MeshLayout, PieceId
from zerostate.partition import chunk_reads


class Copy(NamedTuple):
    """Copy ``numel`` elements from ``source`` piece at ``source_offset`` to the target piece
    at ``target_offset`` (offsets in elements of the flattened pieces)."""

    source: PieceId
    source_offset: int
    numel: int
    target_offset: int


Plan = dict[PieceId, list[Copy]]
"""Target piece id -> the copies that fill it; every target piece is a key, empty ones too."""


def _same_tp_cut(a: MeshLayout, b: MeshLayout) -> bool:
    if not a.tp_sharded and not b.tp_sharded:
        return True
    return (a.tp_dim, a.tp_degree, a.fused_sizes) == (b.tp_dim, b.tp_degree, b.fused_sizes)


def plan(source: MeshLayout, target: MeshLayout, name: str = "<tensor>") -> Plan:
    """For each target piece, the copies from source pieces that fill it exactly once.

    Replicas (``dp_replicate``) share piece ids on both sides: a target replica reads the plan
    of its piece id, from any replica of each source piece."""
    if source.shape != target.shape:
        raise LayoutError(
            f"tensor {name!r}: global shape {list(source.shape)} cannot be laid out as "
            f"{list(target.shape)}"
        )
    if _same_tp_cut(source, target):
        return _plan_dp_only(source, target)
    if target.numel == 0:
        return {pid: [] for pid in target.piece_ids()}
    if target.num_tp_pieces == 1 and target.dp_shard == 1 and not target.tp_sharded:
        return _plan_consolidate(source, target)
    return _plan_general(source, target)


def _plan_dp_only(source: MeshLayout, target: MeshLayout) -> Plan:
    out: Plan = {}
    for t, rank in target.piece_ids():
        src = source.dp_layout(t)
        start, stop = target.dp_layout(t).owned_range(rank)
        out[(t, rank)] = [
            Copy((t, src.chunk_owner(r.chunk_index)), r.chunk_start, r.numel, r.out_start)
            for r in chunk_reads(src, start, stop)
        ]
    return out


def _plan_consolidate(source: MeshLayout, target: MeshLayout) -> Plan:
    copies = [
        Copy(pid, off, n, g) for pid in source.piece_ids() for g, n, off in source.segments(pid)
    ]
    return {(0, 0): copies}


def _plan_general(source: MeshLayout, target: MeshLayout) -> Plan:
    index = [(g, n, pid, off) for pid in source.piece_ids() for g, n, off in source.segments(pid)]
    index.sort()  # starts are distinct: the segments tile the tensor
    starts = [entry[0] for entry in index]
    out: Plan = {}
    for pid in target.piece_ids():
        copies: list[Copy] = []
        for g, n, off in target.segments(pid):
            end = g + n
            i = bisect_right(starts, g) - 1
            while i < len(index) and index[i][0] < end:
                sg, sn, spid, soff = index[i]
                lo, hi = max(g, sg), min(end, sg + sn)
                copies.append(Copy(spid, soff + lo - sg, hi - lo, off + lo - g))
                i += 1
        out[pid] = copies
    return out
