"""The step readers' pool starts all its threads before the first read is handed out."""

from __future__ import annotations

import threading

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


def test_step_readers_use_it(monkeypatch):
    made = []
    monkeypatch.setattr(step_base, "_started_pool", lambda n, name: made.append(n) or
                        _started_pool(n, name))  # fmt: skip

    class Reader(step_base.StepBase):
        url = "memory://x"

    reader = Reader(1, 1, {}, {}, num_threads=3)
    assert reader._map(lambda x: x + 1, [1, 2, 3, 4]) == [2, 3, 4, 5]
    reader.close()
    assert made == [3]
