"""A dropped engine is freed, with everything it holds (its model and process group)."""

from __future__ import annotations

import gc
import weakref

import pytest
from common import batch, make_engine, make_model
from simgroup import run_sim


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_is_freed_with_its_model(monkeypatch, stage) -> None:
    def worker(rank, group):
        engine = make_engine(make_model(), stage=stage, group=group)
        x, y = batch(0, 0)
        engine.backward(engine(x, y))
        engine.step()
        refs = [weakref.ref(engine), weakref.ref(engine.module)]
        del engine
        gc.collect()
        return [r() is None for r in refs]

    assert run_sim(worker, 1, monkeypatch) == [[True, True]]
