"""The user's optimizer in the engine: parameters without gradients, live param_groups,
the pre-clip norm, refused optimizers, and stateful objects in checkpoints (2 gloo ranks)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from common import rel
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate import jsonstate
from zerostate.errors import CheckpointError, ConfigError, CorruptCheckpointError

BATCH = 8


class Partial(nn.Module):
    """``unused`` never joins the forward; ``extra`` does only on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, with_extra: bool) -> torch.Tensor:
        y = self.used(x)
        if with_extra:
            y = y + self.extra
        return y.square().mean()


def _data(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(step))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _uses_extra(rank: int, stage: int) -> bool:
    # Stage 3 gathers parameters in forward/backward hooks, which needs the same module
    # graph on every rank; there only the unused module is exercised.
    return rank == 0 or stage == 3


def _reference(steps: int, world_size: int, stage: int):
    model = Partial()
    opt = _adamw(model)
    norms = []
    for step in range(steps):
        x = _data(step)
        b = BATCH // world_size
        opt.zero_grad()
        for r in range(world_size):
            (model(x[r * b : (r + 1) * b], _uses_extra(r, stage)) / world_size).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class Sampler:
    """A sampler-like object: a per-rank position and a generator state (a tensor)."""

    def __init__(self, rank: int) -> None:
        self.position = 0
        self.rank = rank
        self.gen = torch.Generator().manual_seed(rank)

    def state_dict(self) -> dict:
        return {"position": self.position, "rank": self.rank, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.rank = state["position"], state["rank"]
        self.gen.set_state(state["gen"])


def _refusals(model: nn.Module) -> dict[str, tuple]:
    class MyAdam(torch.optim.Adam):
        pass

    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8), True).backward()
    stepped.step()
    model.zero_grad()
    return {
        "lbfgs": (dict(optimizer=torch.optim.LBFGS(model.parameters())), "LBFGS"),
        "sparse": (dict(optimizer=torch.optim.SparseAdam(model.parameters())), "sparse"),
        "subclass": (dict(optimizer=MyAdam(model.parameters())), "not supported"),
        "foreign": (dict(optimizer=torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1)),
                    "not a parameter of the model"),
        "missing": (dict(optimizer=torch.optim.SGD(model.used.parameters(), lr=1)),
                    "in no optimizer group"),
        "lr_too": (dict(optimizer=_adamw(model), lr=0.5), "no effect with optimizer="),
        "stepped": (dict(optimizer=stepped), "already holds state"),
        "not_optimizer": (dict(optimizer="adamw"), "torch.optim.Optimizer"),
    }  # fmt: skip


def _worker(rank: int, world_size: int, ckpt: str) -> dict:
    out: dict = {}
    b = BATCH // world_size
    for stage in range(4):
        ref_params, ref_norms = _reference(4, world_size, stage)
        model = Partial()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = zerostate.Engine(model, stage=stage, min_shard_numel=4, optimizer=_adamw(model))
        norms = []
        for step in range(4):
            x = _data(step)[rank * b : (rank + 1) * b]
            engine.backward(engine(x, _uses_extra(rank, stage)))
            engine.step()
            norms.append(engine.last_grad_norm)
        params = engine.full_state_dict()
        out[("params", stage)] = max(rel(params[n], p) for n, p in ref_params.items())
        out[("unused_unchanged", stage)] = all(
            torch.equal(params[n], before[n]) for n in ("unused.weight", "unused.bias")
        )
        out[("extra_moved", stage)] = not torch.equal(params["extra"], before["extra"])
        out[("norms", stage)] = max(abs(a - r) / r for a, r in zip(norms, ref_norms, strict=True))

    # OneCycleLR cycles lr and AdamW's beta1 through the live param_groups.
    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=4)

    ref = Partial()
    ref_opt = _adamw(ref)
    ref_sched = one_cycle(ref_opt)
    model = Partial()
    engine = zerostate.Engine(model, stage=2, min_shard_numel=4, optimizer=_adamw(model))
    sched = one_cycle(engine.optimizer)
    for step in range(4):
        x = _data(step)
        ref_opt.zero_grad()
        for r in range(world_size):
            (ref(x[r * b : (r + 1) * b], True) / world_size).backward()
        ref_opt.step()
        ref_sched.step()
        engine.backward(engine(x[rank * b : (rank + 1) * b], True))
        engine.step()
        sched.step()
    params = engine.full_state_dict()
    out["one_cycle"] = max(rel(params[n], p) for n, p in ref.named_parameters())

    # param_groups are live: lr 0 freezes a group at the next step, restoring it resumes.
    model = Partial()
    groups = [{"params": model.used.parameters()}, {"params": [model.extra]}]
    opt = torch.optim.SGD(groups + [{"params": model.unused.parameters()}], lr=0.1)
    engine = zerostate.Engine(model, stage=2, min_shard_numel=4, optimizer=opt)
    moved = []
    for step, lr in enumerate([0.0, 0.1]):
        engine.optimizer.param_groups[0]["lr"] = lr
        start = engine.full_state_dict()
        engine.backward(engine(_data(step)[rank * b : (rank + 1) * b], True))
        engine.step()
        end = engine.full_state_dict()
        moved.append((not torch.equal(start["used.weight"], end["used.weight"]),
                      not torch.equal(start["extra"], end["extra"])))  # fmt: skip
    out["live_lr"] = moved

    for key in list(_refusals(Partial())):
        model = Partial()
        kwargs, message = _refusals(model)[key]
        try:
            zerostate.Engine(model, stage=2, **kwargs)
            out[("refused", key)] = None
        except ConfigError as exc:
            out[("refused", key)] = message in str(exc), str(exc)

    # Stateful objects: saved per rank, restored in place; client_state still works.
    model = Partial()
    engine = zerostate.Engine(model, stage=1, optimizer=_adamw(model))
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
    sampler = Sampler(rank)
    for step in range(3):
        engine.backward(engine(_data(step)[rank * b : (rank + 1) * b], True))
        engine.step()
        sched.step()
        sampler.position += 5
        torch.randn(3, generator=sampler.gen)
    engine.save(ckpt, stateful={"scheduler": sched, "sampler": sampler}, client_state={"k": 1})
    expect_gen = sampler.gen.get_state()
    model = Partial()
    engine2 = zerostate.Engine(model, stage=3, optimizer=_adamw(model))
    sched2 = torch.optim.lr_scheduler.LambdaLR(engine2.optimizer, lambda s: 1.0 / (1 + s))
    sampler2 = Sampler(rank + 10)
    client = engine2.load(ckpt, stateful={"scheduler": sched2, "sampler": sampler2})
    out["stateful"] = (
        client == {"k": 1},
        sched2.last_epoch == 3,
        engine2.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 4),
        (sampler2.position, sampler2.rank) == (15, rank),
        torch.equal(sampler2.gen.get_state(), expect_gen),
    )
    try:
        engine2.load(ckpt, stateful={"nothing": Sampler(0)})
        out["unknown_name"] = None
    except CheckpointError as exc:
        out["unknown_name"] = str(exc)

    # Another optimizer class, or other groups, than the run that saved: named, not loaded.
    mismatches = {}
    for key, make in {
        "class": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        "groups": lambda m: torch.optim.AdamW(
            [{"params": m.used.parameters()}, {"params": [m.extra, *m.unused.parameters()]}]
        ),
    }.items():
        model = Partial()
        other = zerostate.Engine(model, stage=2, optimizer=make(model))
        try:
            other.load(ckpt)
            mismatches[key] = None
        except CheckpointError as exc:
            mismatches[key] = str(exc)
    out["mismatches"] = mismatches

    # An engine state written before optimizer metadata existed (version 1: built-in AdamW,
    # moments for every trainable parameter) still loads.
    engine3 = zerostate.Engine(Partial(), stage=2, lr=0.05)
    legacy = {k: v for k, v in engine3.engine_state().items() if k != "optimizer"}
    legacy.update(version=1, step=7)
    engine3.load_engine_state(legacy)
    sp = engine3._trainable[0]
    out["legacy"] = (
        engine3.optimizer_steps,
        sorted(k for k, _ in engine3._optimizer.state_tensors(sp)),
        float(engine3.optimizer.state[sp.master]["step"]),
    )

    # At another world size: the scheduler (same on every rank) loads, the sampler cannot.
    sub = dist.new_group([0])
    if rank == 0:
        model = Partial()
        engine1 = zerostate.Engine(model, stage=2, optimizer=_adamw(model), group=sub)
        sched1 = torch.optim.lr_scheduler.LambdaLR(engine1.optimizer, lambda s: 1.0 / (1 + s))
        engine1.load(ckpt, stateful={"scheduler": sched1})
        out["other_world_sched"] = sched1.last_epoch
        try:
            engine1.load(ckpt, stateful={"sampler": Sampler(0)})
            out["other_world_sampler"] = None
        except CheckpointError as exc:
            out["other_world_sampler"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.slow
def test_user_optimizer_features(tmp_path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path / "ckpt"), timeout=400)
    r = results[0]
    for stage in range(4):
        print(f"stage {stage}: params {r[('params', stage)]:.2e} norm {r[('norms', stage)]:.2e}")
        assert r[("params", stage)] <= 1e-5  # matches torch, which skips grad-less params
        assert r[("unused_unchanged", stage)]  # no gradient on any rank: not stepped
        assert r[("extra_moved", stage)]  # a gradient on one rank only: stepped everywhere
        assert r[("norms", stage)] <= 1e-5  # pre-clip norm reported without clipping
    assert r["one_cycle"] <= 1e-5
    assert r["live_lr"] == [(False, True), (True, True)]
    for rank_result in results:
        for key in [k for k in rank_result if k[0] == "refused"]:
            verdict = rank_result[key]
            assert verdict is not None and verdict[0], (key, verdict)
    for rank_result in results:
        assert rank_result["stateful"] == (True,) * 5
        assert "no state for stateful['nothing']" in rank_result["unknown_name"]
    assert "trained with optimizer(s) ['AdamW']" in r["mismatches"]["class"]
    assert "param groups hold other parameters" in r["mismatches"]["groups"]
    assert r["legacy"] == (7, ["exp_avg", "exp_avg_sq"], 7.0)
    assert r["other_world_sched"] == 3
    assert "cannot be mapped onto 1 ranks" in r["other_world_sampler"]


def test_state_codec_round_trip_and_validation() -> None:
    value = {
        "betas": (0.9, 0.99),
        "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "b": torch.tensor(1.5, dtype=torch.bfloat16),
        3: [None, True, float("inf")],
        "__zs_tuple__": "a user key that looks like a marker",
    }
    back = jsonstate.decode(json.loads(json.dumps(jsonstate.encode(copy.deepcopy(value)))))
    assert back["betas"] == (0.9, 0.99) and back[3] == [None, True, float("inf")]
    assert back["__zs_tuple__"] == value["__zs_tuple__"]
    for k in ("t", "b"):
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k])
    with pytest.raises(ConfigError, match=r"stateful\['x'\].*function"):
        jsonstate.encode({"f": len}, "stateful['x']")
    bad = [
        {"__zs_tensor__": {"dtype": "object", "shape": [1], "data": ""}},
        {"__zs_tensor__": {"dtype": "float32", "shape": [2], "data": "AAAA"}},
        {"__zs_tensor__": {"dtype": "float32", "shape": [-1], "data": ""}},
        {"__zs_items__": [[[1], 2]]},
    ]
    for enc in bad:
        with pytest.raises(CorruptCheckpointError):
            jsonstate.decode(enc)
