"""fp32 parity: every stage at world sizes 1-4 against single-process torch.optim.AdamW."""

from __future__ import annotations

import functools

import pytest
from common import (
    CheckpointedGPT2,
    compare,
    engine_steps,
    make_engine,
    make_model,
    reference_run,
    single_threaded,
)
from helpers_dist import run_distributed

from zerostate.models.gpt2 import GPT2

STEPS = 20
TOL = 1e-5

# name -> (engine settings, reference settings, model class)
VARIANTS = {
    "default": ({}, {}, None),
    "clip": (dict(grad_clip=0.05), dict(grad_clip=0.05), None),
    "accum2": (dict(grad_accum_steps=2), dict(accum=2), None),
    "small_buckets": (dict(bucket_mb=0.01), {}, None),
    "ckpt_stage3_only": ({}, {}, CheckpointedGPT2),
    # Fine-grained stage-3 units: one per module that owns parameters (the default
    # gathers whole transformer blocks).
    "module_units_stage3_only": (
        dict(unit_policy=lambda name, m: len(m._parameters) > 0),
        {},
        GPT2,
    ),
}


@functools.cache
def _references() -> dict:
    """Each variant's single-process reference, computed once in the test process for every
    world size (the ranks used to compute it each, at every world size)."""
    with single_threaded():
        return {
            name: reference_run(make_model(cls=cls or GPT2), STEPS, **ref_settings)
            for name, (_, ref_settings, cls) in VARIANTS.items()
        }


def _parity_worker(rank: int, world_size: int, references: dict) -> dict:
    results = {}
    for name, (settings, _, cls) in VARIANTS.items():
        stages = [3] if name.endswith("stage3_only") else [0, 1, 2, 3]
        model_cls = cls or GPT2
        ref_losses, ref_params = references[name]
        for stage in stages:
            engine = make_engine(make_model(cls=model_cls), stage=stage, **settings)
            accum = settings.get("grad_accum_steps", 1)
            losses = engine_steps(engine, rank, world_size, STEPS, accum=accum)
            params = engine.full_state_dict()
            results[(name, stage)] = compare(losses, ref_losses, params, ref_params)
            if "grad_clip" in settings:
                # The last step's pre-clip norm: clipping must really have been active.
                results[("clip_norm", stage)] = engine.last_grad_norm
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_parity_with_torch_adamw(world_size: int) -> None:
    results = run_distributed(_parity_worker, world_size, _references(), timeout=300)
    for rank_results in results:
        assert rank_results == results[0]  # every rank reports the same gathered state
    bad = {}
    for stage in range(4):
        assert results[0][("clip_norm", stage)] > VARIANTS["clip"][0]["grad_clip"]
    for key, value in sorted(results[0].items()):
        if key[0] == "clip_norm":
            continue
        loss_err, param_err, worst = value
        print(f"ws={world_size} {key}: loss {loss_err:.2e} param {param_err:.2e} ({worst})")
        if loss_err > TOL or param_err > TOL:
            bad[key] = (loss_err, param_err, worst)
    assert not bad, f"parity beyond {TOL}: {bad}"
