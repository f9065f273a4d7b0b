"""The step readers' pool starts all its threads before the first read is handed out, and
a closed step hands it to the next step of the process ([Note: pool reuse])."""

from __future__ import annotations

import os
import threading
import time

import pytest

from zerostate.store import step_base
from zerostate.store.step_base import _started_pool


def test_every_thread_runs_before_work_is_submitted():
    before = {t.name for t in threading.enumerate()}
    pool = _started_pool(5, "zs-test-pool")
    try:
        started = [t for t in threading.enumerate() if t.name not in before]
        assert len(started) == 5 and all(t.is_alive() for t in started)
        assert all(t.name.startswith("zs-test-pool") for t in started)
        assert sorted(pool.map(lambda x: x * x, range(20))) == [x * x for x in range(20)]
        # No further thread was started for the work.
        assert len([t for t in threading.enumerate() if t.name not in before]) == 5
    finally:
        pool.shutdown(wait=True)


def test_a_failed_thread_start_releases_the_started_ones(monkeypatch):
    real_start = threading.Thread.start
    count = {"n": 0}

    def start(self):
        count["n"] += 1
        if count["n"] == 3:
            raise RuntimeError("can't start new thread")
        real_start(self)

    before = set(threading.enumerate())
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start"):
        _started_pool(4, "zs-test-fail")
    monkeypatch.setattr(threading.Thread, "start", real_start)
    for t in set(threading.enumerate()) - before:
        t.join(timeout=30)  # released by the aborted gate, they leave
        assert not t.is_alive(), f"{t.name} still waits"


@pytest.fixture(autouse=True)
def no_idle_pools(monkeypatch):
    """Each test starts with no idle pool (others' tests leave theirs behind)."""
    monkeypatch.setattr(step_base, "_idle_pools", {})


@pytest.fixture
def starts(monkeypatch) -> list[int]:
    """The thread counts of the pools started while the test runs."""
    made: list[int] = []
    monkeypatch.setattr(step_base, "_started_pool", lambda n, name: made.append(n) or
                        _started_pool(n, name))  # fmt: skip
    return made


class Reader(step_base.StepBase):
    url = "memory://x"


def _pool_threads(prefix: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(prefix)}


def test_step_readers_use_it(starts):
    reader = Reader(1, 1, {}, {}, num_threads=3)
    assert reader._map(lambda x: x + 1, [1, 2, 3, 4]) == [2, 3, 4, 5]
    reader.close()
    assert starts == [3]


def test_a_closed_steps_pool_serves_the_next_step(starts):
    first = Reader(1, 1, {}, {}, num_threads=3, thread_name="zs-reuse")
    assert first._map(lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]
    threads = _pool_threads("zs-reuse")
    assert len(threads) == 3
    first.close()
    assert all(t.is_alive() for t in threads)  # waiting for the next step
    second = Reader(2, 1, {}, {}, num_threads=3, thread_name="zs-reuse")
    ran_on = set()

    def where(x):
        ran_on.add(threading.current_thread())
        time.sleep(0.01)
        return x + 1

    assert second._map(where, list(range(9))) == list(range(1, 10))
    assert starts == [3]  # no second start
    assert ran_on <= threads and _pool_threads("zs-reuse") == threads
    # Another thread count is another kind of pool.
    other = Reader(3, 1, {}, {}, num_threads=2, thread_name="zs-reuse")
    assert other._map(lambda x: x, [1, 2]) == [1, 2]
    assert starts == [3, 2]
    for r in (second, other):
        r.close()
    assert sorted(len(v) for v in step_base._idle_pools.values()) == [1, 1]


def test_steps_open_at_once_have_a_pool_each():
    a = Reader(1, 1, {}, {}, num_threads=2, thread_name="zs-each")
    b = Reader(2, 1, {}, {}, num_threads=2, thread_name="zs-each")
    try:
        a._map(lambda x: x, [1, 2])
        b._map(lambda x: x, [1, 2])
        assert a._pool is not b._pool
        assert len(_pool_threads("zs-each")) == 4
    finally:
        a.close()
        b.close()


def test_idle_pools_are_capped():
    readers = [Reader(i, 1, {}, {}, num_threads=2, thread_name="zs-cap") for i in range(4)]
    for r in readers:
        r._map(lambda x: x, [1, 2])
    pools = [r._pool for r in readers]
    for r in readers:
        r.close()
    idle = step_base._idle_pools[(2, "zs-cap")]
    assert len(idle) == step_base.MAX_IDLE_POOLS == 2
    shut = [p for p in pools if p not in idle]
    assert len(shut) == 2 and all(p._shutdown for p in shut)
    for p in shut:
        with pytest.raises(RuntimeError, match="shutdown"):
            p.submit(int)


def test_a_pool_closed_while_its_map_runs_is_shut_down_not_reused():
    reader = Reader(1, 1, {}, {}, num_threads=2, thread_name="zs-busy")
    inside, release = threading.Event(), threading.Event()

    def slow(x):
        inside.set()
        release.wait(30)
        return x

    result = []
    mapper = threading.Thread(target=lambda: result.append(reader._map(slow, [1, 2])))
    mapper.start()
    assert inside.wait(30)
    pool = reader._pool
    threading.Timer(0.2, release.set).start()
    reader.close()  # waits for the running map, as a shutdown does
    mapper.join(30)
    assert result == [[1, 2]]
    assert pool._shutdown and (2, "zs-busy") not in step_base._idle_pools
    # The reader still works, on a pool of its own again.
    assert reader._map(lambda x: -x, [1, 2]) == [-1, -2] and reader._pool is not pool
    reader.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is what leaves threads behind")
def test_a_forked_child_starts_its_own_pool():
    parent = Reader(1, 1, {}, {}, num_threads=2, thread_name="zs-fork")
    parent._map(lambda x: x, [1, 2])
    parent.close()
    assert len(step_base._idle_pools[(2, "zs-fork")]) == 1
    pid = os.fork()
    if pid == 0:  # the child: the parent's idle pool has no threads here
        code = 1
        try:
            child = Reader(2, 1, {}, {}, num_threads=2, thread_name="zs-fork")
            ok = not step_base._idle_pools and child._map(lambda x: x * 3, [1, 2, 3]) == [3, 6, 9]
            code = 0 if ok else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's read never ran (it used the parent's pool)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(step_base._idle_pools[(2, "zs-fork")]) == 1  # the parent keeps its own


@pytest.mark.parametrize("gated", [False, True])
def test_a_failed_map_leaves_no_item_running(monkeypatch, gated):
    """A read that fails must not leave others writing after the map raised: a load that
    fails and is retried from another step would find the failed load's reads landing in
    the engine's tensors afterwards. Items still waiting for a thread are skipped."""
    if gated:
        monkeypatch.setattr(step_base, "usable_cpus", lambda: 2)
    reader = Reader(1, 1, {}, {}, num_threads=4, thread_name="zs-fail-map")
    events: list[str] = []
    started = threading.Event()

    def item(x):
        if x == "fail":
            started.wait(5)  # the slow item is running when this one fails
            raise ValueError("damaged")
        if x == "slow":
            started.set()
            time.sleep(0.3)
        events.append(x)
        return x

    items = ["fail", "slow", "a", "b", "c", "d"]
    with pytest.raises(ValueError, match="damaged"):
        reader._map(item, items, cpu_bound=gated)
    done = list(events)
    time.sleep(0.5)
    assert events == done, "an item ran after the map raised"
    assert "slow" in done  # the running item finished before the map returned
    if gated:
        assert done == ["slow"]  # two at a time: the rest were skipped, not run
    reader.close()
    assert reader._map(lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]  # the reader still works


def test_a_long_item_can_stop_once_another_failed():
    """map_failed() tells a running item that the map will raise, so a long read stops
    between its parts instead of finishing work that is thrown away."""
    reader = Reader(1, 1, {}, {}, num_threads=2, thread_name="zs-stop")
    seen: list = []

    def item(x):
        if x == "fail":
            time.sleep(0.05)
            raise ValueError("damaged")
        for i in range(500):
            if step_base.map_failed():
                seen.append(i)
                return
            time.sleep(0.01)
        seen.append("all")

    with pytest.raises(ValueError, match="damaged"):
        reader._map(item, ["long", "fail"])
    assert len(seen) == 1 and seen[0] != "all" and seen[0] < 250, seen
    assert not step_base.map_failed()  # outside a map
    assert reader._map(lambda x: step_base.map_failed(), [1, 2]) == [False, False]
    reader.close()


def test_a_stream_stops_between_runs_once_another_failed(tmp_path, monkeypatch):
    """The local stream reader asks map_failed() before each run it reads."""
    from _store_helpers import make_tensors

    from zerostate.store import open_checkpoint, reader_v2, save_tensors

    tensors = make_tensors()
    save_tensors(str(tmp_path), 1, tensors, world_size=2, min_shard_numel=8)
    runs: list = []
    real = reader_v2.StepReaderV2._read_run
    monkeypatch.setattr(reader_v2.StepReaderV2, "_read_run",
                        lambda self, *a: runs.append(a[1]) or real(self, *a))  # fmt: skip
    with open_checkpoint(str(tmp_path)).step(1) as st:
        requests = [(n, 0, t.numel(), None) for n, t in tensors.items()]
        st.read_many(requests)
        assert runs  # the reads go through _read_run
        runs.clear()
        monkeypatch.setattr(reader_v2, "map_failed", lambda: True)  # as if one had failed
        st.read_many(requests)
        assert runs == []  # every stream stopped before its first run
