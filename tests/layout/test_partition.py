import itertools

import pytest

from zerostate.layout.partition import (
    TensorLayout,
    chunk_reads,
    even_layout,
    plan_layouts,
    split_evenly,
)

SIZES = [0, 1, 2, 5, 17, 257, 17 * 257, 4096, 65537, 1 << 20]
WORLDS = [1, 2, 3, 4, 5, 7, 128]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("numel", SIZES)
def test_even_split_covers_exactly_once(numel, world_size):
    ranges = split_evenly(numel, world_size)
    covered = [0] * numel
    for lo, hi in ranges:
        assert 0 <= lo <= hi <= numel
        for i in range(lo, hi):
            covered[i] += 1
    assert all(c == 1 for c in covered)
    layout = even_layout(numel, world_size)
    assert layout.padded_numel - numel <= world_size - 1
    assert layout.num_chunks <= world_size


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("min_shard", [1, 64, 1 << 16])
def test_plan_every_element_owned_once(world_size, min_shard):
    numels = SIZES + [17, 257, 3, 300]
    layouts = plan_layouts(numels, world_size, min_shard)
    assert plan_layouts(numels, world_size, min_shard) == layouts  # deterministic
    for numel, layout in zip(numels, layouts, strict=True):
        owned = sorted(layout.owned_range(r) for r in range(world_size))
        pos = 0
        for lo, hi in owned:
            if lo == hi:
                continue
            assert lo == pos
            pos = hi
        assert pos == numel
        # each chunk is one owner's range and chunks are never smaller than asked
        for i in range(layout.num_chunks):
            assert layout.owned_range(layout.chunk_owner(i)) == layout.chunk_range(i)
        if numel and layout.num_chunks > 1:
            assert layout.chunk_numel >= min(numel, min_shard)


def test_tiny_tensors_are_one_chunk_and_balanced():
    layouts = plan_layouts([100] * 8, 4, min_shard_numel=1000)
    assert all(lay.num_chunks == 1 for lay in layouts)
    owners = [lay.chunk_owner(0) for lay in layouts]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_17x257_matrix_worlds():
    numel = 17 * 257
    for w in (1, 3, 7, 128):
        lay = plan_layouts([numel], w, min_shard_numel=1)[0]
        assert lay == even_layout(numel, w)
        assert sum(lay.owned_numel(r) for r in range(w)) == numel


@pytest.mark.parametrize("src_w,dst_w", list(itertools.product([1, 2, 3, 4, 7], repeat=2)))
def test_reshard_reads_reassemble(src_w, dst_w):
    numel = 17 * 257
    data = list(range(numel))
    src = plan_layouts([numel], src_w, min_shard_numel=100)[0]
    chunks = {i: data[slice(*src.chunk_range(i))] for i in range(src.num_chunks)}
    dst = plan_layouts([numel], dst_w, min_shard_numel=100)[0]
    for r in range(dst_w):
        lo, hi = dst.owned_range(r)
        out = [None] * (hi - lo)
        for rd in chunk_reads(src, lo, hi):
            out[rd.out_start : rd.out_start + rd.numel] = chunks[rd.chunk_index][
                rd.chunk_start : rd.chunk_stop
            ]
        assert out == data[lo:hi]


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="world_size"):
        even_layout(10, 0)
    with pytest.raises(ValueError, match="exceed world_size"):
        TensorLayout(numel=10, world_size=2, chunk_numel=3)
    with pytest.raises(ValueError, match="outside"):
        chunk_reads(even_layout(10, 2), 5, 11)
    with pytest.raises(ValueError, match="malformed"):
        TensorLayout.from_json({"numel": 3})
