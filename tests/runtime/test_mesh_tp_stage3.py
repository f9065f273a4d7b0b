"""Stage 3 and offload with tensor parallelism, on 4 gloo ranks at (dp_shard 2 x tp 2).

The stage-3 runtime gathers each unit's local tp shards over dp_shard into the storage of
the DTensor parameters the module holds, so torch's DTensor forward and backward run on
them, and releases that storage again ([Note: tensor parallelism] in zerostate.runtime.tp).
Checked here: SGD parity with single-process training (within 1e-5), no gathered storage
left between steps, ``gathered()`` and ``full_state_dict()`` as the global tensors, the
hollow ``state_dict()`` refused, ``close()`` leaving the trained weights in the model, and
the same parity with ``offload="optimizer"`` (stage 2) and ``offload="params"`` (stage 3).
"""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from test_mesh_tp import SGD, STEPS, _llama, _local_batch, _loss, _parallelize, _reference, _worst
from torch.distributed.device_mesh import init_device_mesh

import zerostate
from zerostate.runtime.runtime import StageUsageError

pytest.importorskip("transformers")


def _full(model) -> dict[str, torch.Tensor]:
    """The module's own parameters as global tensors (collective over tp for DTensors)."""
    with torch.no_grad():
        return {
            n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()
        }


def _held_bytes(model) -> int:
    """Bytes of storage behind the module's parameters (a DTensor's local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.untyped_storage().nbytes()
    return total


def _train(mesh, stage, offload, out, key, ref):
    model = _parallelize(_llama(), mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), **SGD)
    engine = zerostate.Engine(model, stage=stage, mesh=mesh, optimizer=opt, offload=offload)
    held = []
    for step in range(STEPS):
        engine.backward(_loss(engine, _local_batch(step, mesh)))
        engine.step()
        held.append((_held_bytes(model), engine.memory_stats()["gathered_params"]))
    state = engine.full_state_dict()
    out[(key, "err")] = _worst(state, ref)
    out[(key, "held")] = held
    return engine, model, state


def _stage3_worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    ref, _ = _reference(torch.optim.SGD, SGD)
    out: dict = {}
    engine, model, state = _train(mesh, 3, None, out, "stage3", ref)
    # Every parameter is a DTensor of the model's (global) shape, or a plain one.
    out["dtensors"] = sum(hasattr(p, "full_tensor") for p in model.parameters())
    try:
        model.state_dict()
        out["hollow"] = "accepted"
    except StageUsageError as exc:
        out["hollow"] = str(exc)
    with engine.gathered():
        inside = _full(model)
        out["gathered_bytes"] = engine.memory_stats()["gathered_params"]
        with torch.no_grad():
            out["gathered_loss"] = float(_loss(model, _local_batch(0, mesh)))
    out["gathered_err"] = max(float((inside[n] - state[n]).abs().max()) for n in inside)
    out["after_gathered"] = _held_bytes(model)
    with torch.no_grad():
        out["engine_loss"] = float(_loss(engine, _local_batch(0, mesh)))
    engine.close()
    closed = _full(model)
    out["closed_err"] = max(float((closed[n] - state[n]).abs().max()) for n in closed)
    out["closed_state_dict"] = len(model.state_dict())
    _train(mesh, 2, "optimizer", out, "offload_optimizer", ref)
    _train(mesh, 3, "optimizer", out, "stage3_offload_optimizer", ref)
    _train(mesh, 3, "params", out, "offload_params", ref)
    return out


@pytest.mark.slow
def test_stage3_and_offload_with_tp_train_as_single_process() -> None:
    results = run_distributed(_stage3_worker, 4, timeout=900)
    r = results[0]
    for other in results[1:]:
        for key in ("stage3", "offload_optimizer", "stage3_offload_optimizer", "offload_params"):
            assert other[(key, "err")] == r[(key, "err")]  # the same global state everywhere
    for key in ("stage3", "offload_optimizer", "stage3_offload_optimizer", "offload_params"):
        print(f"{key}: SGD error {r[(key, 'err')]:.2e} after {STEPS} steps")
        assert r[(key, "err")] <= 1e-5, (key, r[(key, "err")])
    for res in results:
        # Between steps a stage-3 rank holds no gathered storage: release freed the local
        # shards of the DTensor parameters (only the replicated buffers of nothing else).
        for key in ("stage3", "stage3_offload_optimizer", "offload_params"):
            assert res[(key, "held")] == [(0, 0)] * STEPS, (key, res[(key, "held")])
        assert all(b > 0 for b, _ in res[("offload_optimizer", "held")])  # stage 2 keeps them
        assert res["dtensors"] == 14  # q/k/v/o/gate/up/down of 2 layers
        assert "engine.full_state_dict()" in res["hollow"], res["hollow"]
        assert res["gathered_bytes"] > 0 and res["after_gathered"] == 0
        assert res["gathered_err"] == 0.0 and res["closed_err"] == 0.0
        assert res["gathered_loss"] == res["engine_loss"]  # the module, gathered, is the model
        assert res["closed_state_dict"] > 0
