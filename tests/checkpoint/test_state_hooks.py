"""Checkpoint hooks: state_views / engine_state round-trip across stages and world sizes.

Save side (world size 2): every rank contributes ``local[owned - local_start]`` for every
view, exactly what the store writes; the test assembles full tensors from them. Load side
(world size 3): a fresh engine (different initial weights) fills each ``local`` in place
from ``[local_start, local_start + numel)`` of the full tensors, loads the engine state,
calls ``refresh_from_masters`` and must then train exactly like the original run.
"""

from __future__ import annotations

import pytest
import torch
from common import engine_steps, make_engine, make_model, rel
from helpers_dist import run_distributed

SOURCES = {"s2": dict(stage=2), "s3": dict(stage=3, bucket_mb=0.01)}
TARGETS = {
    "s0": dict(stage=0),
    "s1": dict(stage=1),
    "s3": dict(stage=3),
}
BEFORE, AFTER = 3, 4


def _save_worker(rank: int, world_size: int) -> dict:
    out = {}
    for key, settings in SOURCES.items():
        engine = make_engine(make_model(seed=0), **settings)
        engine_steps(engine, rank, world_size, BEFORE)
        pieces = {}
        for view in engine.state_views():
            lo, hi = view.layout.owned_range(rank)
            assert view.layout.numel == torch.Size(view.shape).numel()
            assert view.local_start <= lo and hi <= view.local_start + view.local.numel()
            pieces[view.name] = (
                view.shape,
                lo,
                view.local[lo - view.local_start : hi - view.local_start].clone(),
            )
        state = engine.engine_state()
        losses = engine_steps(engine, rank, world_size, AFTER, first_step=BEFORE)
        out[key] = (pieces, state, losses, engine.full_state_dict())
    return out


def _load_worker(rank: int, world_size: int, saved: dict) -> dict:
    out = {}
    for src, (full, state, ref_losses, ref_params) in saved.items():
        for dst, settings in TARGETS.items():
            engine = make_engine(make_model(seed=123), **settings)
            names = set()
            for view in engine.state_views():
                names.add(view.name)
                source = full[view.name].reshape(-1)
                view.local.copy_(source[view.local_start : view.local_start + view.local.numel()])
            engine.load_engine_state(state)
            engine.refresh_from_masters()
            losses = engine_steps(engine, rank, world_size, AFTER, first_step=BEFORE)
            params = engine.full_state_dict()
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            param_err = max(rel(params[n], ref_params[n]) for n in ref_params)
            out[(src, dst)] = (loss_err, param_err, names == set(full))
    return out


@pytest.mark.slow
def test_state_views_round_trip_across_stages_and_world_sizes() -> None:
    saved_per_rank = run_distributed(_save_worker, 2, timeout=200)
    saved = {}
    for key in SOURCES:
        full = {}
        for rank_out in saved_per_rank:
            pieces = rank_out[key][0]
            for name, (shape, lo, data) in pieces.items():
                flat = full.setdefault(name, torch.full((torch.Size(shape).numel(),), float("nan")))
                flat[lo : lo + data.numel()] = data
        for name, flat in full.items():
            assert not flat.isnan().any(), f"{key}: no rank saved part of {name}"
        _, state, losses, params = saved_per_rank[0][key]
        assert state["stage"] == SOURCES[key]["stage"] and state["world_size"] == 2
        assert state["tied"] == {"lm_head.weight": "transformer.wte.weight"}
        assert state["step"] == BEFORE
        saved[key] = (full, state, losses, params)
    results = run_distributed(_load_worker, 3, saved, timeout=200)
    for key, (loss_err, param_err, same_names) in sorted(results[0].items()):
        print(f"round trip {key}: loss {loss_err:.2e} param {param_err:.2e}")
        assert same_names, f"{key}: the two engines expose different views"
        assert loss_err < 1e-5 and param_err < 1e-5, key
