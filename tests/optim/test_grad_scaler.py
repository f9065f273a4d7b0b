"""A DDP fp16 script's ``torch.amp.GradScaler`` around the engine is refused at its first
``scaler.step(opt)`` with the fix (the engine scales fp16 losses itself), before anything is
stepped, instead of torch's "No inf checks were recorded for this optimizer"
([Note: a GradScaler around the engine] in zerostate.optim)."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import ConfigError


def _worker(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zerostate.Engine(model, stage=stage, optimizer=opt)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = engine(x).float().square().mean()
    engine.backward(scaler.scale(loss))
    try:
        scaler.step(opt)
        error = None
    except ConfigError as exc:
        error = str(exc)
    after = engine.full_state_dict()
    return {
        "error": error,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "steps": engine.optimizer_steps,
    }


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_grad_scaler_around_the_engine_is_refused_before_any_step(stage):
    for out in run_distributed(_worker, 2, stage):
        assert out["error"] is not None
        assert "GradScaler" in out["error"] and "precision='fp16'" in out["error"]
        assert out["unchanged"] and out["steps"] == 0
