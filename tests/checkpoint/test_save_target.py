"""engine.save refuses another run's root and a step directory; engine.load creates nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import CheckpointNotFoundError, ConfigError
from zerostate.store import open_checkpoint


def _expect(fn, cls) -> str:
    try:
        fn()
    except cls as exc:
        return str(exc)
    raise AssertionError(f"expected {cls.__name__}")


def _train_one(engine: zerostate.Engine, width: int) -> None:
    x = torch.ones(4, width)
    engine.backward(engine(x).square().mean())
    engine.step()


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    root = os.path.join(tmp, "ckpt")
    a = zerostate.Engine(nn.Linear(8, 8), stage=2)
    _train_one(a, 8)
    a.save(root, keep_last=1)
    # A different model into the same root: refused on every rank, nothing deleted.
    b = zerostate.Engine(nn.Sequential(nn.Linear(8, 4)), stage=2)
    _train_one(b, 8)
    out["other_model"] = _expect(lambda: b.save(root, keep_last=1), ConfigError)
    # Same names, other shape: refused too.
    c = zerostate.Engine(nn.Linear(8, 6), stage=2)
    _train_one(c, 8)
    out["other_shape"] = _expect(lambda: c.save(root, step=9), ConfigError)
    # Into a step directory of the checkpoint: refused.
    step_dir = os.path.join(root, "step-00000001")
    out["step_dir"] = _expect(lambda: a.save(os.path.join(step_dir, "x")), ConfigError)
    # The same model again (another engine, another world size would do too): accepted.
    d = zerostate.Engine(nn.Linear(8, 8), stage=1)
    _train_one(d, 8)
    _train_one(d, 8)
    d.save(root, keep_last=1)
    out["steps"] = open_checkpoint(root).steps()
    # A read that finds nothing creates nothing.
    missing = os.path.join(tmp, "no", "such", "run")
    out["load_missing"] = _expect(lambda: d.load(missing), CheckpointNotFoundError)
    out["missing_created"] = os.path.exists(os.path.join(tmp, "no"))
    return out


def test_save_target_checks(tmp_path: Path) -> None:
    (r,) = run_distributed(_worker, 1, str(tmp_path), timeout=120)
    assert "different model" in r["other_model"] and "new directory" in r["other_model"]
    assert "'model/0.bias' only in this model" in r["other_model"]
    assert "'model/bias' shape (8,) there, (6,) here" in r["other_shape"]
    assert "inside the step directory 'step-00000001'" in r["step_dir"]
    assert r["steps"] == [2]  # keep_last=1 kept the new step; the refused saves wrote nothing
    assert "does not exist" in r["load_missing"]
    assert r["missing_created"] is False


@pytest.mark.parametrize("world_size", [2])
def test_refusal_reaches_every_rank(tmp_path: Path, world_size: int) -> None:
    results = run_distributed(_worker, world_size, str(tmp_path), timeout=180)
    for r in results:
        assert "different model" in r["other_model"] or "rank 0 refused" in r["other_model"]
        assert r["steps"] == [2]
