"""Tensor-parallel x data-parallel layouts and the copy planner, on real data (one process).

The reference split below is written independently of zerostate.layout.mesh_layout:
torch.split into fused sub-tensors, torch.chunk along the shard dim (what DTensor's Shard
does), concatenation, then partition.TensorLayout for the data-parallel cut."""

from __future__ import annotations

import gc
import json
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from zerostate.errors import CorruptCheckpointError, LayoutError
from zerostate.layout.mesh_layout import (
    LAYOUT_VERSION,
    MeshLayout,
    StoredPiece,
    check_stored_pieces,
    check_tiling,
    from_json,
    stored_segments,
    to_json,
    tp_chunk,
)
from zerostate.layout.partition import TensorLayout, chunk_numel_for, even_layout
from zerostate.layout.planner import (
    Copy,
    _plan_bands,
    _plan_general,
    plan,
    plan_logical,
    plan_range,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- reference implementation ----------------------------------------------------------------


def ref_tp_shard(x: torch.Tensor, layout: MeshLayout, t: int) -> torch.Tensor:
    if layout.tp_dim is None:
        return x
    dim, n = layout.tp_dim, layout.tp_degree
    parts = []
    for sub in torch.split(x, list(layout.fused_sizes), dim=dim):
        chunks = list(torch.chunk(sub, n, dim=dim)) if sub.shape[dim] else []
        chunks += [sub.narrow(dim, 0, 0)] * (n - len(chunks))  # DTensor pads with empties
        parts.append(chunks[t])
    return torch.cat(parts, dim=dim)


def ref_dp_layout(numel: int, layout: MeshLayout, t: int) -> TensorLayout:
    if layout.min_shard_numel is None:
        chunk = even_layout(numel, layout.dp_shard).chunk_numel
    else:
        chunk = chunk_numel_for(numel, layout.dp_shard, layout.min_shard_numel)
    return TensorLayout(numel, layout.dp_shard, chunk, layout.first_owners[t])


def ref_split(x: torch.Tensor, layout: MeshLayout) -> dict:
    pieces = {}
    for t in range(layout.num_tp_pieces):
        flat = ref_tp_shard(x, layout, t).reshape(-1)
        dp = ref_dp_layout(flat.numel(), layout, t)
        for r in range(layout.dp_shard):
            lo, hi = dp.owned_range(r)
            pieces[(t, r)] = flat[lo:hi].clone()
    return pieces


def apply(copies_by_piece: dict, sources: dict, target: MeshLayout) -> dict:
    """Run a plan; every target element must be written exactly once."""
    out = {}
    for pid in target.piece_ids():
        numel = target.piece_numel(pid)
        buf = torch.empty(numel, dtype=torch.int64)
        hits = torch.zeros(numel, dtype=torch.int64)
        for copy in copies_by_piece[pid]:
            assert copy.numel > 0 and copy.rows > 0
            assert copy.rows > 1 or copy.source_stride == copy.target_stride == 0
            for c in copy.flat():
                buf[c.target_offset : c.target_offset + c.numel] = sources[c.source][
                    c.source_offset : c.source_offset + c.numel
                ]
                hits[c.target_offset : c.target_offset + c.numel] += 1
        assert torch.all(hits == 1), pid
        out[pid] = buf
    assert set(copies_by_piece) == set(out)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- strategies ------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple) | st.sampled_from(
    [(17, 257), (257,), (3, 1, 5), (1,), (0, 4), (7, 3), (45, 3), (37, 2, 3)]
)


@st.composite
def fused_split(draw, rows: int) -> tuple[int, ...]:
    """One to three sub-tensors summing to ``rows`` (GQA-like q/k/v when three)."""
    if rows == 0 or draw(st.booleans()):
        return ()
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=2)))
    bounds = [0, *cuts, rows]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@st.composite
def layouts(draw, shape: tuple[int, ...], tp_like: MeshLayout | None = None) -> MeshLayout:
    if tp_like is not None and draw(st.booleans()):
        tp_dim, tp_degree, fused = tp_like.tp_dim, tp_like.tp_degree, tp_like.fused_sizes
    elif draw(st.integers(0, 4)) == 0:
        tp_dim, tp_degree, fused = None, draw(st.integers(1, 4)), ()
    else:
        tp_dim = draw(st.integers(0, len(shape) - 1))
        tp_degree = draw(st.integers(1, 9))
        fused = draw(fused_split(shape[tp_dim]))
    dp_shard = draw(st.integers(1, 9))
    msn = draw(st.none() | st.integers(1, 40))
    num_tp = tp_degree if tp_dim is not None else 1
    owners = tuple(draw(st.integers(0, dp_shard - 1)) for _ in range(num_tp))
    return MeshLayout(
        shape=shape,
        tp_dim=tp_dim,
        tp_degree=tp_degree,
        fused_sizes=fused,
        dp_shard=dp_shard,
        min_shard_numel=msn,
        first_owners=owners,
        dp_replicate=draw(st.integers(1, 3)),
    )


@st.composite
def layout_pairs(draw) -> tuple[MeshLayout, MeshLayout]:
    shape = draw(shapes)
    a = draw(layouts(shape))
    return a, draw(layouts(shape, tp_like=a))


def global_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    # Distinct values, so any element in the wrong place shows.
    return torch.randperm(max(1, math.prod(shape)))[: math.prod(shape)].reshape(shape)


CONSOLIDATED = {"tp_dim": None, "dp_shard": 1}


# -- the split itself ------------------------------------------------------------------------


@SETTINGS
@given(layout_pairs())
def test_segments_place_every_piece_where_the_reference_split_has_it(pair):
    layout = pair[0]
    x = global_tensor(layout.shape)
    flat = x.reshape(-1)
    ref = ref_split(x, layout)
    segs = {pid: layout.segments(pid) for pid in layout.piece_ids()}
    check_tiling(layout.numel, segs, "t")
    for pid, piece in ref.items():
        assert layout.piece_numel(pid) == piece.numel()
        got = torch.empty_like(piece)
        for g, n, off in segs[pid]:
            got[off : off + n] = flat[g : g + n]
        assert torch.equal(got, piece), pid
        # Runs that touch are merged: consecutive segments never continue each other.
        for (g0, n0, _), (g1, _, _) in zip(segs[pid], segs[pid][1:], strict=False):
            assert g0 + n0 != g1


@pytest.mark.parametrize("size", [0, 1, 3, 5, 7, 8, 17, 257])
@pytest.mark.parametrize("degree", [1, 2, 3, 4, 8])
def test_tp_chunk_matches_dtensor(size, degree):
    for t in range(degree):
        lo, hi = tp_chunk(size, degree, t)
        assert Shard.local_shard_size_and_offset(size, degree, t) == (hi - lo, lo)


@pytest.mark.parametrize("shape,dim", [((17, 257), 0), ((17, 257), 1), ((5, 3, 2), 1), ((3,), 0)])
@pytest.mark.parametrize("degree", [2, 4, 8])
def test_local_shards_match_dtensor_on_a_three_dim_mesh(shape, dim, degree):
    layout = MeshLayout(shape=shape, tp_dim=dim, tp_degree=degree, dp_shard=2, dp_replicate=2)
    x = global_tensor(shape)
    placements = [Replicate(), Replicate(), Shard(dim)]
    tensors, _ = Shard(dim)._split_tensor(x, degree, with_padding=False)
    for t in range(degree):
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, (2, 2, degree), [1, 0, t], placements
        )
        assert layout.local_shape(t) == tuple(local_shape)
        assert tp_chunk(shape[dim], degree, t)[0] == offset[dim]
        assert torch.equal(ref_tp_shard(x, layout, t), tensors[t])


def test_fused_qkv_shards_hold_a_chunk_of_each_sub_tensor():
    # GQA: q 96 rows, k and v 32; at tp 3 DTensor would cut 160 rows as 54/54/52 and hand
    # shard 1 the end of q and the start of k; the fused cut gives q/k/v 32/11/11, 32/11/11,
    # 32/10/10.
    layout = MeshLayout(shape=(160, 4), tp_dim=0, tp_degree=3, fused_sizes=(96, 32, 32))
    assert [layout.local_shape(t)[0] for t in range(3)] == [54, 54, 52]
    assert layout.tp_blocks(1) == [(32, 32, 0), (96 + 11, 11, 32), (128 + 11, 11, 43)]
    x = global_tensor((160, 4))
    q, k, v = torch.split(x, [96, 32, 32])
    expect = torch.cat([q[32:64], k[11:22], v[11:22]])
    assert torch.equal(ref_split(x, layout)[(1, 0)], expect.reshape(-1))


# -- planning on real data -------------------------------------------------------------------


@SETTINGS
@given(layout_pairs())
def test_plan_applied_to_data_equals_the_target_split(pair):
    source, target = pair
    x = global_tensor(source.shape)
    got = apply(plan(source, target), ref_split(x, source), target)
    assert same(got, ref_split(x, target))


@SETTINGS
@given(layout_pairs())
def test_every_planning_path_gives_the_target_split(pair):
    # plan() picks one path per pair; each path must be right on every pair it accepts, so the
    # row-band path is also run on the few-rows pairs it is not picked for, and vice versa.
    source, target = pair
    x = global_tensor(source.shape)
    sources, expect = ref_split(x, source), ref_split(x, target)
    dims = [layout.tp_dim for layout in pair if layout.tp_sharded]
    if dims and source.numel:
        assert same(apply(_plan_bands(source, target, max(dims)), sources, target), expect)
    if source.numel:
        assert same(apply(_plan_general(source, target), sources, target), expect)


@SETTINGS
@given(layout_pairs())
def test_there_and_back_is_byte_identical_and_every_path_consolidates_alike(pair):
    a, b = pair
    x = global_tensor(a.shape)
    pieces_a = ref_split(x, a)
    pieces_b = apply(plan(a, b), pieces_a, b)
    assert same(apply(plan(b, a), pieces_b, a), pieces_a)
    one = MeshLayout(shape=a.shape)
    direct = apply(plan(a, one), pieces_a, one)[(0, 0)]
    via_b = apply(plan(b, one), pieces_b, one)[(0, 0)]
    assert torch.equal(direct, x.reshape(-1))
    assert direct.numpy().tobytes() == via_b.numpy().tobytes()


def apply_range(copies: list, sources: dict, numel: int) -> torch.Tensor:
    """Run the copies of one range; every element must be written exactly once."""
    buf = torch.empty(numel, dtype=torch.int64)
    hits = torch.zeros(numel, dtype=torch.int64)
    for copy in copies:
        assert copy.numel > 0 and copy.rows > 0
        for c in copy.flat():
            buf[c.target_offset : c.target_offset + c.numel] = sources[c.source][
                c.source_offset : c.source_offset + c.numel
            ]
            hits[c.target_offset : c.target_offset + c.numel] += 1
    assert torch.all(hits == 1)
    return buf


@SETTINGS
@given(layout_pairs(), st.data())
def test_planned_ranges_are_what_readers_get(pair, data):
    """What the product asks of the planner: a step reader's logical range
    (:func:`plan_logical`, every format-3 read of load, reshard and consolidate), and any
    range of a target tp shard (:func:`plan_range`, of which :func:`plan` is made), on the
    same source, whose cached indexes serve every range."""
    source, target = pair
    x = global_tensor(source.shape)
    sources = ref_split(x, source)
    flat = x.reshape(-1)
    for _ in range(4):
        a = data.draw(st.integers(0, flat.numel()))
        b = data.draw(st.integers(a, flat.numel()))
        assert torch.equal(apply_range(plan_logical(source, a, b), sources, b - a), flat[a:b])
    t = data.draw(st.integers(0, target.num_tp_pieces - 1))
    shard = ref_tp_shard(x, target, t).reshape(-1)
    for _ in range(4):
        a = data.draw(st.integers(0, shard.numel()))
        b = data.draw(st.integers(a, shard.numel()))
        got = apply_range(plan_range(source, target, t, a, b), sources, b - a)
        assert torch.equal(got, shard[a:b])
    with pytest.raises(LayoutError, match="outside tp shard"):
        plan_range(source, target, t, 0, shard.numel() + 1)


def test_cheap_paths_plan_few_copies():
    shape = (4096, 1000)
    a = MeshLayout(shape=shape, tp_dim=1, tp_degree=8, dp_shard=128)
    b = MeshLayout(shape=shape, tp_dim=1, tp_degree=8, dp_shard=3, min_shard_numel=1 << 16)
    dp_only = plan(a, b)
    # Each target piece of ~170k elements spans at most 44 source chunks of 4000.
    assert max(len(c) for c in dp_only.values()) <= 44
    assert all(c.source[0] == pid[0] for pid, cs in dp_only.items() for c in cs)
    one = plan(a, MeshLayout(shape=shape))
    assert sum(c.total_numel for c in one[(0, 0)]) == 4096 * 1000
    # Row bands: at most three copies per source piece, not one per row of each tp shard.
    assert len(one[(0, 0)]) <= 3 * 8 * 128
    assert max(c.rows for c in one[(0, 0)]) >= 4096 // 128 - 2
    # Across shard dims the dim-0 side is whole rows of dim 1: bands again.
    other = plan(a, MeshLayout(shape=shape, tp_dim=0, tp_degree=2, dp_shard=2))
    assert sum(c.total_numel for cs in other.values() for c in cs) == 4096 * 1000
    assert sum(len(cs) for cs in other.values()) <= 3 * 8 * 128 + 2 * 3 * 8
    # With fewer rows than dp pieces there are flat segments, one copy per overlap.
    few = MeshLayout(shape=(64, 1000), tp_dim=1, tp_degree=8, dp_shard=128)
    flat = plan(few, MeshLayout(shape=(64, 1000), tp_dim=0, tp_degree=2, dp_shard=2))
    assert all(c.rows == 1 for cs in flat.values() for c in cs)


def test_plan_refuses_another_global_shape():
    with pytest.raises(LayoutError, match="'w'.*global shape"):
        plan(MeshLayout(shape=(4, 4)), MeshLayout(shape=(16,)), "w")


# -- JSON and hostile layouts ----------------------------------------------------------------


@SETTINGS
@given(layout_pairs())
def test_json_round_trip(pair):
    layout = pair[1]
    data = json.loads(json.dumps(to_json(layout)))
    assert data["layout_version"] == LAYOUT_VERSION
    assert from_json(data, "t") == layout


GOOD = to_json(MeshLayout(shape=(12, 8), tp_dim=0, tp_degree=2, fused_sizes=(8, 2, 2), dp_shard=2))


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"layout_version": 99}, "layout version 99"),
        ({"shape": [12, -8]}, "shape"),
        ({"shape": [12, 8.5]}, "shape"),
        ({"tp_dim": 2}, "tp shard dim 2 outside the rank 2"),
        ({"tp_dim": -1}, "tp shard dim -1"),
        ({"tp_degree": 0}, "tp_degree 0"),
        ({"dp_shard": True}, "dp_shard True"),
        ({"dp_replicate": 10**9}, "dp_replicate"),
        ({"fused_sizes": [8, 2, 3]}, "fused sizes \\[8, 2, 3\\] sum to 13, not dim 0's 12"),
        ({"fused_sizes": [14, -2]}, "fused sizes"),
        ({"min_shard_numel": 0}, "min_shard_numel 0"),
        ({"first_owners": [0, 2]}, "first_owners"),
        ({"first_owners": [0]}, "first_owners"),
        ({"shape": "12x8"}, "shape"),
        ({"fused_sizes": []}, "canonical"),
        ({"tp_degree": 10**12, "first_owners": []}, "tp_degree 1000000000000"),
    ],
)
def test_hostile_layout_json_is_refused_in_one_line(change, problem):
    with pytest.raises(LayoutError, match=problem) as info:
        from_json({**GOOD, **change}, "model/w")
    message = str(info.value)
    assert "\n" not in message and message.startswith("tensor 'model/w': ")
    assert isinstance(info.value, CorruptCheckpointError) and isinstance(info.value, ValueError)


def test_layout_json_that_is_not_an_object_or_lacks_fields_is_refused():
    with pytest.raises(LayoutError, match="'w'.*not an object"):
        from_json([1], "w")
    with pytest.raises(LayoutError, match="lacks \\['dp_shard'\\]"):
        from_json({k: v for k, v in GOOD.items() if k != "dp_shard"}, "w")


LAYOUT = from_json(GOOD, "w")  # tp shards of 6 rows x 8 = 48 elements


@pytest.mark.parametrize(
    "pieces,problem",
    [
        ([(0, 0, 48), (1, 0, 30), (1, 20, 48)], "overlap at element"),
        ([(0, 0, 48), (1, 0, 24), (1, 24, 49)], "outside tp shard 1 of 48"),
        ([(0, 0, 48), (1, 0, 24), (2, 24, 48)], "tp shard index 2 beyond its count 2"),
        ([(0, 0, 48), (1, 0, 24)], "are in no piece"),
        ([(0, 0, 48), (1, 30, 24)], "outside tp shard"),
        ([(0, -4, 48), (1, 0, 48)], "outside tp shard"),
        ([(0, 0, 48), (1, 0, 48), (1, 0, 48)], "overlap"),
    ],
)
def test_stored_pieces_that_do_not_tile_are_refused_in_one_line(pieces, problem):
    with pytest.raises(LayoutError, match=problem) as info:
        check_stored_pieces(LAYOUT, [StoredPiece(*p) for p in pieces], "model/w")
    assert "\n" not in str(info.value) and "'model/w'" in str(info.value)


@SETTINGS
@given(layout_pairs(), st.data())
def test_stored_piece_check_agrees_with_the_global_tiling(pair, data):
    layout = pair[0]
    pieces = []
    for t in range(layout.num_tp_pieces):
        local = math.prod(layout.local_shape(t))
        cuts = sorted(data.draw(st.lists(st.integers(0, local), max_size=4)))
        bounds = [0, *cuts, local]
        pieces += [StoredPiece(t, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    check_stored_pieces(layout, pieces, "w")
    check_tiling(layout.numel, dict(enumerate(stored_segments(layout, pieces, "w"))), "w")
    if layout.numel == 0:
        return
    # Move one piece's end: a gap or an overlap (or a piece past the shard), refused both ways.
    i = data.draw(st.sampled_from([i for i, p in enumerate(pieces) if p.stop > p.start]))
    bad = list(pieces)
    bad[i] = StoredPiece(
        bad[i].tp_index, bad[i].start, bad[i].stop + data.draw(st.sampled_from([-1, 1]))
    )
    with pytest.raises(LayoutError):
        check_stored_pieces(layout, bad, "w")
    with pytest.raises(LayoutError):
        check_tiling(layout.numel, dict(enumerate(stored_segments(layout, bad, "w"))), "w")


def test_stored_pieces_of_a_tp8_dp128_embedding_are_checked_without_walking_rows():
    layout = MeshLayout(shape=(128256, 4096), tp_dim=1, tp_degree=8, dp_shard=128)
    pieces = [
        StoredPiece(t, *layout.dp_layout(t).owned_range(r)) for t in range(8) for r in range(128)
    ]
    start = time.process_time()
    check_stored_pieces(layout, pieces, "w")
    assert time.process_time() - start < 0.5  # 1024 ranges; their global segments are 1M
    with pytest.raises(LayoutError, match="tp shard 7: elements"):
        check_stored_pieces(layout, pieces[:-1], "w")


def test_stored_pieces_in_another_dp_cut_are_accepted():
    check_stored_pieces(
        LAYOUT, [StoredPiece(1, 7, 48), StoredPiece(0, 0, 48), StoredPiece(1, 0, 7)], "w"
    )


@pytest.mark.parametrize(
    "segs,problem",
    [
        ({"a": [(0, 50, 0)], "b": [(50, 46, 0)]}, None),
        ({"a": [(0, 50, 0)], "b": [(49, 47, 0)]}, "pieces 'a' and 'b' overlap at element 49"),
        ({"a": [(0, 50, 0)], "b": [(50, 47, 0)]}, "outside the 96 elements"),
        ({"a": [(0, 50, 0)], "b": [(51, 45, 0)]}, "elements \\[50, 51\\) are in no piece"),
        ({"a": [(0, 50, 0)], "b": [(50, -46, 0)]}, "negative segment"),
        ({"a": [(0, 50, 0)], "b": [(50, 40, 0), (90, 6, 41)]}, "offsets jump from 40 to 41"),
        ({"a": [(0, 50, 0)], "b": [(50, 46)]}, "not three ints"),
    ],
)
def test_tiling_check_of_explicit_segments(segs, problem):
    if problem is None:
        check_tiling(96, segs, "w")
        return
    with pytest.raises(LayoutError, match=problem):
        check_tiling(96, segs, "w")


# -- scale -----------------------------------------------------------------------------------

REALISTIC = {
    "mlp down 4096x11008 Shard(1)": ((4096, 11008), 1, ()),
    "mlp up 11008x4096 Shard(0)": ((11008, 4096), 0, ()),
    "embedding 128256x4096 Shard(0)": ((128256, 4096), 0, ()),
    "fused qkv 6144x4096 Shard(0)": ((6144, 4096), 0, (4096, 1024, 1024)),
    "fused gate/up 22016x4096 Shard(0)": ((22016, 4096), 0, (11008, 11008)),
    "embedding 128256x4096 Shard(1)": ((128256, 4096), 1, ()),
}
OTHER_DIM = {0: 1, 1: 0}


@pytest.mark.parametrize("case", sorted(REALISTIC))
def test_tp8_dp128_plans_in_well_under_a_second(case):
    shape, dim, fused = REALISTIC[case]
    big = MeshLayout(shape=shape, tp_dim=dim, tp_degree=8, fused_sizes=fused, dp_shard=128)
    targets = [
        MeshLayout(shape=shape),
        MeshLayout(shape=shape, tp_dim=dim, tp_degree=2, fused_sizes=fused, dp_shard=4),
        MeshLayout(shape=shape, tp_dim=dim, tp_degree=4, fused_sizes=fused, dp_shard=64),
        MeshLayout(shape=shape, dp_shard=8, min_shard_numel=1 << 16),
        MeshLayout(shape=shape, tp_dim=dim, tp_degree=8, fused_sizes=fused, dp_shard=3),
        MeshLayout(shape=shape, tp_dim=OTHER_DIM[dim], tp_degree=2, dp_shard=4),
    ]
    for target in targets:
        for src, dst in ((big, target), (target, big)):
            # This thread's CPU time, not wall time: peers' jobs share the cores and stretch
            # the wall clock. The collector is paused, not run first: late in a whole-suite
            # run one full collection of the process's heap took longer than a plan (1.13 s
            # measured), and a collection before each plan cost this file 100 s of the suite.
            gc.disable()
            try:
                start = time.thread_time()
                result = plan(src, dst)
                elapsed = time.thread_time() - start
            finally:
                gc.enable()
            # 4-55 ms each where measured; the bound leaves room for a slower machine.
            assert elapsed < 1.0, (case, dst, elapsed)
            copies = [c for cs in result.values() for c in cs]
            assert sum(c.total_numel for c in copies) == math.prod(shape)
            # Row bands keep Shard(1) tensors at a few copies per piece, not one per row.
            assert len(copies) <= 4 * (len(src.piece_ids()) + len(dst.piece_ids()))
            assert all(isinstance(c, Copy) for c in copies)
