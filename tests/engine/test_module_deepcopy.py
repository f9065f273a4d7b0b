"""``copy.deepcopy(model)`` of a wrapped model (an EMA through ``AveragedModel``, a frozen
reference model) gives a plain torch module ([Note: deep copies of a wrapped model] in
zerostate.engine): the copy used to carry the engine's hooks and checkpointed forwards (its
output followed the original's training; at stage 3 a call on one rank hung in the
original's gather; ``Engine(copy)`` was refused as already wrapped), and at stage 3 outside
``gathered()`` the copy killed the process (SIGSEGV)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn
from torch.optim.swa_utils import AveragedModel

import zerostate
from zerostate.runtime.runtime import StageUsageError


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), Block(11), Block(11), nn.Linear(11, 3))


def _engine(model: nn.Module, stage: int, checkpointing: str | None) -> zerostate.Engine:
    return zerostate.Engine(
        model,
        stage=stage,
        lr=5e-2,
        activation_checkpointing=checkpointing,
        checkpoint_modules=Block,
    )


def _step(engine: zerostate.Engine, rank: int, i: int) -> float:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * i + rank))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine_parts(module: nn.Module) -> list[str]:
    """What of an engine a module carries: hook entries, an instance forward, the mark."""
    found = []
    for name, m in module.named_modules():
        state = vars(m)
        hooks = sum(len(v) for k, v in state.items() if "hooks" in k and isinstance(v, dict))
        if hooks:
            found.append(f"{name or 'root'}: {hooks} hook(s)")
        found += [
            f"{name or 'root'}: {k}"
            for k in ("forward", "_zerostate_wrapped_by", "__deepcopy__", "_apply")
            if k in state
        ]
    return found


def _worker(rank: int, world: int, stage: int, checkpointing: str | None) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(99))
    model = _model()
    engine = _engine(model, stage, checkpointing)
    twin = _engine(_model(), stage, checkpointing)  # never copied: the original must match it
    if stage == 3:
        for label, make in (("deepcopy", copy.deepcopy), ("averaged", AveragedModel)):
            try:
                make(model)
                out[label] = None
            except StageUsageError as exc:
                out[label] = str(exc)
    with engine.gathered() if stage == 3 else torch.no_grad():
        snapshot = copy.deepcopy(model)
        ema = AveragedModel(model)
    out["snapshot_parts"] = _engine_parts(snapshot)
    out["ema_parts"] = _engine_parts(ema)
    with torch.no_grad():
        before = snapshot(x).clone()
    out["losses"] = [_step(engine, rank, i) for i in range(3)]
    out["twin_losses"] = [_step(twin, rank, i) for i in range(3)]
    with torch.no_grad():
        # Rank 0 alone: a copy that still gathered the original's parameters hung here.
        out["unchanged_by_training"] = torch.equal(snapshot(x), before) if rank == 0 else True
        out["ema_own_values"] = torch.equal(ema(x), before) if rank == 0 else True
    # The documented EMA update: from the live weights, inside gathered() at stage 3.
    with engine.gathered() if stage == 3 else torch.no_grad():
        ema.update_parameters(model)
    full = engine.full_state_dict()
    out["ema_updated"] = all(torch.equal(v, full[k]) for k, v in ema.module.state_dict().items())
    # The copy is a model of its own: a new engine trains it.
    other = _engine(snapshot, stage, checkpointing)
    out["copy_trains"] = all(torch.isfinite(torch.tensor(_step(other, rank, i))) for i in range(2))
    engine.close()
    out["after_close_parts"] = "__deepcopy__" in vars(model)
    out["after_close_copy"] = torch.equal(copy.deepcopy(model)(x), model(x))
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_a_deep_copy_of_a_wrapped_model_is_a_plain_module(stage, checkpointing):
    for r in run_distributed(_worker, 2, stage, checkpointing, timeout=120):
        if stage == 3:
            for label in ("deepcopy", "averaged"):
                assert r[label] and "engine.gathered()" in r[label], r
        assert r["snapshot_parts"] == [] and r["ema_parts"] == [], r
        assert r["losses"] == r["twin_losses"], r
        assert r["unchanged_by_training"] and r["ema_own_values"], r
        assert r["ema_updated"], r
        assert r["copy_trains"], r
        assert not r["after_close_parts"] and r["after_close_copy"], r
