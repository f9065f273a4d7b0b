"""The shared-memory transport of gloo ranks on one host ([Note: shared-memory transport]
in zerostate.dist.shm): every collective it takes over gives what gloo gives, on every
rank, at 2-4 ranks, for the dtypes and odd sizes training hands it; it falls back to gloo
together on every rank when any rank cannot allocate; it leaves no file behind; and the
switch ``ZEROSTATE_SHM=0`` keeps everything on gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers_dist import run_distributed

from zerostate.dist import collectives, shm

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]


def _segment_files() -> list[str]:
    return sorted(f for f in os.listdir(shm.DIRECTORY) if f.startswith("zerostate-"))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Sums of the same values (up to about 1,000 here) in another order: equal up to a
    # rounding or two at that magnitude. Integers are exact: they catch any element summed
    # from the wrong place.
    if a.dtype in (torch.int64, torch.int32):
        return torch.equal(a, b)
    rtol, atol = (0.02, 16.0) if a.dtype == torch.bfloat16 else (1e-5, 1e-3)
    return torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def _gloo_data_elements(fn) -> int:
    """Elements ``fn`` hands to torch.distributed's data collectives; the transport's
    setup (agreeing on segments, a few integers) is not counted, its barriers carry none."""
    counted = {"all_reduce": 0, "reduce": 0, "broadcast": 0, "all_gather_into_tensor": 0}
    originals = {name: getattr(dist, name) for name in counted}
    setup = {"paused": False}

    def wrap(name):
        def wrapper(tensor, *args, **kwargs):
            if not setup["paused"]:
                counted[name] += tensor.numel()
            return originals[name](tensor, *args, **kwargs)

        return wrapper

    def paused(fn):
        def wrapper(*args, **kwargs):
            setup["paused"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                setup["paused"] = False

        return wrapper

    reserve, new_transport = shm.Transport.reserve, collectives._new_transport
    shm.Transport.reserve = paused(reserve)
    collectives._new_transport = paused(new_transport)
    for name in counted:
        setattr(dist, name, wrap(name))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        shm.Transport.reserve, collectives._new_transport = reserve, new_transport
    return sum(counted.values())


def _collectives_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(100 + rank)
    shared_data = 0
    checked = 0
    sizes = [
        shm.MIN_ELEMENTS // world * world + world,
        65_537 * world,
        300_001 * world,
        2_000_000 // world * world,
    ]
    for dtype in DTYPES:
        for n in sizes:
            x = (torch.randn(n, generator=g) * 100).to(dtype)
            # all-reduce, sum and max: what gloo gives, the same bits on every rank
            for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                expected = x.clone()
                dist.all_reduce(expected, op=reduce_op)
                got = x.clone()
                shared_data += n
                moved = _gloo_data_elements(
                    lambda got=got, op=op: collectives.all_reduce(
                        got, group=None, stats=None, op=op
                    )
                )
                assert moved == 0, (dtype, n, op, moved)  # nothing went through gloo
                assert _close(got, expected), (
                    dtype,
                    n,
                    op,
                    (got.double() - expected.double()).abs().max(),
                )
                every = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(every, got)
                assert all(torch.equal(every[0], e) for e in every), (dtype, n, op)
            # reduce-scatter: this rank's segment of the sum
            expected = x.clone()
            dist.all_reduce(expected)
            out = torch.empty(n // world, dtype=dtype)
            collectives.reduce_scatter(out, x.clone(), group=None, stats=None)
            assert _close(out, expected.view(world, -1)[rank]), (dtype, n)
            # reduce-scatter in place: the output is the input's own segment
            buf = x.clone()
            own = buf.view(world, -1)[rank]
            collectives.reduce_scatter(own, buf, group=None, stats=None)
            assert _close(own, expected.view(world, -1)[rank]), (dtype, n)
            # all-gather, from a separate input and in place
            piece = x[: n // world].clone()
            pieces = [torch.empty_like(piece) for _ in range(world)]
            dist.all_gather(pieces, piece)
            full = torch.full((n,), 7, dtype=dtype)
            collectives.all_gather(full, piece, group=None, stats=None)
            assert torch.equal(full, torch.cat(pieces)), (dtype, n)
            full2 = torch.zeros(n, dtype=dtype)
            full2.view(world, -1)[rank].copy_(piece)
            collectives.all_gather(full2, full2.view(world, -1)[rank], group=None, stats=None)
            assert torch.equal(full2, torch.cat(pieces)), (dtype, n)
            checked += 1
        # a non-contiguous tensor (a transposed matrix) is reduced in place all the same
        x = (torch.randn(501, 263, generator=g) * 100).to(dtype).t()
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone()
        assert not got.is_contiguous()
        collectives.all_reduce(got, group=None, stats=None)
        assert _close(got, expected), dtype
    # a parameter (a leaf that requires grad) is reduced in place, as gloo reduces it
    param = torch.nn.Parameter(torch.full((1 << 17,), float(rank + 1)))
    collectives.all_reduce(param, group=None, stats=None)
    assert torch.equal(param.detach(), torch.full((1 << 17,), float(sum(range(1, world + 1)))))
    # a subgroup of the first two ranks has a transport of its own
    sub = dist.new_group([0, 1])
    if rank < 2:
        x = torch.randn(1 << 17, generator=g)
        expected = x.clone()
        dist.all_reduce(expected, group=sub)
        collectives.all_reduce(x, group=sub, stats=None)
        assert _close(x, expected)
    own, peers = collectives.shared_memory_bytes()
    dist.barrier()
    return {"checked": checked, "own": own, "peers": peers, "files": _segment_files()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_collectives_equal_glooes(world: int) -> None:
    results = run_distributed(_collectives_worker, world, timeout=300)
    for r in results:
        assert r["checked"] == len(DTYPES) * 4
        # the segments grew to the largest collective (8 bytes x 2M, two buffers)
        assert r["own"] >= 2 * 16_000_000, r
        assert r["peers"] >= (world - 1) * 2 * 16_000_000, r  # every other rank's, mapped
        assert r["files"] == [], r  # unlinked once mapped: nothing outlives the job


def _fallback_worker(rank: int, world: int, failing_rank: int) -> dict:
    torch.set_num_threads(1)
    if rank == failing_rank:
        shm._create = lambda *args: False  # /dev/shm full on this rank
    x = torch.arange(1 << 17, dtype=torch.float32) * (rank + 1)
    moved = _gloo_data_elements(lambda: collectives.all_reduce(x, group=None, stats=None))
    expected = torch.arange(1 << 17, dtype=torch.float32) * sum(range(1, world + 1))
    again = _gloo_data_elements(lambda: collectives.all_reduce(x.clone(), group=None, stats=None))
    return {
        "moved": moved,
        "again": again,
        "equal": torch.equal(x, expected),
        "files": _segment_files(),
        "bytes": collectives.shared_memory_bytes(),
    }


def test_one_rank_that_cannot_allocate_sends_every_rank_to_gloo() -> None:
    results = run_distributed(_fallback_worker, 3, 1, timeout=120)
    for r in results:
        assert r["equal"]
        assert r["moved"] == 1 << 17 and r["again"] == 1 << 17, r  # gloo, and stays there
        assert r["bytes"] == (0, 0)
        assert r["files"] == [], r


def _switch_worker(rank: int, world: int) -> dict:
    os.environ[shm.ENV] = "0" if rank == 0 else "1"  # one rank's "no" is everyone's
    x = torch.ones(1 << 17)
    moved = _gloo_data_elements(lambda: collectives.all_reduce(x, group=None, stats=None))
    return {"moved": moved, "sum": float(x[0]), "bytes": collectives.shared_memory_bytes()}


def test_the_switch_keeps_every_collective_on_gloo() -> None:
    for r in run_distributed(_switch_worker, 2, timeout=120):
        assert r == {"moved": 1 << 17, "sum": 2.0, "bytes": (0, 0)}


def _small_worker(rank: int, world: int) -> dict:
    x = torch.ones(shm.MIN_ELEMENTS - 1)
    moved = _gloo_data_elements(lambda: collectives.all_reduce(x, group=None, stats=None))
    return {"moved": moved, "bytes": collectives.shared_memory_bytes()}


def test_small_collectives_stay_on_gloo() -> None:
    for r in run_distributed(_small_worker, 2, timeout=120):
        assert r == {"moved": shm.MIN_ELEMENTS - 1, "bytes": (0, 0)}
