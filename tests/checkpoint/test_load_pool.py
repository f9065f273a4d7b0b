"""Loads in one process share their read threads: each load closes its step, and the next
load takes the pool it handed back ([Note: pool reuse] in zerostate/store/step_base.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from common import batch, make_model
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from zerostate.store import step_base


@pytest.mark.usefixtures("world_of_one")
def test_repeated_loads_start_their_read_threads_once(tmp_path, monkeypatch):
    monkeypatch.setattr(step_base, "_idle_pools", {})
    monkeypatch.setattr(step_base, "usable_cpus", lambda: 2)  # reads go through the pool
    real, starts = step_base._started_pool, []
    monkeypatch.setattr(
        step_base, "_started_pool", lambda n, name: starts.append(n) or real(n, name)
    )
    engine = zerostate.Engine(make_model(), stage=2)
    try:
        x, y = batch(0, 0)
        engine.backward(engine(x, y))
        engine.step()
        engine.save(str(tmp_path / "ckpt"))
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        # Threads by identity, not name: a save's read threads still ending under load carry
        # the same names as the load pool's, and a set of names would hide the new ones.
        before = set(threading.enumerate())
        for _ in range(3):
            with torch.no_grad():
                for p in engine.module.parameters():
                    p.add_(1.0)
            engine.load(str(tmp_path / "ckpt"))
            for n, p in engine.module.named_parameters():
                torch.testing.assert_close(p.detach(), saved[n], rtol=0, atol=0)
            # The loaded step was closed and its pool is waiting for the next load.
            assert [len(v) for v in step_base._idle_pools.values()] == [1]
        assert len(starts) == 1
        new = set(threading.enumerate()) - before
        assert len(new) == starts[0]  # one pool's threads, whatever the number of loads
    finally:
        engine.close()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("damage", ["shape", "row"])
def test_a_failed_load_closes_its_step(tmp_path, monkeypatch, damage):
    """A load that fails after opening its step (a model of another shape, a damaged row)
    closes the step before raising, so its read threads go back to the idle list at once
    rather than when the garbage collector finds the step."""
    from zerostate.store.step_base import StepBase

    monkeypatch.setattr(step_base, "_idle_pools", {})
    monkeypatch.setattr(step_base, "usable_cpus", lambda: 2)  # reads go through the pool
    closed: list[int] = []
    real_close = StepBase.close
    monkeypatch.setattr(StepBase, "close", lambda self: closed.append(self.step) or
                        real_close(self))  # fmt: skip
    root = tmp_path / "ckpt"
    with zerostate.Engine(make_model(), stage=2) as engine:
        engine.save(str(root), step=3)
    if damage == "row":
        row = max((p for p in root.rglob("*") if p.is_file() and "/c/" in str(p)),
                  key=lambda p: p.stat().st_size)  # fmt: skip
        data = bytearray(row.read_bytes())
        data[len(data) // 2] ^= 0xFF
        row.write_bytes(bytes(data))
        model = make_model()
    else:
        model = make_model(n_embd=48)
    with zerostate.Engine(model, stage=2) as engine:
        with pytest.raises(zerostate.errors.ZerostateError):
            engine.load(str(root))
        assert closed == [3]
        if damage == "row":  # the reads had started: the pool waits for the next step
            assert [len(v) for v in step_base._idle_pools.values()] == [1]


@pytest.mark.usefixtures("world_of_one")
def test_a_failed_load_writes_nothing_after_it_raised(tmp_path, monkeypatch):
    """[Note: a failed map] in zerostate/store/step_base.py: one row object fails its
    checksum at once while the others are still being read; when ``load`` raises, every
    read has stopped, so nothing lands in the engine's tensors afterwards."""
    import time

    from zerostate.store import reader_v2

    monkeypatch.setattr(step_base, "usable_cpus", lambda: 8)  # every stream at once
    root = tmp_path / "ckpt"
    with zerostate.Engine(make_model(), stage=2) as engine:
        x, y = batch(0, 0)
        engine.backward(engine(x, y))
        engine.step()
        engine.save(str(root), step=1)
    rows = sorted(p for p in root.rglob("*") if p.is_file() and "/c/" in str(p))
    damaged = next(p for p in rows if "/model/" in str(p))
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF
    damaged.write_bytes(bytes(data))
    real_stream = reader_v2.StepReaderV2._read_stream

    def slow_unless_damaged(self, jobs):
        if jobs[0][0].name != "model":
            time.sleep(0.3)  # the damaged stream fails first
        return real_stream(self, jobs)

    monkeypatch.setattr(reader_v2.StepReaderV2, "_read_stream", slow_unless_damaged)
    with zerostate.Engine(make_model(seed=1), stage=2) as engine:
        with pytest.raises(zerostate.errors.ZerostateError, match="checksum"):
            engine.load(str(root))
        after = {v.name: v.local.detach().clone() for v in engine.state_views()}
        time.sleep(0.6)
        for v in engine.state_views():
            torch.testing.assert_close(v.local.detach(), after[v.name], rtol=0, atol=0)
