"""The copy plan from one layout of a tensor to another ([Note: tensor-parallel layouts]).

Pure: no ``torch.distributed``, no I/O. Every read of a format-3 tensor is planned here
([Note: mesh tensors] in ``zerostate.store.geometry``), and the step reader (``reader_v2``)
reads, per source piece, the stored span the copies touch:

* ``engine.load`` on a tp mesh asks for each view's range of its tp shard in the engine's
  layout, and ``reshard`` for each target piece, block by block
  (``StepSource.read_layout_many``): :func:`plan_range`;
* ``engine.load`` without tp, ``consolidate`` (the tp 1 x dp 1 target) and any other reader
  of the global tensor ask for logical ranges: :func:`plan_logical`, the range of
  :func:`whole`'s one shard.

:func:`plan` gives the copies of every target piece at once, for tools and tests; each
piece's are :func:`plan_range`'s, so the two cannot disagree.

A range of a target tp shard is planned by one of three paths, each covering every target
element exactly once:

* **same tp cut** (only the data-parallel cut differs): tp shard ``t`` is the same local
  tensor on both sides, so a range of it is 1-D range intersection with the source's chunk
  grid of shard ``t`` (:func:`zerostate.layout.partition.chunk_reads`), a few copies per range;
* **many rows** (the rows before the inner shard dim outnumber the dp pieces): see
  [Note: row bands];
* **general** (few rows): every source segment sorted by global start, and each target
  segment walks the sorted list from a bisection (sorted interval intersection), one copy
  per overlap. The whole tensor (consolidation) is one target segment: one copy per source
  segment.

The source side of the last two (its pieces' bands, its sorted segments) is built once per
layout and kept with it (:meth:`MeshLayout.memo`), so the many ranges a reader asks of one
tensor pay for it once.

[Note: row bands]
Around a shard dim ``d`` every layout of a tensor views it as ``outer`` rows of
``prod(shape[d:])`` elements, and a piece of a layout sharded on ``d`` holds, in every row it
covers fully, the same runs of columns (one per fused sub-tensor), ``piece_stride`` elements
further on in the piece for each next row: at most three *bands* (a partial first row, whole
rows, a partial last row), each a list of ``(column, length, piece offset)`` runs repeated over
rows. A piece of a layout sharded on an outer dim (or not at all) is a few global segments,
whole rows but for their ends: three bands per segment. Intersecting a target band with a
source band is intersecting their runs once, over the rows both cover: one :class:`Copy` with
``rows`` > 1 and both strides. A ``Shard(1)`` tensor of 128256 rows at tp 8 thus plans in about
a thousand copies, where one copy per row and piece would be a million.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Iterator
from typing import NamedTuple

from zerostate.errors import LayoutError
from zerostate.layout.mesh_layout import MeshLayout, PieceId
from zerostate.layout.partition import chunk_reads


class Copy(NamedTuple):
    """Copy ``numel`` elements from ``source`` piece at ``source_offset`` to the target piece
    at ``target_offset`` (offsets in elements of the flattened pieces), ``rows`` times, the
    ``k``-th time from ``source_offset + k * source_stride`` to
    ``target_offset + k * target_stride`` ([Note: row bands]); strides are 0 when ``rows`` is 1.
    """

    source: PieceId
    source_offset: int
    numel: int
    target_offset: int
    rows: int = 1
    source_stride: int = 0
    target_stride: int = 0

    @property
    def total_numel(self) -> int:
        return self.numel * self.rows

    def flat(self) -> list[Copy]:
        """The same copy as ``rows`` single-row copies."""
        return [
            Copy(
                self.source,
                self.source_offset + k * self.source_stride,
                self.numel,
                self.target_offset + k * self.target_stride,
            )
            for k in range(self.rows)
        ]


Plan = dict[PieceId, list[Copy]]
"""Target piece id -> the copies that fill it; every target piece is a key, empty ones too."""


def _same_tp_cut(a: MeshLayout, b: MeshLayout) -> bool:
    if not a.tp_sharded and not b.tp_sharded:
        return True
    return (a.tp_dim, a.tp_degree, a.fused_sizes) == (b.tp_dim, b.tp_degree, b.fused_sizes)


def plan(source: MeshLayout, target: MeshLayout, name: str = "<tensor>") -> Plan:
    """For each target piece, the copies from source pieces that fill it exactly once: each
    piece's :func:`plan_range` over its data-parallel range.

    Replicas (``dp_replicate``) share piece ids on both sides: a target replica reads the plan
    of its piece id, from any replica of each source piece."""
    _check_shapes(source, target, name)
    return {
        (t, r): plan_range(source, target, t, *target.dp_layout(t).owned_range(r))
        for t, r in target.piece_ids()
    }


def plan_range(
    source: MeshLayout, target: MeshLayout, tp_index: int, start: int, stop: int
) -> list[Copy]:
    """The copies from ``source`` pieces that fill elements ``[start, stop)`` of flattened tp
    shard ``tp_index`` of ``target`` exactly once; target offsets count from ``start``.

    A target piece is its dp range (:func:`plan`); a logical range of the tensor is a range
    of :func:`whole`'s one tp shard (:func:`plan_logical`); an engine view, a range of its
    own tp shard. The source side's index is built once per layout (the layout caches it)."""
    _check_shapes(source, target, "<tensor>")
    if not 0 <= start <= stop <= math.prod(target.local_shape(tp_index)):
        raise LayoutError(
            f"range [{start}, {stop}) outside tp shard {tp_index} of "
            f"{math.prod(target.local_shape(tp_index))} elements"
        )
    if start == stop:
        return []
    if _same_tp_cut(source, target):
        return _range_dp_only(source, tp_index, start, stop)
    dims = [x.tp_dim for x in (source, target) if x.tp_sharded]
    if dims:
        dim = max(dims)  # the other side, sharded on an outer dim, is whole rows of this one
        # Bands pay off when rows outnumber dp pieces; with few rows, pieces share rows and
        # pairing bands row by row is quadratic, while segments are few (a row's runs each).
        if math.prod(source.shape[:dim]) > 4 * max(source.dp_shard, target.dp_shard):
            return _copies_by_bands(source, target, tp_index, start, stop, dim)
    return _copies_general(source, target, tp_index, start, stop)


def plan_logical(source: MeshLayout, start: int, stop: int) -> list[Copy]:
    """The copies filling logical elements ``[start, stop)`` of the flattened tensor (what a
    reader of the global tensor asks for) from ``source`` pieces."""
    return plan_range(source, whole(source.shape), 0, start, stop)


@functools.lru_cache(maxsize=256)
def whole(shape: tuple[int, ...]) -> MeshLayout:
    """The tp 1 x dp 1 layout: one piece, the global tensor (``consolidate``'s target)."""
    return MeshLayout(shape=shape)


def _check_shapes(source: MeshLayout, target: MeshLayout, name: str) -> None:
    if source.shape != target.shape:
        raise LayoutError(
            f"tensor {name!r}: global shape {list(source.shape)} cannot be laid out as "
            f"{list(target.shape)}"
        )


def _range_dp_only(source: MeshLayout, t: int, start: int, stop: int) -> list[Copy]:
    # Tp shard t is the same local tensor on both sides: 1-D range intersection.
    src = source.dp_layout(t)
    return [
        _new(
            Copy,
            ((t, src.chunk_owner(r.chunk_index)), r.chunk_start, r.numel, r.out_start, 1, 0, 0),
        )
        for r in chunk_reads(src, start, stop)
    ]


Band = tuple[int, int, list[tuple[int, int, int]], int]
"""``(first row, stop row, runs, piece_stride)``; runs are ``(column, length, piece offset at
the first row)``, sorted by column ([Note: row bands])."""


def _bands(layout: MeshLayout, t: int, start: int, stop: int, dim: int) -> list[Band]:
    """The bands of elements ``[start, stop)`` of flattened tp shard ``t`` (piece offsets from
    ``start``) in rows of ``prod(shape[dim:])`` elements. A layout sharded on ``dim`` repeats
    its tp blocks in every row; any other (not tp-sharded, or sharded on an outer dim) is a
    few global segments, each whole rows but for its ends."""
    inner = math.prod(layout.shape[dim + 1 :])
    if layout.tp_sharded and layout.tp_dim == dim:
        spans = [(g * inner, n * inner, lr * inner) for g, n, lr in layout.tp_blocks(t)]
        return _range_bands(start, stop, spans, 0)
    row = layout.shape[dim] * inner
    return [
        band
        for g, n, off in layout.local_segments(t, start, stop)
        for band in _range_bands(g, g + n, [(0, row, 0)], off)
    ]


def _range_bands(
    start: int, stop: int, spans: list[tuple[int, int, int]], offset: int
) -> list[Band]:
    """Bands of elements ``[start, stop)`` of a flat range whose rows each hold ``spans``
    (``(column, length, position in the row)``); the element at ``start`` is at piece offset
    ``offset``."""
    if stop <= start:
        return []
    stride = sum(n for _, n, _ in spans)
    first, last = start // stride, (stop - 1) // stride
    shift = offset - start

    def clipped(row: int) -> Band:
        runs = []
        base = row * stride
        for col, n, pos in spans:
            lo, hi = max(base + pos, start), min(base + pos + n, stop)
            if lo < hi:
                runs.append((col + lo - base - pos, hi - lo, lo + shift))
        return row, row + 1, runs, 0

    body_first = first if start == first * stride else first + 1
    body_stop = last + 1 if stop == (last + 1) * stride else last
    bands = [] if body_first == first else [clipped(first)]
    if body_first < body_stop:
        base = body_first * stride + shift
        bands.append((body_first, body_stop, [(c, n, base + p) for c, n, p in spans], stride))
    if body_stop <= last and (last != first or body_first == first):
        bands.append(clipped(last))
    return bands


def _source_bands(source: MeshLayout, dim: int) -> list[tuple[list[int], list]]:
    """Per source tp shard, its pieces' bands sorted by rows, and their stop rows (for a
    bisection); built once per layout and dim."""

    def build() -> list[tuple[list[int], list[tuple[PieceId, Band]]]]:
        by_tp: list[tuple[list[int], list[tuple[PieceId, Band]]]] = []
        for t in range(source.num_tp_pieces):
            dp = source.dp_layout(t)
            bands = [
                ((t, r), band)
                for r in range(source.dp_shard)
                for band in _bands(source, t, *dp.owned_range(r), dim)
            ]
            bands.sort(key=lambda e: (e[1][0], e[1][1]))
            by_tp.append(([band[1] for _, band in bands], bands))
        return by_tp

    return source.memo(("bands", dim), build)


def _copies_by_bands(
    source: MeshLayout, target: MeshLayout, t: int, start: int, stop: int, dim: int
) -> list[Copy]:
    by_tp = _source_bands(source, dim)
    copies: list[Copy] = []
    for r0, r1, truns, tstride in _bands(target, t, start, stop, dim):
        for stops, bands in by_tp:
            # Within one tp shard, bands ascend in rows and only a split row is shared.
            i = bisect_right(stops, r0)
            while i < len(bands) and bands[i][1][0] < r1:
                copies.extend(_band_copies(*bands[i], (r0, r1, truns, tstride)))
                i += 1
    return copies


def _plan_bands(source: MeshLayout, target: MeshLayout, dim: int) -> Plan:
    """:func:`plan` by row bands alone, whatever pair (tests run every path on every pair)."""
    return {
        (t, r): _copies_by_bands(source, target, t, *target.dp_layout(t).owned_range(r), dim)
        for t, r in target.piece_ids()
    }


def _band_copies(spid: PieceId, source: Band, target: Band) -> Iterator[Copy]:
    """Copies of the elements a source band and a target band share: each pair of overlapping
    runs, once over the rows both bands cover."""
    s0, s1, sruns, sstride = source
    r0, r1, truns, tstride = target
    lo_row, hi_row = max(r0, s0), min(r1, s1)
    if lo_row >= hi_row:
        return
    rows = hi_row - lo_row
    t_base, s_base = (lo_row - r0) * tstride, (lo_row - s0) * sstride
    if rows == 1:
        sstride = tstride = 0  # one canonical spelling of a single-row copy
    for lo, hi, tc, toff, sc, soff in _overlaps(truns, sruns):
        yield Copy(
            spid, soff + s_base + lo - sc, hi - lo, toff + t_base + lo - tc, rows, sstride, tstride
        )


def _overlaps(
    a: list[tuple[int, int, int]], b: list[tuple[int, int, int]]
) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Overlapping column ranges of two sorted run lists: ``(lo, hi, a column, a offset,
    b column, b offset)`` for each pair of runs that overlap."""
    i = j = 0
    while i < len(a) and j < len(b):
        ac, an, aoff = a[i]
        bc, bn, boff = b[j]
        lo, hi = max(ac, bc), min(ac + an, bc + bn)
        if lo < hi:
            yield lo, hi, ac, aoff, bc, boff
        if ac + an <= bc + bn:
            i += 1
        else:
            j += 1


# Copies are built with tuple.__new__: a NamedTuple's own constructor costs several times more,
# and across different shard dims a tensor plans one copy per row of each tp shard.
_new = tuple.__new__


def _source_index(source: MeshLayout) -> tuple[list[int], list[tuple[int, int, PieceId, int]]]:
    """Every source segment ``(global start, length, piece, piece offset)`` sorted by global
    start, and the starts (for a bisection); built once per layout."""

    def build() -> tuple[list[int], list[tuple[int, int, PieceId, int]]]:
        index = [
            (g, n, pid, off) for pid in source.piece_ids() for g, n, off in source.segments(pid)
        ]
        index.sort()  # starts are distinct: the segments tile the tensor
        return [entry[0] for entry in index], index

    return source.memo("index", build)


def _copies_general(
    source: MeshLayout, target: MeshLayout, t: int, start: int, stop: int
) -> list[Copy]:
    starts, index = _source_index(source)
    copies: list[Copy] = []
    append = copies.append
    for g, n, off in target.local_segments(t, start, stop):
        end = g + n
        i = bisect_right(starts, g) - 1
        sg, sn, spid, soff = index[i]
        lo = g  # the first source segment may start before g; the next ones start at lo
        while True:
            seg_stop = sg + sn
            hi = end if end < seg_stop else seg_stop
            append(_new(Copy, (spid, soff + lo - sg, hi - lo, off + lo - g, 1, 0, 0)))
            if seg_stop >= end:
                break
            i += 1
            sg, sn, spid, soff = index[i]
            lo = sg
    return copies


def _plan_general(source: MeshLayout, target: MeshLayout) -> Plan:
    """:func:`plan` by sorted segments alone, whatever pair."""
    return {
        (t, r): _copies_general(source, target, t, *target.dp_layout(t).owned_range(r))
        for t, r in target.piece_ids()
    }
