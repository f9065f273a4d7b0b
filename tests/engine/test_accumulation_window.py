"""A load inside a gradient accumulation window drops the gradients accumulated before it
([Note: a load ends the accumulation window] in zerostate.engine.pipeline); a save or a load
inside one says so on rank 0."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers_dist import run_distributed
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate


def _engine(stage: int, seed: int) -> zerostate.Engine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return zerostate.Engine(model, lr=0.05, stage=stage, grad_accum_steps=2)


def _micro(engine: zerostate.Engine, x: torch.Tensor) -> bool:
    engine.backward(engine(x).square().mean())
    return engine.step()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_load_inside_a_window_drops_the_gradients_accumulated_before_it(tmp_path, stage, caplog):
    """One micro-batch on other weights, a load, then a full window: the same update as a
    freshly loaded engine's full window. The old micro-batch's gradient leaked into it."""
    torch.manual_seed(0)
    x0, x1, x2 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    root = str(tmp_path / "root")
    saved = _engine(stage, 1)
    _micro(saved, x0)
    assert _micro(saved, x1)  # one full window: a step with moments
    saved.save(root)
    saved.close()

    inside = _engine(stage, 2)
    assert not _micro(inside, x0)  # half a window on weights the load replaces
    with caplog.at_level(logging.WARNING, logger="zerostate"):
        inside.load(root)
    assert "load() inside a gradient accumulation window" in caplog.text
    assert "were dropped" in caplog.text
    fresh = _engine(stage, 3)
    fresh.load(root)
    for engine in (inside, fresh):
        assert not _micro(engine, x1)
        assert _micro(engine, x2)
    got, want = inside.full_state_dict(), fresh.full_state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    inside.close()
    fresh.close()


@pytest.mark.usefixtures("world_of_one")
def test_a_save_inside_a_window_says_its_gradients_are_not_in_the_step(tmp_path, caplog):
    engine = _engine(2, 0)
    _micro(engine, torch.randn(4, 8))
    with caplog.at_level(logging.WARNING, logger="zerostate"):
        engine.save(str(tmp_path / "root"))
    assert "save() inside a gradient accumulation window" in caplog.text
    assert "are not in the step" in caplog.text
    caplog.clear()
    _micro(engine, torch.randn(4, 8))  # the window ends: a save says nothing
    with caplog.at_level(logging.WARNING, logger="zerostate"):
        engine.save(str(tmp_path / "root"))
    assert "accumulation window" not in caplog.text
    engine.close()


def _two_ranks(rank: int, world_size: int, root: str, stage: int) -> bool:
    """The first test's comparison on ``world_size`` ranks, each with its own batches."""
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)
    x0, x1, x2 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    saved = _engine(stage, 1)
    _micro(saved, x0)
    _micro(saved, x1)
    saved.save(root)
    saved.close()
    inside, fresh = _engine(stage, 2), _engine(stage, 3)
    _micro(inside, x0)
    inside.load(root)
    fresh.load(root)
    for engine in (inside, fresh):
        _micro(engine, x1)
        _micro(engine, x2)
    got, want = inside.full_state_dict(), fresh.full_state_dict()
    inside.close()
    fresh.close()
    return all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_same_on_two_ranks(tmp_path, stage):
    assert run_distributed(_two_ranks, 2, str(tmp_path / "root"), stage) == [True, True]
