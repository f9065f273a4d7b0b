"""ZeRO inside a device mesh: hybrid sharding on 4 gloo ranks at (dp_replicate 2 x dp_shard 2).

Parity against single-process training on the global batch (AdamW at the tolerance of
test_parity.py, SGD within 1e-5), communication per mesh dimension against the formula,
memory per rank with Psi partitioned over dp_shard, and a save/load round trip at the same
layout against uninterrupted training. See [Note: hybrid sharding] in
zerostate.runtime.process_groups.
"""

from __future__ import annotations

import copy

import pytest
import torch
from common import (
    batch,
    compare,
    engine_steps,
    local,
    make_engine,
    make_model,
    reference_run,
    rel,
)
from helpers_dist import free_port, run_distributed
from torch.distributed.device_mesh import init_device_mesh

import zerostate
from zerostate.errors import ConfigError
from zerostate.store import open_checkpoint

STEPS = 5
TOL = 1e-5  # test_parity.py's tolerance, relative
HSDP = ((2, 2), ("dp_replicate", "dp_shard"))
SGD_LR = 0.05
WIDE = dict(n_embd=128)  # as test_memory_comm.py: shard padding negligible


def _hsdp_mesh():
    shape, names = HSDP
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _sgd_reference(model, steps):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, 0)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _parity_worker(rank: int, world_size: int) -> dict:
    mesh = _hsdp_mesh()
    out = {}
    ref_losses, ref_params = reference_run(make_model(), STEPS)
    sgd_params = _sgd_reference(make_model(), STEPS)
    for stage in range(4):
        engine = make_engine(make_model(), stage=stage, mesh=mesh)
        losses = engine_steps(engine, rank, world_size, STEPS)
        out[("adamw", stage)] = compare(losses, ref_losses, engine.full_state_dict(), ref_params)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
        engine = zerostate.Engine(model, stage=stage, mesh=mesh, optimizer=opt)
        engine_steps(engine, rank, world_size, STEPS)
        full = engine.full_state_dict()
        out[("sgd", stage)] = max(rel(full[n], p) for n, p in sgd_params.items())
    # A 1-D dp_shard mesh is the plain data-parallel engine: bit-identical training.
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    trained = []
    for extra in ({}, {"mesh": flat}):
        engine = make_engine(make_model(), stage=2, **extra)
        engine_steps(engine, rank, world_size, 2)
        trained.append(engine.full_state_dict())
    out["flat_mesh_identical"] = all(torch.equal(trained[0][n], trained[1][n]) for n in trained[0])
    return out


@pytest.mark.slow
def test_hsdp_parity_with_single_process_training() -> None:
    results = run_distributed(_parity_worker, 4, timeout=400)
    for r in results:
        assert r == results[0]  # every rank gathers the same state
    r = results[0]
    assert r["flat_mesh_identical"]
    for stage in range(4):
        loss_err, param_err, worst = r[("adamw", stage)]
        sgd_err = r[("sgd", stage)]
        print(
            f"HSDP 2x2 stage {stage}: AdamW loss {loss_err:.2e} param {param_err:.2e} "
            f"({worst}); SGD param {sgd_err:.2e}"
        )
        assert loss_err <= TOL and param_err <= TOL, (stage, r[("adamw", stage)])
        assert sgd_err <= 1e-5, (stage, sgd_err)


def _composition_worker(rank: int, world_size: int) -> dict:
    mesh = _hsdp_mesh()
    out = {}
    ref = reference_run(make_model(), STEPS, accum=2, grad_clip=0.05)
    for stage in (1, 2, 3):
        engine = make_engine(
            make_model(), stage=stage, mesh=mesh, grad_accum_steps=2, grad_clip=0.05
        )
        losses = engine_steps(engine, rank, world_size, STEPS, accum=2)
        out[("accum_clip", stage)] = compare(losses, ref[0], engine.full_state_dict(), ref[1])
        out[("norm", stage)] = engine.last_grad_norm
    ref = reference_run(make_model(), STEPS)
    engine = make_engine(make_model(), stage=2, mesh=mesh, offload="optimizer")
    losses = engine_steps(engine, rank, world_size, STEPS)
    out["offload"] = compare(losses, ref[0], engine.full_state_dict(), ref[1])
    # An overflow on one rank of one replica skips the step on every rank of the mesh.
    engine = make_engine(make_model(), stage=2, mesh=mesh, precision="fp16")
    before = engine.full_state_dict()
    x, y = batch(0, 0)
    loss = engine(local(x, rank, world_size), local(y, rank, world_size))
    engine.backward(loss * float("inf") if rank == world_size - 1 else loss)
    out["overflow_stepped"] = engine.step()
    out["overflow_scale"] = engine.loss_scale
    after = engine.full_state_dict()
    out["overflow_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


@pytest.mark.slow
def test_hsdp_composes_with_accumulation_clipping_offload_and_fp16_overflow() -> None:
    results = run_distributed(_composition_worker, 4, timeout=400)
    for r in results:
        assert r == results[0]  # norms, verdicts, scales and gathered state agree everywhere
    r = results[0]
    for stage in (1, 2, 3):
        loss_err, param_err, worst = r[("accum_clip", stage)]
        print(f"HSDP 2x2 stage {stage} accum 2 + clip: loss {loss_err:.2e} param {param_err:.2e}")
        assert loss_err <= TOL and param_err <= TOL, (stage, worst)
        assert r[("norm", stage)] > 0.05  # clipping was active
    loss_err, param_err, worst = r["offload"]
    print(f"HSDP 2x2 stage 2 offload: loss {loss_err:.2e} param {param_err:.2e}")
    assert loss_err <= TOL and param_err <= TOL, worst
    assert r["overflow_stepped"] is False and r["overflow_unchanged"]
    assert r["overflow_scale"] == 2.0**15


def _comm_memory_worker(rank: int, world_size: int) -> dict:
    mesh = _hsdp_mesh()
    out = {"psi": sum(p.numel() for p in make_model(**WIDE).parameters())}
    for stage in range(4):
        settings = dict(stage=stage, precision="bf16", bucket_mb=0.25, mesh=mesh)
        # As test_memory_comm.py: memory after the first backward of two micro-steps.
        engine = make_engine(
            make_model(**WIDE), grad_accum_steps=2, reduce_dtype="bf16", **settings
        )
        x, y = batch(0, 0)
        engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
        out[("memory", stage)] = engine.memory_stats()
        engine = make_engine(make_model(**WIDE), **settings)
        for step in range(2):
            x, y = batch(step, 0)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            engine.step()
        out[("comm", stage)] = {d: engine.comm_stats(d) for d in ("dp_shard", "dp_replicate")}
        out[("comm_total", stage)] = engine.comm_stats()
    return out


def _paper_bytes(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[
        stage
    ]


@pytest.mark.slow
def test_hsdp_comm_per_dimension_and_memory_match_the_formula() -> None:
    results = run_distributed(_comm_memory_worker, 4, timeout=300)
    psi = results[0]["psi"]
    shard = HSDP[0][1]
    for rank, r in enumerate(results):
        for stage in range(4):
            mem = r[("memory", stage)]["model_states"]
            mem_ratio = mem / _paper_bytes(stage, psi, shard)
            comm = r[("comm", stage)]
            expected = {
                "dp_shard": (3 if stage == 3 else 2) * psi,
                # An all-reduce counts twice its elements: of the 1/dp_shard shard at stages
                # 1-3, of the whole gradient at stage 0 (which partitions nothing).
                "dp_replicate": 2 * psi / (1 if stage == 0 else shard),
            }
            ratios = {d: comm[d]["total"]["elements"] / e for d, e in expected.items()}
            print(
                f"rank {rank} stage {stage}: memory {mem_ratio:.4f} x formula (Psi over "
                f"dp_shard {shard}); comm " + ", ".join(f"{d} {v:.4f} x" for d, v in ratios.items())
            )
            assert abs(mem_ratio - 1) <= 0.05, (stage, r[("memory", stage)])
            for d, v in ratios.items():
                assert abs(v - 1) <= 0.01, (stage, d, comm[d])
            total = r[("comm_total", stage)]["total"]["elements"]
            assert total == sum(comm[d]["total"]["elements"] for d in expected)


def _round_trip_worker(rank: int, world_size: int, root: str) -> dict:
    mesh = _hsdp_mesh()
    out = {}
    for stage in range(4):
        path = f"{root}/stage{stage}"
        engine = make_engine(make_model(), stage=stage, mesh=mesh)
        engine_steps(engine, rank, world_size, 3)
        engine.save(path)
        engine_steps(engine, rank, world_size, 2, first_step=3)
        uninterrupted = engine.full_state_dict()
        resumed = make_engine(make_model(seed=1), stage=stage, mesh=mesh)
        resumed.load(path)
        engine_steps(resumed, rank, world_size, 2, first_step=3)
        again = resumed.full_state_dict()
        out[stage] = max((uninterrupted[n] - again[n]).abs().max().item() for n in again)
    # Non-blocking: every replica's handle returns from wait() once the step is committed.
    handle = engine.save(f"{root}/async", blocking=False)
    handle.wait()
    out["async_committed"] = open_checkpoint(f"{root}/async").steps() == [handle.step]
    engine.close()
    return out


@pytest.mark.slow
def test_hsdp_save_load_round_trip_equals_uninterrupted_training(tmp_path) -> None:
    results = run_distributed(_round_trip_worker, 4, str(tmp_path), timeout=300)
    for stage in range(4):
        worst = max(r[stage] for r in results)
        print(f"HSDP 2x2 stage {stage}: resumed vs uninterrupted max |diff| {worst:.2e}")
        assert worst == 0.0, (stage, worst)
        # One replica wrote: the step is a checkpoint of a dp_shard-sized world.
        assert open_checkpoint(str(tmp_path / f"stage{stage}")).step().world_size == HSDP[0][1]
    assert all(r["async_committed"] for r in results)


def _errors_worker(rank: int, world_size: int) -> dict:
    model = make_model()
    out = {}
    cases = {
        "tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")),
        "unknown": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp_shard")),
        "no_shard": init_device_mesh("cpu", (4,), mesh_dim_names=("dp_replicate",)),
        "not_a_mesh": "dp_shard",
    }
    for name, mesh in cases.items():
        try:
            zerostate.Engine(model, mesh=mesh)
        except ConfigError as exc:
            out[name] = str(exc)
    try:
        mesh = _hsdp_mesh()
        zerostate.Engine(model, mesh=mesh, group=mesh.get_group("dp_shard"))
    except ConfigError as exc:
        out["with_group"] = str(exc)
    return out


@pytest.mark.slow
def test_unsupported_meshes_fail_before_any_collective_naming_the_fix() -> None:
    r = run_distributed(_errors_worker, 4, timeout=120)[0]
    assert "'tp'" in r["tp"] and "parallelize_module" in r["tp"]
    assert "['dp']" in r["unknown"] and "dp_replicate" in r["unknown"]
    assert "no 'dp_shard'" in r["no_shard"] and "stage=0" in r["no_shard"]
    assert "not a torch DeviceMesh" in r["not_a_mesh"]
    assert "pass only mesh=" in r["with_group"]


def _dtensor_worker(rank: int, world_size: int) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = parallelize_module(torch.nn.Linear(8, 8), mesh, ColwiseParallel())
    try:
        zerostate.Engine(model)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_dtensor_parameters_are_refused_naming_the_parameter() -> None:
    message = run_distributed(_dtensor_worker, 1, timeout=60)[0]
    assert "2 parameter(s) (weight, bias) are DTensors" in message, message


def test_mesh_spanning_fewer_ranks_than_the_world_is_refused() -> None:
    from zerostate.runtime import process_groups as meshes

    class _Mesh:  # what plan_mesh reads of a DeviceMesh over 2 of 4 ranks
        mesh_dim_names = ("dp_shard",)
        ndim = 1
        device_type = "cpu"

        def size(self, dim: int | None = None) -> int:
            return 2

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(meshes.collectives, "is_device_mesh", lambda obj: True)
        patch.setattr(meshes.collectives, "group_info", lambda group: (0, 4))
        with pytest.raises(ConfigError, match="spans 2 ranks but the world has 4"):
            meshes.plan_mesh(_Mesh(), torch.device("cpu"))


def _close_worker(rank: int, port: int, results) -> None:
    """One rank of a plain ``init_process_group`` (rank 0 hosts the store, as under
    ``mp.spawn``) that trains a step on an HSDP engine, closes it and ends at once; the
    shard group without rank 0 reaches close() a second later."""
    import os
    import time

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4
        )
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        engine = zerostate.Engine(model, stage=3, mesh=_hsdp_mesh(), lr=1e-2)
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
        if rank in (2, 3):
            time.sleep(1.0)
        engine.close()
        results.put((rank, "closed"))
    except BaseException as exc:  # reported to the test, which names it
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    results.close()
    results.join_thread()
    os._exit(0)  # a script that ends right after close(): no teardown waits for anyone


@pytest.mark.slow
def test_closing_a_mesh_engine_keeps_the_store_until_every_rank_is_out() -> None:
    # [Note: the last arrival spans the mesh] in zerostate.engine.
    import multiprocessing

    port = free_port()  # [Note: free ports] in helpers_dist
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_close_worker, args=(r, port, results)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == {r: "closed" for r in range(4)}, got
