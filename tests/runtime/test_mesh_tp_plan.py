"""``Engine(model, mesh=mesh, tp_plan=...)``: the engine applies torch's
``parallelize_module`` itself ([Note: tp plans] in zerostate.runtime.tp_plan).

``tp_plan="auto"`` (a transformers Llama's own ``base_model_tp_plan``) and a
``{pattern: style}`` plan mixing style names and torch ``ParallelStyle`` objects both train
as single-process SGD at (dp_shard 2 x tp 2), stages 1 and 3; plans that cannot apply fail
on every rank with a ConfigError naming the pattern or style, before any collective.
"""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from test_mesh_tp import SGD, STEPS, _llama, _local_batch, _loss, _reference, _worst
from torch.distributed.device_mesh import init_device_mesh

import zerostate
from zerostate.errors import ConfigError
from zerostate.runtime import tp_plan

pytest.importorskip("transformers")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_auto_plan_is_the_base_models_plan_under_its_path() -> None:
    plan = tp_plan.resolve(_llama(), "auto")
    assert sorted(plan) == sorted(
        f"model.layers.*.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for p in PROJECTIONS
    )
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    rowwise = {"model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"}
    for pattern, style in plan.items():
        assert isinstance(style, RowwiseParallel if pattern in rowwise else ColwiseParallel)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"model.layers.*.attn.q_proj": "colwise"}, "match no module"),
        ({"model.layers.9.mlp.up_proj": "colwise"}, "match no module"),
        ({"model.layers.*.mlp.up_proj": "columnwise"}, "'columnwise' is not a known style"),
        ({"model.layers.*.mlp.up_proj": 3}, "give a style name"),
        ("llama", "only plan given by name is 'auto'"),
        ({}, "non-empty"),
    ],
)
def test_plans_that_cannot_apply_are_refused_naming_the_fix(plan, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tp_plan.resolve(_llama(), plan)


def test_auto_needs_a_model_with_a_plan() -> None:
    with pytest.raises(ConfigError, match="holds none"):
        tp_plan.resolve(torch.nn.Sequential(torch.nn.Linear(4, 4)), "auto")


def _explicit_plan():
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = {f"model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"model.layers.*.mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")})
    plan["model.layers.*.self_attn.o_proj"] = "rowwise"
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()  # a torch style object
    return plan


def _plan_worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    ref, _ = _reference(torch.optim.SGD, SGD)
    out = {}
    for label, plan in (("auto", "auto"), ("explicit", _explicit_plan())):
        for stage in (1, 3):
            model = _llama()
            # The user's optimizer is built over the model before it is parallelized.
            opt = torch.optim.SGD(model.parameters(), **SGD)
            engine = zerostate.Engine(model, mesh=mesh, tp_plan=plan, stage=stage, optimizer=opt)
            out[(label, stage, "dtensors")] = sorted(
                n.rsplit(".", 2)[-2] for n, p in model.named_parameters() if hasattr(p, "to_local")
            )
            for step in range(STEPS):
                engine.backward(_loss(engine, _local_batch(step, mesh)))
                engine.step()
            out[(label, stage)] = _worst(engine.full_state_dict(), ref)
            engine.close()

    def attempt(name, model, **settings):
        try:
            zerostate.Engine(model, mesh=mesh, **settings)
            out[name] = "accepted"
        except ConfigError as exc:
            out[name] = str(exc)

    attempt("no_match", _llama(), tp_plan={"model.layers.*.attn.q_proj": "colwise"})
    attempt("unknown_style", _llama(), tp_plan={"model.layers.*.mlp.up_proj": "columnwise"})
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    try:
        zerostate.Engine(_llama(), mesh=flat, tp_plan="auto")
        out["no_tp"] = "accepted"
    except ConfigError as exc:
        out["no_tp"] = str(exc)
    model = _llama()
    tp_plan.apply(model, tp_plan.resolve(model, "auto"), mesh["tp"])
    attempt("twice", model, tp_plan="auto")
    return out


@pytest.mark.slow
def test_tp_plan_auto_and_explicit_train_as_single_process() -> None:
    results = run_distributed(_plan_worker, 4, timeout=900)
    for r in results:
        assert r == results[0]  # same state and the same errors on every rank
    r = results[0]
    for label in ("auto", "explicit"):
        for stage in (1, 3):
            print(f"tp_plan {label} stage {stage}: SGD error {r[(label, stage)]:.2e}")
            assert r[(label, stage)] <= 1e-5, (label, stage, r[(label, stage)])
            assert r[(label, stage, "dtensors")] == sorted(PROJECTIONS * 2)
    assert "['model.layers.*.attn.q_proj'] match no module" in r["no_match"], r
    assert "'columnwise' is not a known style" in r["unknown_style"], r
    assert "needs a mesh with a 'tp' dimension" in r["no_tp"], r
    assert "parallelized already" in r["twice"], r
