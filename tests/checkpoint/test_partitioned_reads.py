"""Reading a stage-3 parameter outside ``gathered()`` is refused with the calls that work,
instead of killing the process: ``AveragedModel.update_parameters(model)`` after each step
(an EMA), ``p.norm()`` for logging, ``p.clone()``, ``print(p)`` and ``p.detach().numpy()``
read memory the parameter does not have (SIGSEGV, or garbage for numpy). What reads no
values (shapes, counts, dtype, device, a ``.to()`` that changes nothing) still works, and
the EMA inside ``engine.gathered()`` equals the same EMA over torch's AdamW
([Note: reading a parameter outside a gather] in zerostate.runtime.hollow)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from common import EPS, LR, batch, error_of, local, make_engine, make_model, param_groups
from helpers_dist import run_distributed
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

STEPS, DECAY = 3, 0.8


def _model():
    # Odd widths (24 -> 96 splits unevenly in 2), tied embeddings (GPT-2).
    return make_model(n_embd=24, n_head=3)


def _ema(model):
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch's AdamW, the EMA updated after each step."""
    model = _model()
    ema = _ema(model)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = batch(step, 0)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        ema.update_parameters(model)
    return {n: p.detach().clone() for n, p in ema.module.named_parameters()}


def _reads(model: nn.Module, ema: AveragedModel) -> dict[str, str | None]:
    """Each read of values outside a gather: the error it raised (None: no error)."""
    p = model.transformer.h[0].mlp.c_fc.weight
    return {
        "ema": error_of(lambda: ema.update_parameters(model)),
        "norm": error_of(lambda: p.norm()),
        "clone": error_of(lambda: p.clone()),
        "numpy": error_of(lambda: p.detach().numpy()),
        "item": error_of(lambda: p.sum().item()),
        "data": error_of(lambda: p.data.mul_(1.0)),
        "arith": error_of(lambda: p * 2),
        "vector": error_of(lambda: nn.utils.parameters_to_vector(model.parameters())),
        "deepcopy": error_of(lambda: copy.deepcopy(p)),
        "save": error_of(lambda: torch.save(p, io.BytesIO())),
    }


def _worker(rank: int, world_size: int, offload: str | None, read: bool) -> dict:
    model = _model()
    count = sum(p.numel() for p in model.parameters())
    ema = _ema(model)
    plain = _ema(model)  # built before the engine, as users build an EMA; read outside
    engine = make_engine(model, stage=3, offload=offload)
    out: dict = {"before": error_of(lambda: model.transformer.h[0].mlp.c_fc.weight.norm())}
    for step in range(STEPS):
        x, y = batch(step, 0)
        engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
        engine.step()
        if read and step == 0:
            out["reads"] = _reads(model, plain)
            p = model.transformer.h[0].mlp.c_fc.weight
            # What reads no values works outside a gather.
            out["count"] = (sum(q.numel() for q in model.parameters()), count)
            out["meta"] = (tuple(p.shape), p.dtype, p.device.type, p.requires_grad)
            out["repr"] = repr(p)
            model.to("cpu")  # Lightning and the Trainer move the model to its own device
            out["device"] = next(model.parameters()).device.type
            with engine.gathered():
                out["inside"] = (type(p) is nn.Parameter, p.norm().item())
        with engine.gathered():
            ema.update_parameters(model)
    full = engine.full_state_dict()
    engine.close()
    out["closed_plain"] = all(type(p) is nn.Parameter for p in model.parameters())
    out["closed_equal"] = all(torch.equal(full[n], p) for n, p in model.named_parameters())
    out["ema"] = {n: p.detach().clone() for n, p in ema.module.named_parameters()}
    out["norm"] = full["transformer.h.0.mlp.c_fc.weight"].norm().item()
    dist.barrier()
    return out


@pytest.mark.parametrize("offload", [None, "params"])
def test_reads_outside_a_gather_are_refused_and_an_ema_inside_one_equals_torch(offload):
    reference = _reference()
    results = run_distributed(_worker, 2, offload, True)
    for rank, out in enumerate(results):
        for what, error in out["reads"].items():
            assert error is not None, (rank, what)  # refused, the process alive
            assert "outside engine.gathered()" in error and "engine.full_state_dict()" in error
            # Named: the parameter read, or (a walk over the model) the first one released.
            watched = what not in ("ema", "vector")
            named = "transformer.h.0.mlp.c_fc.weight" if watched else " on transformer."
            assert named in error, error
        assert "transformer.h.0.mlp.c_fc.weight" in out["before"]  # before the first step
        assert out["count"][0] == out["count"][1]
        assert out["meta"] == ((24, 96), torch.float32, "cpu", True)
        assert "no values outside engine.gathered()" in out["repr"]
        assert out["device"] == "cpu"
        assert out["inside"][0]
        assert out["closed_plain"] and out["closed_equal"]
        for name, want in reference.items():
            torch.testing.assert_close(out["ema"][name], want, rtol=1e-5, atol=1e-6)
    # The refused reads changed nothing: the run equals one that never tried them.
    plain = run_distributed(_worker, 2, offload, False)
    for name, value in results[0]["ema"].items():
        assert torch.equal(value, plain[0]["ema"][name]), name
    assert results[0]["norm"] == plain[0]["norm"]
