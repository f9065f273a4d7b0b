"""``load(strict=False)`` into other param groups: saved hyperparameters follow the
parameters, not the group positions ([Note: groups by membership] in zerostate.optim)."""

from __future__ import annotations

import logging
import os

import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _hyper(engine: zerostate.Engine) -> list[tuple[float, float]]:
    return [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _worker(rank: int, world_size: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    model = _net()
    saved = torch.optim.AdamW(
        [
            {"params": list(model[0].parameters()), "lr": 0.1, "weight_decay": 0.0},
            {"params": list(model[1].parameters()), "lr": 0.001, "weight_decay": 0.5},
        ]
    )
    source = zerostate.Engine(model, stage=2, optimizer=saved)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    source.backward(source(x).pow(2).mean())
    source.step()
    source.save(ckpt)

    records = _Records()
    logging.getLogger("zerostate").addHandler(records)
    try:
        out = {}
        # Layer groups in the other order: each takes its own layer's saved settings.
        model = _net()
        swapped = torch.optim.AdamW(
            [
                {"params": list(model[1].parameters()), "lr": 0.05, "weight_decay": 0.1},
                {"params": list(model[0].parameters()), "lr": 0.05, "weight_decay": 0.1},
            ]
        )
        engine = zerostate.Engine(model, stage=2, optimizer=swapped)
        engine.load(ckpt, strict=False)
        out["swapped"] = _hyper(engine)
        # Weights / biases: each group's members were saved in both layer groups, so no saved
        # group is theirs; they keep their own settings, and rank 0 says so.
        model = _net()
        split = torch.optim.AdamW(
            [
                {"params": [model[0].weight, model[1].weight], "lr": 0.05, "weight_decay": 0.1},
                {"params": [model[0].bias, model[1].bias], "lr": 0.05, "weight_decay": 0.0},
            ]
        )
        engine = zerostate.Engine(model, stage=2, optimizer=split)
        del records.messages[:]
        engine.load(ckpt, strict=False)
        out["split"] = _hyper(engine)
        out["warnings"] = [m for m in records.messages if "kept this engine's hyperparameters" in m]
    finally:
        logging.getLogger("zerostate").removeHandler(records)
    return out


def test_strict_false_matches_groups_by_membership(tmp_path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=200)
    for rank, r in enumerate(results):
        assert r["swapped"] == [(0.001, 0.5), (0.1, 0.0)], r
        assert r["split"] == [(0.05, 0.1), (0.05, 0.0)], r
        assert len(r["warnings"]) == (2 if rank == 0 else 0), r["warnings"]
        if rank == 0:
            assert "0.weight" in r["warnings"][0] and "saved groups [0, 1]" in r["warnings"][0]
