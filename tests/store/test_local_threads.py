"""Local reads and checks run at most as many at once as there are CPUs ([Note: local
read threads] in ``step_base.py``); other work keeps every thread of the pool."""

from __future__ import annotations

import threading
import time

import pytest
from _store_helpers import make_tensors, write_step

from zerostate.store import open_checkpoint, step_base
from zerostate.store.step_base import StepBase


def _concurrency(base: StepBase, cpu_bound: bool, items: int = 12) -> tuple[int, list]:
    lock, running, peak = threading.Lock(), [0], [0]

    def work(x):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return x * x

    out = base._map(work, list(range(items)), cpu_bound=cpu_bound)
    return peak[0], out


@pytest.mark.parametrize("cpus", [1, 2, 3])
def test_cpu_bound_work_runs_at_most_one_item_per_cpu(monkeypatch, cpus):
    monkeypatch.setattr(step_base, "usable_cpus", lambda: cpus)
    base = StepBase(1, 1, {}, {}, num_threads=8)
    try:
        peak, out = _concurrency(base, cpu_bound=True)
        assert out == [x * x for x in range(12)]
        assert peak == cpus
        peak, out = _concurrency(base, cpu_bound=False)
        assert out == [x * x for x in range(12)]
        assert peak == 8
    finally:
        base.close()


def test_errors_still_reach_the_caller(monkeypatch):
    monkeypatch.setattr(step_base, "usable_cpus", lambda: 2)
    base = StepBase(1, 1, {}, {}, num_threads=8)

    def work(x):
        if x == 5:
            raise ValueError("item 5")
        return x

    try:
        with pytest.raises(ValueError, match="item 5"):
            base._map(work, list(range(10)), cpu_bound=True)
        assert base._map(lambda x: x, [1, 2, 3], cpu_bound=True) == [1, 2, 3]  # usable after
    finally:
        base.close()


def test_usable_cpus_is_a_positive_count():
    n = step_base.usable_cpus()
    assert isinstance(n, int) and n >= 1


def test_local_loads_and_verify_go_through_the_gate(tmp_path, monkeypatch):
    tensors = make_tensors(1)
    write_step(str(tmp_path / "ckpt"), 1, tensors, world_size=2)
    seen = []
    real = StepBase._map

    def spy(self, fn, items, *, cpu_bound=False):
        seen.append(cpu_bound)
        return real(self, fn, items, cpu_bound=cpu_bound)

    monkeypatch.setattr(StepBase, "_map", spy)
    st = open_checkpoint(str(tmp_path / "ckpt")).step(1)
    for name, t in tensors.items():
        assert st.read(name).equal(t)
    assert seen and all(seen)  # every read of local rows is gated
    seen.clear()
    st.verify()
    assert seen[0] is True  # the rows; documents and manifests are not gated
