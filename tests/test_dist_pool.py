"""The pooled gloo workers of tests/dist_pool.py ([Note: pool isolation]): reused across
calls, every call starts clean, and a call that leaves an engine, a hook, a thread or a
monkeypatch behind fails loudly, naming the leak and the test, on workers that are then
replaced. A crashed, failing or hung worker fails its call within its bound and the next
call gets fresh workers."""

from __future__ import annotations

import os
import sys
import threading
import time

import fork_server
import pytest
import torch
from dist_pool import LeakError
from helpers_dist import WorkerError, run_distributed

_kept: list = []  # what a leaking call leaves reachable in its worker


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def _sum_ranks(rank: int, world: int) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _keep_engine(rank: int, world: int) -> int:
    import zerostate

    _kept.append(zerostate.Engine(torch.nn.Linear(4, 3), stage=2, lr=0.1))
    return os.getpid()


def _close_engine(rank: int, world: int) -> int:
    """A closed engine, and a handler on zerostate's logger removed in ``finally``: clean."""
    import logging

    import zerostate

    handler = logging.NullHandler()
    logging.getLogger("zerostate").addHandler(handler)
    try:
        with zerostate.Engine(torch.nn.Linear(4, 3), stage=2, lr=0.1) as engine:
            engine.backward(engine(torch.ones(2, 4)).square().mean())
            engine.step()
    finally:
        logging.getLogger("zerostate").removeHandler(handler)
    return os.getpid()


def _keep_hook(rank: int, world: int) -> None:
    torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)


def _keep_thread(rank: int, world: int) -> None:
    stop = threading.Event()
    _kept.append(stop)
    threading.Thread(target=stop.wait, name="left-behind", daemon=True).start()


def _patch_zerostate(rank: int, world: int) -> None:
    from zerostate.store import reader_v2

    reader_v2.StepReaderV2.reads_locally = property(lambda self: False)


def _change_settings(rank: int, world: int) -> None:
    torch.manual_seed(1234)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["ZEROSTATE_POOL_PROBE"] = "set"
    os.chdir("/")


def _settings(rank: int, world: int) -> dict:
    return {
        "rand": torch.rand(3),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "probe": os.environ.get("ZEROSTATE_POOL_PROBE"),
        "cwd": os.getcwd(),
    }


def _timeouts(rank: int, world: int) -> tuple[float, float]:
    """The default group's collective timeout and its store's, in seconds."""
    from torch.distributed import distributed_c10d as c10d

    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    store = c10d._get_default_store()
    return backend.options._timeout.total_seconds(), store.timeout.total_seconds()


def _start_state(rank: int, world: int) -> tuple[bool, str | None, int, float]:
    """Whether zerostate was imported before this call (the fork servers preload it; this
    module does not import it), the caller's probe variable, this interpreter's string
    hash and a first draw of torch's RNG (both differ between fresh processes)."""
    probe = os.environ.get("ZEROSTATE_POOL_PROBE")
    return "zerostate.store" in sys.modules, probe, hash("zerostate"), torch.rand(1).item()


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def _crash_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    import torch.distributed as dist

    dist.barrier()  # blocked: its peer is gone


def _hang(rank: int, world: int) -> None:
    time.sleep(600)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited child awaiting its parent does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _outlive_rank_0(rank: int, world: int) -> str:
    """Rank 0 returns at once; rank 1 waits until rank 0's process has ended, then uses the
    group's store ([Note: the store outlives the ranks] in helpers_dist)."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank == 0:
        store.set("rank0-pid", str(os.getpid()))
        return "done"
    pid = int(store.get("rank0-pid"))
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "rank 0 did not end within 60 s"
    store.set("after-rank-0", "still here")
    return store.get("after-rank-0").decode()


def test_workers_are_reused_and_their_group_works() -> None:
    first = run_distributed(_pid, 2)
    assert run_distributed(_pid, 2) == first
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_distributed(_sum_ranks, 2) == [3.0, 3.0]


def test_a_closed_engine_is_clean() -> None:
    before = run_distributed(_pid, 2)
    assert run_distributed(_close_engine, 2) == before
    assert run_distributed(_pid, 2) == before


@pytest.mark.parametrize(
    ("leak", "named"),
    [
        (_keep_engine, "zerostate Engine object(s) still alive"),
        (_keep_hook, "torch.nn.modules.module._global_forward_hooks"),
        (_keep_thread, "threads left running: left-behind"),
        (_patch_zerostate, "zerostate.store.reader_v2.StepReaderV2.reads_locally"),
    ],
    ids=["engine", "hook", "thread", "monkeypatch"],
)
def test_a_leak_fails_loudly_naming_it_and_the_workers_are_replaced(
    request: pytest.FixtureRequest, leak, named: str
) -> None:
    before = run_distributed(_pid, 2)
    with pytest.raises(LeakError) as info:
        run_distributed(leak, 2)
    message = str(info.value)
    assert named in message, message
    assert request.node.nodeid in message, message  # the test that leaked
    assert "rank 0" in message and "rank 1" in message, message
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)  # fresh workers, not the dirty ones
    assert run_distributed(_sum_ranks, 2) == [3.0, 3.0]
    assert run_distributed(_pid, 2) == after  # and those are clean: kept


def test_calls_with_other_time_bounds_share_the_workers_with_their_own_timeout() -> None:
    # A fresh process gets init_process_group(timeout=max(30, timeout / 2)).
    fresh = run_distributed(_timeouts, 2, timeout=300, pooled=False)
    assert fresh == [(150.0, 150.0)] * 2
    before = run_distributed(_pid, 2, timeout=120)
    assert run_distributed(_timeouts, 2, timeout=300) == fresh
    assert run_distributed(_timeouts, 2, timeout=120) == [(60.0, 60.0)] * 2
    assert run_distributed(_timeouts, 2, timeout=20) == [(30.0, 30.0)] * 2
    assert run_distributed(_pid, 2, timeout=900) == before


def test_settings_a_call_changes_are_put_back() -> None:
    fresh = run_distributed(_settings, 2, pooled=False)
    before = run_distributed(_pid, 2)
    clean = run_distributed(_settings, 2)
    run_distributed(_change_settings, 2)
    pooled = run_distributed(_settings, 2)
    assert run_distributed(_pid, 2) == before  # the same workers
    seeded = torch.Generator().manual_seed(1234)
    for rank in range(2):
        # A fresh process draws an unseeded state; a pooled call starts from its worker's.
        assert torch.equal(pooled[rank]["rand"], clean[rank]["rand"])
        assert not torch.equal(pooled[rank].pop("rand"), torch.rand(3, generator=seeded))
        fresh[rank].pop("rand")
        assert pooled[rank] == fresh[rank]
    assert not torch.equal(clean[0]["rand"], clean[1]["rand"])  # ranks differ, as fresh
    assert fresh[0]["threads"] == 1 and fresh[0]["probe"] is None


def test_a_failing_rank_fails_the_call_and_the_pool_recovers() -> None:
    before = run_distributed(_pid, 2)
    with pytest.raises(WorkerError, match="rank 1 fails on purpose") as info:
        run_distributed(_fail_on_rank_1, 2)
    assert not isinstance(info.value, LeakError)
    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)
    assert run_distributed(_sum_ranks, 2) == [3.0, 3.0]


def test_a_crashed_rank_fails_the_call_within_its_bound_and_the_pool_recovers() -> None:
    before = run_distributed(_pid, 2, timeout=60)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"exited without a result: \{1: 3\}"):
        run_distributed(_crash_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 60
    after = run_distributed(_pid, 2, timeout=60)
    assert set(after).isdisjoint(before)
    assert run_distributed(_sum_ranks, 2, timeout=60) == [3.0, 3.0]


def test_a_hung_call_times_out_naming_the_test_and_the_pool_recovers(
    request: pytest.FixtureRequest,
) -> None:
    before = run_distributed(_pid, 2, timeout=30)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_hang, 2, timeout=8)  # a short bound: the test waits it out
    assert time.monotonic() - start < 8 + 30  # its bound, and a little for killing the pool
    assert request.node.nodeid in str(info.value) and "_hang" in str(info.value)
    after = run_distributed(_pid, 2, timeout=30)
    assert set(after).isdisjoint(before)
    assert run_distributed(_sum_ranks, 2, timeout=30) == [3.0, 3.0]


@pytest.mark.fresh_processes
def test_the_fresh_processes_marker_gives_new_processes(monkeypatch) -> None:
    assert set(run_distributed(_pid, 2)).isdisjoint(run_distributed(_pid, 2))
    monkeypatch.setenv("ZEROSTATE_POOL_PROBE", "caller")
    # Spawned: a new interpreter that imported nothing it was not asked to.
    spawned = run_distributed(_start_state, 2)
    assert [r[:2] for r in spawned] == [(False, "caller")] * 2
    assert spawned[0][2:] != spawned[1][2:]


def test_unpooled_calls_fork_new_workers_with_the_callers_environment(
    request: pytest.FixtureRequest, monkeypatch
) -> None:
    monkeypatch.setenv("ZEROSTATE_POOL_PROBE", "caller")
    with fork_server.test_context(request.node.nodeid, pooled=False):  # an unchecked file
        first, second = run_distributed(_pid, 2), run_distributed(_pid, 2)
        forked = run_distributed(_start_state, 2)
    assert set(first).isdisjoint(second) and os.getpid() not in first  # new processes
    assert [r[:2] for r in forked] == [(True, "caller")] * 2  # zerostate came with the fork
    # Ranks fork from fork servers of their own: hash seeds and RNG states differ, as
    # between spawned ranks, and a second call draws new RNG states.
    assert forked[0][2] != forked[1][2] and forked[0][3] != forked[1][3]
    with fork_server.test_context(request.node.nodeid, pooled=False):
        again = run_distributed(_start_state, 2)
    assert {r[3] for r in again}.isdisjoint(r[3] for r in forked)
    # pooled=False asks for a new interpreter by name; with spawn=False, for a fork.
    spawned = run_distributed(_start_state, 2, pooled=False)
    assert [r[:2] for r in spawned] == [(False, "caller")] * 2
    by_name = run_distributed(_start_state, 2, pooled=False, spawn=False)
    assert [r[:2] for r in by_name] == [(True, "caller")] * 2


def test_a_fresh_rank_can_use_the_store_after_rank_0_has_ended() -> None:
    # As under torchrun, whose agent hosts the store: the ranks of an HSDP shard group
    # without rank 0 make close()'s arrival check in it after rank 0 may have exited.
    assert run_distributed(_outlive_rank_0, 2, pooled=False, spawn=False) == [
        "done",
        "still here",
    ]


def _dtensor_product(rank: int, world: int) -> dict:
    """What DTensor had cached when the call began, then a matrix product over a new mesh
    whose sum is partial (columns times rows), made whole on the mesh's own group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    propagator = DTensor._op_dispatcher.sharding_propagator
    cached = propagator.propagate_op_sharding.cache_info().currsize
    cached += torch._C._get_DTensor_sharding_propagator_cache_stats()[1]
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))["tp"]
    x = DTensor.from_local(torch.full((1, 1), float(rank + 1)), mesh, [Shard(1)])
    w = DTensor.from_local(torch.ones(1, 1), mesh, [Shard(0)])
    total = (x @ w).redistribute(mesh, [Replicate()]).to_local().item()
    return {"pid": os.getpid(), "cached": cached, "total": total}


def test_dtensor_caches_do_not_outlive_a_call() -> None:
    """DTensor caches sharding decisions under specs whose meshes compare equal across
    process groups, so a call building a mesh of the last call's shape would reach for the
    last call's destroyed groups ("Could not resolve the process group registered under the
    name N"). A fresh process has no cache: the pool drops them between calls."""
    first = run_distributed(_dtensor_product, 2)
    second = run_distributed(_dtensor_product, 2)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the same pooled workers
    assert [r["total"] for r in first + second] == [3.0] * 4
    assert [r["cached"] for r in second] == [0, 0]
