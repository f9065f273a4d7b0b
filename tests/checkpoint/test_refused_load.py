"""A refused load leaves the engine exactly as it was ([Note: planned load] in
zerostate.checkpoint.load_plan): weights, moments, step counts, group hyperparameters, and the
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


def _engine(
    widths=(4, 4, 4), *, tie=False, opt=None, version=None, stage=STAGE
) -> zerostate.Engine:
    model = _net(widths, tie=tie)
    optimizer = None
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif opt == "groups":
        optimizer = _two_groups(model)
    kwargs = dict(lr=1e-2, weight_decay=0.1) if optimizer is None else {}
    engine = zerostate.Engine(model, stage=stage, optimizer=optimizer, **kwargs)
    if version is not None:
        # What a save records comes from the engine's parts ([Note: engine parts]).
        document = engine.parts.engine_state
        engine.parts.engine_state = lambda: {**document(), "version": version}
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
    if engine.stage == 3:  # the module's parameters are partitioned: gather them (collective)
        working = engine.full_state_dict()
    else:
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


def _damage(ckpt: str, group: str, how: str) -> None:
    """Damage rank 0's row of ``group`` in the middle (``flip``) or remove it (``delete``)."""
    (step,) = Path(ckpt).glob("step-*")
    row = step.joinpath(*group.split("/"), "c", "0", "0")
    if how == "delete":
        row.unlink()
        return
    data = bytearray(row.read_bytes())
    data[len(data) // 2] ^= 0x5A
    row.write_bytes(bytes(data))


def _damaged_row_worker(rank: int, world_size: int, root: str, stage: int) -> dict:
    out = {}
    # Rows of many inner chunks: the damage is met after others were read on this rank too.
    widths = (48, 200, 48)
    # (group, damage, steps the engine took before the load): 0 is a resumed run, whose
    # moments are still the zeros the engine created and are read in place.
    cases = [
        ("model", "flip", TRIED_AT),
        ("optim/exp_avg_sq", "flip", TRIED_AT),
        ("model", "delete", TRIED_AT),
        ("model", "flip", 0),
        ("optim/exp_avg_sq", "flip", 0),
    ]
    for i, (group, how, before_steps) in enumerate(cases):
        ckpt = os.path.join(root, f"case-{i}")
        source = _engine(widths, stage=stage)
        _train(source, rank, 0, 2)
        source.save(ckpt)
        dist.barrier()
        if rank == 0:
            _damage(ckpt, group, how)
        dist.barrier()
        engine, reference = _engine(widths, stage=stage), _engine(widths, stage=stage)
        _train(engine, rank, 0, before_steps)
        _train(reference, rank, 0, before_steps)
        before = _snapshot(engine)
        refusal = _refused(engine, ckpt)
        out[f"{how} {group} after {before_steps} step(s)"] = {
            "refusal": refusal,
            "unchanged": _same(before, _snapshot(engine)),
            **_after_refusal(engine, reference, rank),
        }
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_load_that_fails_while_reading_leaves_the_engine_as_it_was(tmp_path, stage) -> None:
    # A damaged or missing row is found only by reading it, after other ranges (and other
    # ranks' parts) have been read: none of them may have landed in the engine.
    results = run_distributed(_damaged_row_worker, 2, str(tmp_path), stage, timeout=200)
    for rank, result in enumerate(results):
        for case, r in result.items():
            assert r["refusal"] is not None, (rank, case, "the load went through")
            assert r["unchanged"], (rank, case, r["refusal"])
            assert r["losses"] and r["final"] and r["state"], (rank, case, r)
    case = f"flip model after {TRIED_AT} step(s)"
    assert "fails its checksum" in results[0][case]["refusal"]
    # Rank 1 reads rank 0's row too where it reads whole parameters (stages 1-2).
    other = results[1][case]["refusal"]
    assert "failed on rank(s) [0]" in other or "fails its checksum" in other, other
    if stage == 3:  # rank 1 read only its own part, which was sound
        assert other.endswith("nothing was loaded: this engine is as it was"), other


def test_staged_reads_land_in_strided_tensors() -> None:
    # [Note: nothing lands before every rank has read]: what the reader staged is copied
    # into the engine's tensor itself, whatever its strides (reshape(-1) of a transposed
    # tensor is a copy, and a copy into it would land nowhere).
    from zerostate.checkpoint.load import _land

    base = torch.zeros(3, 4)
    data = torch.arange(12, dtype=torch.float32)
    _land([(base.T, data)])
    assert torch.equal(base.T, data.reshape(4, 3))


def _moments(engine: zerostate.Engine) -> list[torch.Tensor]:
    opt = engine.optimizer
    return [
        opt.state[p][k]
        for g in opt.param_groups
        for p in g["params"]
        for k in ("exp_avg", "exp_avg_sq")
    ]


def _known_zero_worker(rank: int, world_size: int, root: str, stage: int) -> dict:
    # [Note: known zero moments] in zerostate.optim: the moments the engine made are read
    # in place until something writes them; an in-place edit through torch makes them
    # ordinary tensors again, which a failed load must then leave as they are.
    widths = (48, 200, 48)
    sound, damaged = os.path.join(root, "sound"), os.path.join(root, "damaged")
    source = _engine(widths, stage=stage)
    _train(source, rank, 0, 2)
    source.save(sound)
    source.save(damaged)
    dist.barrier()
    if rank == 0:
        _damage(damaged, "model", "flip")
    dist.barrier()
    saved = _snapshot(source)["groups"]
    out = {}

    engine = _engine(widths, stage=stage)
    made = _moments(engine)
    out["failed load refused"] = _refused(engine, damaged) is not None
    out["zeroed again"] = all(not t.any() for t in _moments(engine))
    engine.load(sound)
    out["resume after a failed load reads in place"] = all(
        a is b for a, b in zip(made, _moments(engine), strict=True)
    )
    out["resume loads the checkpoint"] = _same(_snapshot(engine)["groups"], saved)
    engine.load(sound)  # they hold the checkpoint now: a second load reads into new ones
    out["second load reads into new tensors"] = not any(
        a is b for a, b in zip(made, _moments(engine), strict=True)
    )
    out["second load loads the checkpoint"] = _same(_snapshot(engine)["groups"], saved)

    edited = _engine(widths, stage=stage)
    with torch.no_grad():
        for t in _moments(edited):
            t.add_(0.5)  # through torch: bumps the tensor's version
    before = _snapshot(edited)
    out["edited: failed load refused"] = _refused(edited, damaged) is not None
    out["edited: moments kept"] = _same(before, _snapshot(edited))

    stepped = _engine(widths, stage=stage)
    _train(stepped, rank, 0, 1)
    old = _moments(stepped)
    stepped.load(sound)
    out["stepped: loads into new tensors"] = not any(
        a is b for a, b in zip(old, _moments(stepped), strict=True)
    )
    out["stepped: loads the checkpoint"] = _same(_snapshot(stepped)["groups"], saved)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_moments_the_engine_made_are_read_in_place_until_written(tmp_path, stage) -> None:
    results = run_distributed(_known_zero_worker, 2, str(tmp_path), stage, timeout=200)
    for rank, result in enumerate(results):
        for what, ok in result.items():
            assert ok, (rank, what, result)


def test_every_state_tensor_the_engine_makes_at_construction_is_zero() -> None:
    # [Note: known zero moments]: the engine registers the per-element state it creates as
    # zero, so a failed load zeroes it again; a state created otherwise would be lost.
    from zerostate.optim import supported as optim

    shard = torch.empty(7)
    options = [{}, {"amsgrad": True}, {"momentum": 0.9, "centered": True}]
    made = {cls: init for cls, init in optim._INITIAL_STATE.items() if init is not None}
    checked = set()
    for cls, init in made.items():
        for group in options:
            for key, value in init(group, shard).items():
                if torch.is_tensor(value) and value.shape == shard.shape:
                    assert value.view(torch.uint8).eq(0).all(), (cls.__name__, key)
                    checked.add(cls)
    assert checked == set(made) and len(made) >= 7, sorted(c.__name__ for c in made)
