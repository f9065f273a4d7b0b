"""``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` between ``engine.backward`` and
``engine.step``, the DDP/FSDP2 habit: at every stage it raises at once, naming
``grad_clip=``, instead of clipping nothing; the failed call leaves the run unchanged, and
``grad_clip=c`` clips as torch's call on a single model does ([Note: gradient stand-ins] in
zerostate.runtime.grad_stand_in). 2 gloo ranks, SGD (where clipping shows in the weights)."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import GradientAccessError

BATCH, STEPS, LR, CLIP = 8, 3, 0.5, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _torch_reference(clip: float | None) -> dict[str, torch.Tensor]:
    """One process, the whole batch: what DDP with torch's clip computes."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_data(step)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _train(rank: int, world_size: int, stage: int, *, torch_clip: bool, **settings) -> dict:
    model = _model()
    engine = zerostate.Engine(
        model,
        stage=stage,
        min_shard_numel=4,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        **settings,
    )
    b = BATCH // world_size
    out: dict = {"errors": [], "grad_after_step": []}
    for step in range(STEPS):
        x, y = _data(step)
        engine.backward(_loss(engine, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]))
        if torch_clip:
            try:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                out["errors"].append(f"returned {float(norm)}")
            except GradientAccessError as exc:
                out["errors"].append(str(exc))
        engine.step()
        out["grad_after_step"].append(sorted({type(p.grad).__name__ for p in model.parameters()}))
    out["weights"] = engine.full_state_dict()
    engine.close()
    return out


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for stage in range(4):
        results[stage] = {
            "torch_clip": _train(rank, world_size, stage, torch_clip=True),
            "grad_clip": _train(rank, world_size, stage, torch_clip=False, grad_clip=CLIP),
        }
    return results


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


@pytest.mark.slow
def test_torch_clip_call_names_grad_clip_at_every_stage() -> None:
    results = run_distributed(_worker, 2, timeout=300)
    clipped, unclipped = _torch_reference(CLIP), _torch_reference(None)
    assert _max_diff(clipped, unclipped) > 1e-3  # this setup clips: the norm exceeds CLIP
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            where = f"rank {rank} stage {stage}"
            # Every step's call raised at once (none returned a norm), naming the fix.
            assert len(r["torch_clip"]["errors"]) == STEPS, where
            for message in r["torch_clip"]["errors"]:
                assert "grad_clip=max_norm" in message, (where, message)
                assert "gradient_clip_val" in message and "max_grad_norm" in message, where
                assert f"at stage {stage}" in message, (where, message)
            # The refused call changed nothing: the run equals torch's unclipped one.
            assert _max_diff(r["torch_clip"]["weights"], unclipped) <= 1e-6, where
            # step() leaves .grad None at every stage, as torch's zero_grad() does (stage 0's
            # gradients are written once into its buffer on arrival, [Note: written on arrival]).
            for names in r["torch_clip"]["grad_after_step"]:
                assert names == ["NoneType"], (where, names)
            # The setting the message names clips as torch's call does on a single model.
            assert _max_diff(r["grad_clip"]["weights"], clipped) <= 1e-6, where
