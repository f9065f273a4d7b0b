"""A new user's engine surprises: bf16 inputs cast by default, frozen integer parameters,
``load(strict=False)`` that says what it skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from common import log_messages
from helpers_dist import run_distributed
from safetensors.torch import load_file
from torch import nn

import zerostate
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import open_checkpoint
from zerostate.store.consolidate import consolidate


class Counted(nn.Module):
    """A model with a frozen integer parameter (a step counter, a vocabulary map...)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.h = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.ids = nn.Parameter(torch.arange(5, dtype=torch.long) * 7, requires_grad=False)

    def forward(self, x: torch.Tensor, extra: dict | None = None) -> torch.Tensor:
        x = self.lin(x)
        for block in self.h:
            x = block(x)
        if extra is not None:
            x = x + extra["bias"] * extra["mask"].to(x.dtype)
        return x.float().square().mean() + 0 * self.ids.sum()


def _error(fn, cls=Exception) -> str:
    try:
        fn()
    except cls as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    with log_messages() as logs:
        return _worker_logged(logs, tmp)


def _worker_logged(logs: list[str], tmp: str) -> dict:
    out: dict = {}
    x = torch.randn(4, 6)  # fp32, as data loaders give it
    for stage in (2, 3):
        torch.manual_seed(0)
        engine = zerostate.Engine(Counted(), stage=stage, precision="bf16")
        # Inputs cast by default; nested ones too; integer masks untouched.
        extra = {"bias": torch.ones(6), "mask": torch.tensor([1, 0, 1, 0, 1, 0])}
        loss = engine(x, extra=extra)
        engine.backward(loss)
        engine.step()
        out[("trained", stage)] = bool(torch.isfinite(loss))
        root = os.path.join(tmp, f"s{stage}")
        engine.save(root)
        st = open_checkpoint(root).step()
        out[("ids", stage)] = (st.tensors["buffers/ids"].dtype, st.read("buffers/ids").tolist())
        out[("optim", stage)] = sorted(n for n in st.tensors if "ids" in n)
        # Off: a bf16 model gets the fp32 input as given, and torch refuses it.
        torch.manual_seed(0)
        raw = zerostate.Engine(Counted(), stage=stage, precision="bf16", cast_forward_inputs=False)
        out[("uncast", stage)] = _error(lambda raw=raw: raw(x), RuntimeError)
        # The integer parameter round-trips through a load into a fresh engine.
        torch.manual_seed(1)
        fresh_model = Counted()
        with torch.no_grad():
            fresh_model.ids.zero_()
        fresh = zerostate.Engine(fresh_model, stage=stage, precision="bf16")
        fresh.load(root)
        out[("loaded ids", stage)] = fresh_model.ids.tolist()
        out[("full", stage)] = sorted(fresh.full_state_dict())
    out["bad_flag"] = _error(lambda: zerostate.Engine(Counted(), cast_forward_inputs="yes"))

    # strict=False: a model with one more layer loads the rest and logs what it skipped.
    class Wider(Counted):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(6, 6)

    wider = zerostate.Engine(Wider(), stage=2, precision="bf16")
    del logs[:]
    wider.load(os.path.join(tmp, "s2"), strict=False)
    out["skipped_logs"] = list(logs)
    out["strict"] = _error(lambda: wider.load(os.path.join(tmp, "s2")), CheckpointError)
    # A checkpoint of another model altogether: strict=False refuses to load nothing.
    other = zerostate.Engine(nn.Sequential(nn.Linear(3, 3)), stage=2)
    out["nothing"] = _error(
        lambda: other.load(os.path.join(tmp, "s2"), strict=False), CheckpointError
    )
    return out


def test_first_hour_engine(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    for r in results:
        for stage in (2, 3):
            assert r[("trained", stage)]
            assert r[("ids", stage)] == (torch.int64, [0, 7, 14, 21, 28])
            assert r[("optim", stage)] == ["buffers/ids"]  # no optimizer state, not model/
            assert "dtype" in r[("uncast", stage)], r[("uncast", stage)]
            assert r[("loaded ids", stage)] == [0, 7, 14, 21, 28]
            assert "ids" in r[("full", stage)] and "lin.weight" in r[("full", stage)]
        assert r["bad_flag"].startswith("ConfigError: cast_forward_inputs='yes'")
        assert any("left 6 tensor(s)" in m and "model/extra.weight" in m for m in r["skipped_logs"])
        assert "model/extra.weight" in r["strict"]
        assert "holds none of this model's 2 parameters" in r["nothing"], r["nothing"]
    # Consolidation exports the integer parameter under its own name and dtype.
    consolidate(str(tmp_path / "s2"), str(tmp_path / "m.safetensors"))
    tensors = load_file(str(tmp_path / "m.safetensors"))
    assert tensors["ids"].dtype == torch.int64 and tensors["ids"].tolist() == [0, 7, 14, 21, 28]


def test_cast_forward_inputs_is_validated() -> None:
    with pytest.raises(ConfigError, match="cast_forward_inputs"):
        zerostate.EngineConfig(cast_forward_inputs=1)


class Rotary(nn.Module):
    """Buffers of both kinds, at the top and in a child: ``inv`` is not persistent (as
    a rotary ``inv_freq`` is), ``scale`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.h = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.register_buffer("inv", torch.arange(6, dtype=torch.float32) / 7, persistent=False)
        self.h[1].register_buffer("scale", torch.full((6,), 0.5))
        self.h[1].register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.h[1](self.h[0](self.lin(x) * self.inv)) * self.h[1].scale
        return x.square().mean() + 0 * self.h[1].cache.sum()


def _buffers_worker(rank: int, world_size: int, tmp: str) -> dict:
    out: dict = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        engine = zerostate.Engine(Rotary(), stage=stage)
        engine.backward(engine(torch.randn(4, 6)))
        engine.step()
        root = os.path.join(tmp, f"s{stage}")
        engine.save(root)
        fresh_model = Rotary()
        with torch.no_grad():
            fresh_model.inv.zero_()
            fresh_model.h[1].cache.zero_()
        zerostate.Engine(fresh_model, stage=stage).load(root)
        out[stage] = (fresh_model.inv.tolist(), fresh_model.h[1].cache.tolist())
    return out


def test_export_leaves_out_non_persistent_buffers(tmp_path: Path) -> None:
    from zerostate.store.consolidate import non_persistent_names

    results = run_distributed(_buffers_worker, 2, str(tmp_path), timeout=300)
    expected = sorted(Rotary().state_dict())
    for stage in (0, 3):
        for r in results:  # not in the checkpoint: a load leaves them as load_state_dict does
            assert r[stage] == ([0.0] * 6, [0.0, 0.0, 0.0])
        root = str(tmp_path / f"s{stage}")
        st = open_checkpoint(root).step()
        assert "buffers/h.1.scale" in st.tensors
        assert not {"buffers/inv", "buffers/h.1.cache"} & set(st.tensors)
        assert st.attrs["engine"]["non_persistent_buffers"] == ["h.1.cache", "inv"]
        out = tmp_path / f"s{stage}.safetensors"
        consolidate(root, str(out))
        tensors = load_file(str(out))
        assert sorted(tensors) == expected  # what model.load_state_dict(strict=True) takes
        model = Rotary()
        model.load_state_dict(tensors, strict=True)
    for bad in ("inv", [1], {"inv": 1}):
        with pytest.raises(CheckpointError, match="non_persistent_buffers"):
            non_persistent_names({"engine": {"non_persistent_buffers": bad}})
    assert non_persistent_names({}) == frozenset()
    assert non_persistent_names({"engine": "junk"}) == frozenset()
