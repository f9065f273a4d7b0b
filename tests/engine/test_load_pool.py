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
        before = {t.name for t in threading.enumerate()}
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
        new = {t.name for t in threading.enumerate()} - before
        assert len(new) == starts[0]  # one pool's threads, whatever the number of loads
    finally:
        engine.close()
