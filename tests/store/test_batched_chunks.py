"""Small inner chunks are written a batch at a time ([Note: batched small chunks] in
zerostate/store/rows.py): the bytes and the chunk checksums are exactly those of the
chunk-at-a-time path, for any plan, rank, inner size and batch size; the shard index,
built per run of chunks, is the one built chunk by chunk."""

from __future__ import annotations

import math
import random
import struct

import crc32c
import numpy as np
import pytest
import torch

from zerostate.layout.partition import TensorLayout
from zerostate.store import rows
from zerostate.store.rows import CHECKSUM_NBYTES, LazyShard, plan_groups, row_parts


def _plan(seed: int, world_size: int, inner: int):
    """Tensors of odd sizes (empty ones too), some sharded evenly over the ranks, some
    stored whole by one rank, some with a first owner other than rank 0."""
    rng = random.Random(seed)
    entries, shards = [], {}
    for t in range(rng.randint(1, 40)):
        numel = rng.choice([0, 1, 3, 7, 129, 255, 1000, 4099, rng.randint(1, 20000)])
        itemsize = rng.choice([1, 2, 4, 8])
        if rng.random() < 0.5:
            layout = TensorLayout(numel, world_size, max(1, numel), rng.randrange(world_size))
        else:
            chunk = max(1, math.ceil(numel / world_size))
            layout = TensorLayout(numel, world_size, chunk, rng.randrange(world_size))
        name = f"g/t{t:04d}"
        entries.append((name, layout, itemsize))
        for rank in range(world_size):
            n = layout.owned_numel(rank) * itemsize
            shards[name, rank] = np.frombuffer(rng.randbytes(n), dtype=np.uint8)
    plans = plan_groups(entries, world_size, inner={"g": inner})
    return plans["g"], shards


def _row(plan, rank, sources, path) -> tuple[bytes, bytes]:
    crcs = bytearray()
    parts = path(plan, rank, sources, crcs)
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts), bytes(crcs)


@pytest.mark.parametrize("seed", range(12))
def test_batches_write_the_bytes_of_single_chunks(seed, monkeypatch):
    rng = random.Random(1000 + seed)
    world_size = rng.randint(1, 4)
    inner = rng.choice([256, 512, 768, 4096, 32768])
    # Small batches too, so that spans cross batch boundaries and runs end mid-batch.
    monkeypatch.setattr(rows, "BATCH_NBYTES", rng.choice([1, 3 * (inner + 4), 1 << 20]))
    plan, shards = _plan(seed, world_size, inner)
    checked = 0
    for rank in range(world_size):
        sources = {s.name: memoryview(shards[s.name, rank]) for s in plan.slots}
        batched = _row(plan, rank, sources, rows._batched_chunks)
        single = _row(plan, rank, sources, rows._chunk_views)
        assert batched == single
        data, crcs = batched
        stride = inner + CHECKSUM_NBYTES
        assert len(data) == plan.num_present(rank) * stride
        # Each stored chunk carries its payload's crc32c, and the list of them matches.
        for k in range(len(data) // stride):
            chunk = data[k * stride : (k + 1) * stride]
            assert int.from_bytes(chunk[inner:], "little") == crc32c.crc32c(chunk[:inner])
            assert crcs[k * 4 : (k + 1) * 4] == chunk[inner:]
            checked += 1
    assert checked or all(plan.num_present(r) == 0 for r in range(world_size))


def test_row_parts_takes_batches_only_for_small_chunks(monkeypatch):
    calls = []
    real = rows._batched_chunks

    def spy(*args):
        calls.append(args[0].inner)
        return real(*args)

    monkeypatch.setattr(rows, "_batched_chunks", spy)
    for inner in (512, rows.BATCH_BELOW_NBYTES):
        plan, shards = _plan(3, 2, inner)
        sources = {s.name: memoryview(shards[s.name, 0]) for s in plan.slots}
        whole = b"".join(bytes(p) for p in row_parts(plan, 0, sources, bytearray()))
        index = plan.index_bytes(0)
        assert whole.endswith(index + crc32c.crc32c(index).to_bytes(4, "little"))
    assert calls == [512]


def test_lazy_shards_are_read_in_order_once(monkeypatch):
    monkeypatch.setattr(rows, "BATCH_NBYTES", 5 * 516)
    plan, shards = _plan(7, 2, 512)
    for rank in range(2):
        reads: dict[str, list[tuple[int, int]]] = {}
        sources = {
            s.name: _lazy(shards[s.name, rank], reads.setdefault(s.name, [])) for s in plan.slots
        }
        plain = {s.name: memoryview(shards[s.name, rank]) for s in plan.slots}
        assert _row(plan, rank, sources, rows._batched_chunks) == _row(
            plan, rank, plain, rows._chunk_views
        )
        for slot in plan.slots:
            got, size = reads[slot.name], shards[slot.name, rank].size
            # Consecutive, from the shard's first byte to its last, each byte once.
            assert not size or got[0][0] == 0
            assert all(a[0] + a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
            assert sum(n for _, n in got) == size


def _lazy(data: np.ndarray, log: list[tuple[int, int]]) -> LazyShard:
    def read(offset: int, nbytes: int) -> bytes:
        log.append((offset, nbytes))
        return data[offset : offset + nbytes].tobytes()

    return LazyShard(data.size, torch.uint8, read)


@pytest.mark.parametrize("seed", range(6))
def test_the_shard_index_lists_each_stored_chunk_in_order(seed):
    """The index (built per run of stored chunks) against one built chunk by chunk."""
    rng = random.Random(2000 + seed)
    world_size = rng.randint(1, 4)
    plan, _ = _plan(seed, world_size, rng.choice([256, 512, 4096]))
    stride = plan.stored_chunk_nbytes
    for rank in range(world_size):
        entries = [rows.MISSING, rows.MISSING] * plan.num_inner
        pos = 0
        for a, b in plan.present(rank):
            for j in range(a, b):
                entries[2 * j], entries[2 * j + 1] = pos * stride, stride
                pos += 1
        assert plan.index_bytes(rank) == struct.pack(f"<{2 * plan.num_inner}Q", *entries)


def test_an_object_store_upload_holds_one_copy_of_a_batched_row(monkeypatch):
    """Below the multipart size an object is uploaded from one buffer that the parts are
    copied into as they come, not joined from all of them at once (twice the object)."""
    import tracemalloc

    from zerostate.errors import StorageError
    from zerostate.store.fsspec_storage import _gathered

    monkeypatch.setattr(rows, "BATCH_NBYTES", 64 << 10)
    entries = [(f"g/t{i}", TensorLayout(50_000 + i, 2, 50_000 + i, 0), 4) for i in range(8)]
    plan = plan_groups(entries, 2, inner={"g": 512})["g"]
    gen = np.random.default_rng(0)
    sources = {
        s.name: memoryview(gen.integers(0, 255, s.layout.numel * 4, dtype=np.uint8))
        for s in plan.slots
    }
    nbytes = plan.object_nbytes(0)
    whole = b"".join(bytes(p) for p in row_parts(plan, 0, sources, bytearray()))
    tracemalloc.start()
    try:
        got = _gathered(row_parts(plan, 0, sources, bytearray()), nbytes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bytes(got) == whole and len(whole) == nbytes > 1_500_000
    # The object plus about a batch and the index, not every batch and a joined copy.
    assert peak < nbytes + 4 * rows.BATCH_NBYTES + plan.index_nbytes
    with pytest.raises(StorageError, match="given more"):
        _gathered([b"abc", b"de"], 4)
    with pytest.raises(StorageError, match="given 3"):
        _gathered([b"abc"], 4)
