"""``engine.optimizer.state_dict()`` / ``load_state_dict`` with several optimizers (Muon
for matrices, AdamW for the rest): torch's layout over every inner optimizer's state, not
the empty state of the object that combines them."""

from __future__ import annotations

import copy

import pytest
import torch
from common import identical
from helpers_dist import run_distributed
from torch import nn

import zerostate

BATCH = 3  # per rank


def _engine(stage: int, muon_lr: float) -> zerostate.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 5)
    )
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    optimizers = [
        torch.optim.Muon(matrices, lr=muon_lr, momentum=0.9),
        torch.optim.AdamW([{"params": rest[:1], "lr": 1e-2}, {"params": rest[1:], "lr": 3e-3}]),
    ]
    engine = zerostate.Engine(model, stage=stage, optimizer=optimizers)
    engine.user_optimizers = optimizers  # the test's handle on the objects the user holds
    return engine


def _train(engine: zerostate.Engine, rank: int, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        x = torch.randn(BATCH, 7, generator=gen)
        engine.backward(engine(x).square().mean())
        engine.step()


def _inner_states(engine: zerostate.Engine) -> list[dict]:
    return [copy.deepcopy(opt.state_dict()) for opt in engine.optimizer.optimizers]


def _worker(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    saver = _engine(stage, muon_lr=0.02)
    _train(saver, rank, seed=1, steps=2)
    inner = _inner_states(saver)
    saved = copy.deepcopy(saver.optimizer.state_dict())
    # torch's layout: groups in order, parameters numbered across every inner optimizer.
    numbers = [i for g in saved["param_groups"] for i in g["params"]]
    stateful = sum(len(s["state"]) for s in inner)
    out = {
        "groups": len(saved["param_groups"]),
        "numbers_distinct": sorted(numbers) == list(range(len(numbers))),
        "state_entries": len(saved["state"]),
        "inner_state_entries": stateful,
        "muon_lr_saved": saved["param_groups"][0]["lr"],
    }
    # Every inner optimizer's state is in it, under the numbers of its groups' parameters.
    base, found = 0, True
    for s in inner:
        ids = [i for g in s["param_groups"] for i in g["params"]]
        for k, i in enumerate(ids):
            if i in s["state"]:
                found &= identical(s["state"][i], saved["state"].get(base + k))
        base += len(ids)
    out["inner_states_in_dict"] = found

    loader = _engine(stage, muon_lr=0.05)
    _train(loader, rank, seed=2, steps=3)  # other data, other state, other step counts
    before = _inner_states(loader)
    bad = copy.deepcopy(saved)
    bad["param_groups"][2]["params"] = bad["param_groups"][2]["params"][:0]
    try:
        loader.optimizer.load_state_dict(bad)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    out["unchanged_after_refusal"] = identical(before, _inner_states(loader))

    loader.optimizer.load_state_dict(copy.deepcopy(saved))
    out["loaded_equals_saved"] = identical(_inner_states(loader), inner)
    out["round_trip"] = identical(loader.optimizer.state_dict(), saved)
    out["muon_lr_loaded"] = loader.optimizer.param_groups[0]["lr"]
    # The loaded state steps: one more step from the same weights gives the same weights.
    twin = _engine(stage, muon_lr=0.02)
    _train(twin, rank, seed=1, steps=2)
    with twin.gathered():
        weights = {k: v.clone() for k, v in twin.module.state_dict().items()}
    with loader.gathered(writeback=True):
        loader.module.load_state_dict(weights)
    _train(twin, rank, seed=3, steps=1)
    _train(loader, rank, seed=3, steps=1)
    with twin.gathered(), loader.gathered():
        a, b = twin.module.state_dict(), loader.module.state_dict()
        out["next_step_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    # A load through the user's own optimizer object: the engine's optimizer (what a
    # scheduler may be built on) holds that optimizer's new groups.
    users = loader.user_optimizers
    users[1].load_state_dict(copy.deepcopy(users[1].state_dict()))
    live = [g for o in loader.optimizer.optimizers for g in o.param_groups]
    out["groups_live"] = len(live) == len(loader.optimizer.param_groups) and all(
        a is b for a, b in zip(loader.optimizer.param_groups, live, strict=True)
    )
    out["user_groups_live"] = users[1].param_groups[0] is live[1]
    for e in (saver, loader, twin):
        e.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_several_optimizers_give_and_take_their_state_in_torch_layout(stage):
    for r in run_distributed(_worker, 2, stage):
        assert r["groups"] == 3, r
        assert r["numbers_distinct"], r
        assert r["inner_state_entries"] > 0, r
        assert r["state_entries"] == r["inner_state_entries"], r
        assert r["inner_states_in_dict"], r
        assert r["refused"] and "group 2" in r["refused"], r
        assert r["unchanged_after_refusal"], r
        assert r["loaded_equals_saved"], r
        assert r["round_trip"], r
        assert r["muon_lr_saved"] == r["muon_lr_loaded"] == 0.02, r
        assert r["next_step_equal"], r
        assert r["groups_live"], r
        assert r["user_groups_live"], r
