"""A refused load leaves the engine exactly as it was ([Note: planned load] in
zerostate.engine_state): weights, moments, step counts, group hyperparameters, and the
next steps, compared bit for bit with an engine that never tried the load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import CheckpointError

STAGE = 2
BATCH = 4  # per rank
TRIED_AT = 1  # steps before the load is tried
AFTER = 3  # steps compared after it


def _net(widths=(4, 4, 4), *, tie: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    model = nn.Sequential(*layers)
    if tie:
        model[-1].weight = model[0].weight
    return model


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    # Same class as the built-in AdamW, other members: layer by layer, not weights / biases.
    return torch.optim.AdamW([{"params": list(m.parameters()), "lr": 1e-2} for m in model], lr=1e-2)


#: Cause -> (the engine that saves, the engine that tries the load), as keyword arguments.
CAUSES = {
    "missing tensors": (dict(), dict(widths=(4, 4, 4, 4))),
    "a shape": (dict(), dict(widths=(4, 6, 4))),
    "optimizer class": (dict(opt="sgd"), dict()),
    "group membership": (dict(), dict(opt="groups")),
    "engine-state version": (dict(version=99), dict()),
    "tying": (dict(), dict(tie=True)),
}


def _engine(widths=(4, 4, 4), *, tie=False, opt=None, version=None) -> zerostate.Engine:
    model = _net(widths, tie=tie)
    optimizer = None
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif opt == "groups":
        optimizer = _two_groups(model)
    kwargs = dict(lr=1e-2, weight_decay=0.1) if optimizer is None else {}
    engine = zerostate.Engine(model, stage=STAGE, optimizer=optimizer, **kwargs)
    if version is not None:
        document = engine.engine_state
        engine.engine_state = lambda: {**document(), "version": version}
    return engine


def _train(engine: zerostate.Engine, rank: int, first: int, num: int) -> list[torch.Tensor]:
    losses = []
    width = next(engine.module.parameters()).shape[1]
    for step in range(first, first + num):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH * dist.get_world_size(), width, generator=g)
        x = x[rank * BATCH : (rank + 1) * BATCH]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def _snapshot(engine: zerostate.Engine) -> dict:
    """Everything a refused load must not change, as plain cloned values."""
    opt = engine.optimizer
    groups = []
    for g in opt.param_groups:
        states = []
        for p in g["params"]:
            state = opt.state.get(p, {})
            states.append(
                {k: v.clone() if torch.is_tensor(v) else v for k, v in sorted(state.items())}
            )
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append((hyper, [p.detach().clone() for p in g["params"]], states))
    working = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "groups": groups,
        "working": working,
        "optimizer_steps": engine.optimizer_steps,
        "loss_scale": engine.loss_scale,
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _refused(engine: zerostate.Engine, ckpt: str) -> str | None:
    """The resume idiom, recording the refusal: None when the load went through."""
    try:
        engine.load(ckpt)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _after_refusal(engine, reference, rank) -> dict:
    return {
        "losses": _same(
            _train(engine, rank, TRIED_AT, AFTER), _train(reference, rank, TRIED_AT, AFTER)
        ),
        "final": _same(engine.full_state_dict(), reference.full_state_dict()),
        "state": _same(_snapshot(engine), _snapshot(reference)),
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for i, (cause, (saved, tried)) in enumerate(CAUSES.items()):
        ckpt = os.path.join(root, f"cause-{i}")
        source = _engine(**saved)
        _train(source, rank, 0, 2)
        source.save(ckpt)
        engine, reference = _engine(**tried), _engine(**tried)
        _train(engine, rank, 0, TRIED_AT)
        _train(reference, rank, 0, TRIED_AT)
        before = _snapshot(engine)
        refusal = _refused(engine, ckpt)
        out[cause] = {
            "refusal": refusal,
            "unchanged": _same(before, _snapshot(engine)),
            **_after_refusal(engine, reference, rank),
        }
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_refused_load_leaves_the_engine_as_it_was(tmp_path, world_size) -> None:
    results = run_distributed(_worker, world_size, str(tmp_path), timeout=200)
    for rank, result in enumerate(results):
        for cause, r in result.items():
            assert r["refusal"] is not None, (rank, cause, "the load went through")
            assert r["unchanged"], (rank, cause, r["refusal"])
            assert r["losses"] and r["final"] and r["state"], (rank, cause, r)
    refusals = {cause: r["refusal"] for cause, r in results[0].items()}
    assert "lacks 6 tensor(s)" in refusals["missing tensors"]
    assert "another shape" in refusals["a shape"]
    assert "['SGD']" in refusals["optimizer class"]
    assert "param groups hold other parameters" in refusals["group membership"]
    assert refusals["engine-state version"].startswith("FormatVersionError")
    assert "ties" in refusals["tying"]


def _damaged_row_worker(rank: int, world_size: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    source = _engine()
    _train(source, rank, 0, 2)
    source.save(ckpt)
    dist.barrier()
    if rank == 0:
        rows = sorted(
            (p for p in Path(ckpt).rglob("*") if p.is_file() and not p.name.endswith(".json")),
            key=lambda p: p.stat().st_size,
        )
        data = bytearray(rows[-1].read_bytes())
        data[len(data) // 2] ^= 0x5A
        rows[-1].write_bytes(bytes(data))
    dist.barrier()
    engine = _engine()
    _train(engine, rank, 0, TRIED_AT)
    before = _snapshot(engine)
    refusal = _refused(engine, ckpt)
    after = _snapshot(engine)
    # The read landed (some) checkpoint values in the tensors; the rest must be as before.
    bookkeeping = (
        before["optimizer_steps"] == after["optimizer_steps"]
        and [g[0] for g in before["groups"]] == [g[0] for g in after["groups"]]
        and all(
            [sorted(s) for s in b[2]] == [sorted(s) for s in a[2]]
            and _same([s.get("step") for s in b[2]], [s.get("step") for s in a[2]])
            for b, a in zip(before["groups"], after["groups"], strict=True)
        )
    )
    _train(engine, rank, TRIED_AT, AFTER)  # raised KeyError: 'step' before the plan
    return {"refusal": refusal, "bookkeeping": bookkeeping, "steps": engine.optimizer_steps}


def test_a_damaged_row_leaves_a_usable_optimizer(tmp_path) -> None:
    results = run_distributed(_damaged_row_worker, 2, str(tmp_path), timeout=200)
    for r in results:
        assert r["refusal"] is not None and r["bookkeeping"], r
        assert r["steps"] == TRIED_AT + AFTER, r
