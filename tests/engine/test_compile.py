"""torch.compile: checkpoint names without ``_orig_mod.``, and compiled training (whole
model, per block, ``module.compile()``) matching uncompiled training at stages 2 and 3."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from helpers_dist import run_distributed
from safetensors.torch import load_file
from torch import nn

import zerostate
from zerostate.errors import ConfigError
from zerostate.store import open_checkpoint
from zerostate.store.consolidate import consolidate

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks change
# torch._dynamo's config and fill its caches. Each call forks new processes ([Note: forked
# workers] in tests/fork_server.py); nothing here needs a new interpreter, so the ranks are not
# spawned.

STEPS = 3
WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, 1)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.h:
            x = block(x)
        return ((self.out(x) * self.scale - y) ** 2).mean()


def make(how: str) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    if how == "whole":
        return torch.compile(model)
    if how == "per-block":
        for i, block in enumerate(model.h):
            model.h[i] = torch.compile(block)
    elif how == "method":
        model.compile()
    return model


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _train(rank: int, stage: int, how: str, root: str) -> dict:
    engine = zerostate.Engine(make(how), stage=stage, lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = engine(*data(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.save(root)
    names = sorted(open_checkpoint(root).step().tensors)
    return {"losses": losses, "state": engine.full_state_dict(), "names": names}


def _load(stage: int, how: str, root: str) -> dict:
    engine = zerostate.Engine(make(how), stage=stage, lr=1e-2)
    engine.load(root)
    # One more step after the load: the compiled module runs on the loaded state.
    engine.backward(engine(*data(STEPS, torch.distributed.get_rank())))
    engine.step()
    return engine.full_state_dict()


def _refused(stage: int, how: str) -> str:
    try:
        zerostate.Engine(make(how), stage=stage)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _worker(rank: int, world_size: int, tmp: str, stage: int, variants: list[str]) -> dict:
    torch._dynamo.config.cache_size_limit = 64
    out = {}
    for how in variants:
        out[how] = _train(rank, stage, how, os.path.join(tmp, f"{stage}-{how}"))
    # Saved compiled, loaded plain, and the reverse: both continue identically.
    compiled = variants[-1]
    out["loads"] = {
        f"{compiled}->plain": _load(stage, "plain", os.path.join(tmp, f"{stage}-{compiled}")),
        f"plain->{compiled}": _load(stage, compiled, os.path.join(tmp, f"{stage}-plain")),
    }
    if stage == 3:
        out["refused"] = {how: _refused(3, how) for how in ("whole", "method")}
    return out


def _compare(results: list[dict], variants: list[str]) -> None:
    for r in results:
        base = r["plain"]
        assert all(not n.count("_orig_mod") for n in base["names"])
        for how in variants[1:]:
            got = r[how]
            assert got["names"] == base["names"], how
            worst = max(abs(a - b) for a, b in zip(got["losses"], base["losses"], strict=True))
            assert worst <= 1e-5, (how, got["losses"], base["losses"])
            assert got["state"].keys() == base["state"].keys(), how
            for name, t in base["state"].items():
                diff = (got["state"][name] - t).abs().max().item()
                assert diff <= 1e-5, (how, name, diff)
            print(f"{how}: max loss difference {worst:.2e}")
        assert base["losses"][-1] != base["losses"][0]  # it trained
        a, b = r["loads"].values()
        assert a.keys() == b.keys() == base["state"].keys()
        for name in a:
            assert (a[name] - b[name]).abs().max().item() <= 1e-5, name


def test_stage2_compiled_matches_uncompiled(tmp_path: Path) -> None:
    variants = ["plain", "whole", "per-block", "method"]
    results = run_distributed(_worker, 2, str(tmp_path), 2, variants, timeout=600)
    _compare(results, variants)
    # Consolidation of a compiled run gives the plain model's names.
    keys = {}
    for how in ("plain", "whole", "per-block"):
        out = tmp_path / f"{how}.safetensors"
        consolidate(str(tmp_path / f"2-{how}"), str(out))
        keys[how] = sorted(load_file(str(out)))
    assert keys["whole"] == keys["per-block"] == keys["plain"]
    assert "h.0.up.weight" in keys["plain"] and "scale" in keys["plain"]


def test_stage3_per_block_compile_matches_uncompiled(tmp_path: Path) -> None:
    variants = ["plain", "per-block"]
    results = run_distributed(_worker, 2, str(tmp_path), 3, variants, timeout=600)
    _compare(results, variants)
    # Whole-model compile and module.compile() fail at construction, saying what to do.
    for r in results:
        assert "torch.compile(model) cannot be trained at stage 3" in r["refused"]["whole"]
        assert "model.compile() cannot be trained at stage 3" in r["refused"]["method"]
        for text in r["refused"].values():
            assert "model.h[i] = torch.compile(block)" in text and "stage=2" in text
