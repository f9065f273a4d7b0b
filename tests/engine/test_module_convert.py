"""``model.double()``, ``.half()``, ``.to(dtype)``, ``to_empty()`` or ``share_memory()`` on
a model a stage-3 engine trains ([Note: converting a partitioned model] in
zerostate.engine): refused before any parameter changes (``.double()`` and
``share_memory()`` used to kill the process with SIGSEGV), while conversions that change
nothing (``.to()`` the device and dtype the model has) go through."""

from __future__ import annotations

import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.runtime.runtime import StageUsageError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 2)
    )


def _losses(engine: zerostate.Engine, rank: int, n: int = 2) -> list[float]:
    out = []
    for i in range(n):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * i + rank))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model = _model()
    engine = zerostate.Engine(model, stage=3, lr=5e-2)
    twin = zerostate.Engine(_model(), stage=3, lr=5e-2)  # never converted
    before = engine.full_state_dict()
    conversions = {
        "double": lambda: model.double(),
        "half": lambda: model.half(),
        "to_bf16": lambda: model.to(torch.bfloat16),
        "to_empty": lambda: model.to_empty(device="cpu"),
        "share_memory": lambda: model.share_memory(),
        "submodule_double": lambda: model[2].double(),
    }
    out: dict = {"refused": {}}
    for label, convert in conversions.items():
        try:
            convert()
            out["refused"][label] = None
        except StageUsageError as exc:
            out["refused"][label] = str(exc)
    try:
        with engine.gathered():
            model.double()
        out["refused"]["inside_gathered"] = None
    except StageUsageError as exc:
        out["refused"]["inside_gathered"] = str(exc)
    after = engine.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    model.to("cpu")  # changes nothing: goes through
    model.float()
    model.to(torch.float32)
    out["losses"], out["twin_losses"] = _losses(engine, rank), _losses(twin, rank)
    engine.close()
    model.double()  # a plain module again
    out["after_close"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def test_converting_a_stage3_model_is_refused_before_anything_changes():
    for r in run_distributed(_worker, 2):
        for label, message in r["refused"].items():
            assert message and "precision=" in message and "engine.close()" in message, label
        assert r["unchanged"] and r["dtypes"] == ["torch.float32"], r
        assert r["losses"] == r["twin_losses"], r
        assert r["after_close"] == ["torch.float64"], r
