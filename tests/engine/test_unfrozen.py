"""A parameter frozen when the engine was built and unfrozen later (gradual unfreezing):
the engine does not train it, and it says so once instead of leaving the parameter at its
initial values in silence. The route that works, built trainable and frozen until it should
train, equals torch's AdamW over every parameter step for step ([Note: parameters unfrozen
later] in zerostate/engine.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from common import EPS, LR, batch, local, log_messages, make_engine, make_model, param_groups
from helpers_dist import run_distributed

STEPS, UNFREEZE_AT = 5, 2
#: Not tied, not a bias: a matrix in the middle of the model.
NAME = "transformer.h.0.mlp.c_fc.weight"


def _param(model, name=NAME):
    return dict(model.named_parameters())[name]


def _reference(model) -> dict[str, torch.Tensor]:
    """Single process, the whole batch, AdamW over every parameter; the watched one frozen
    until UNFREEZE_AT (torch skips a parameter without a gradient)."""
    model = copy.deepcopy(model)
    _param(model).requires_grad_(False)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, eps=EPS)
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            _param(model).requires_grad_(True)
        x, y = batch(step, 0)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, stage: int, built: str) -> dict:
    model = make_model(n_embd=24, n_head=3)  # odd widths: 24 -> 96 does not split evenly in 4
    # An extra frozen matrix no forward uses: made to require grad, it gets no gradient.
    model.spare = torch.nn.Linear(5, 7)
    model.spare.requires_grad_(False)
    initial = _param(model).detach().clone()
    if built == "frozen":
        _param(model).requires_grad_(False)
    engine = make_engine(model, stage=stage)
    if built == "trainable":  # the route the warning names
        _param(model).requires_grad_(False)
    said = []
    with log_messages("zerostate.engine") as messages:
        for step in range(STEPS):
            if step == UNFREEZE_AT:
                _param(model).requires_grad_(True)
                model.spare.weight.requires_grad_(True)
            x, y = batch(step, 0)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            engine.step()
            said.append([m for m in messages if "frozen (requires_grad=False)" in m])
            messages.clear()
    full = engine.full_state_dict()
    dist.barrier()
    return {
        "said": said,
        "moved": (full[NAME] - initial).abs().max().item(),
        "full": {n: t.clone() for n, t in full.items()},
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_frozen_at_construction_and_unfrozen_later_is_named(stage):
    results = run_distributed(_worker, 2, stage, "frozen")
    said = results[0]["said"]
    # Nothing before the unfreeze, one warning at the first step after it, then silence.
    assert said[:UNFREEZE_AT] == [[]] * UNFREEZE_AT
    assert len(said[UNFREEZE_AT]) == 1, said
    message = said[UNFREEZE_AT][0]
    assert NAME in message and "spare" not in message  # no gradient, no warning
    assert "requires_grad_(False)" in message  # names the route that works
    assert all(not s for s in said[UNFREEZE_AT + 1 :]), said
    assert results[1]["said"] == [[]] * STEPS  # rank 0 speaks for all
    assert results[0]["moved"] == 0.0  # what the warning says: it is not trained


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_built_trainable_and_frozen_until_needed_equals_torch(stage):
    results = run_distributed(_worker, 2, stage, "trainable")
    ref = _reference(make_model(n_embd=24, n_head=3))
    for r in results:
        assert r["said"] == [[]] * STEPS
        assert r["moved"] > 0.0
        for name, want in ref.items():
            torch.testing.assert_close(r["full"][name], want, rtol=1e-5, atol=1e-6, msg=name)
