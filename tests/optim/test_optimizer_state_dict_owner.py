"""The DDP habit of saving ``optimizer.state_dict()`` on rank 0 and loading that file on
every rank: at stages 1-3 each rank's dict is its own shards, so another rank's is refused
before anything changes ([Note: whose optimizer state dict] in zerostate.optim); at stage 0
every rank's state is the same and the habit works, a plain torch optimizer's dict too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from common import identical
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import ConfigError

BATCH = 3  # per rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))


def _engine(stage: int) -> tuple[zerostate.Engine, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return zerostate.Engine(model, stage=stage, optimizer=opt), opt


def _train(engine: zerostate.Engine, rank: int, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        engine.backward(engine(torch.randn(BATCH, 7, generator=gen)).square().mean())
        engine.step()


def _state(opt: torch.optim.Optimizer) -> dict:
    sd = opt.state_dict()
    return copy.deepcopy({"state": sd["state"], "param_groups": sd["param_groups"]})


def _try_load(opt: torch.optim.Optimizer, sd: dict) -> str | None:
    """None when loaded, else the refusal; a refusal must leave the state as it was."""
    before = _state(opt)
    try:
        opt.load_state_dict(copy.deepcopy(sd))
    except ConfigError as exc:
        assert identical(before, _state(opt)), "a refused load changed the optimizer state"
        return str(exc)
    return None


def _worker(rank: int, world: int, stage: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    saver, saver_opt = _engine(stage)
    _train(saver, rank, seed=1, steps=2)
    torch.save(saver_opt.state_dict(), f"{tmp}/opt{rank}.pt")
    dist.barrier()
    out = {}
    loader, opt = _engine(stage)
    _train(loader, rank, seed=2, steps=1)
    # The habit: every rank loads rank 0's file.
    out["rank0_file"] = _try_load(opt, torch.load(f"{tmp}/opt0.pt", weights_only=True))
    out["rank0_file_equal"] = identical(_state(opt), _state(saver_opt))
    # Each rank its own file.
    out["own_file"] = _try_load(opt, torch.load(f"{tmp}/opt{rank}.pt", weights_only=True))
    out["own_file_equal"] = identical(_state(opt), _state(saver_opt))
    # A plain torch AdamW's dict over the same model.
    model = _model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(BATCH, 7)).square().mean().backward()
    plain.step()
    out["plain"] = _try_load(opt, plain.state_dict())
    if out["plain"] is None:  # taken: the same moments, flattened as the masters are
        mine, theirs = opt.state_dict()["state"], plain.state_dict()["state"]
        out["plain_equal"] = mine.keys() == theirs.keys() and all(
            torch.equal(mine[i][k].reshape(-1), theirs[i][k].reshape(-1))
            for i in mine
            for k in ("exp_avg", "exp_avg_sq", "step")
        )
    # A dict of an engine at the other kind of stage (replicated vs partitioned).
    other, other_opt = _engine(0 if stage else 2)
    _train(other, rank, seed=3, steps=1)
    out["other_stage"] = _try_load(opt, other_opt.state_dict())
    for e in (saver, loader, other):
        e.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_another_ranks_optimizer_state_dict_is_refused_at_stages_1_to_3(stage, tmp_path):
    results = run_distributed(_worker, 2, stage, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["own_file"] is None and r["own_file_equal"], r
        if rank == 0:
            assert r["rank0_file"] is None and r["rank0_file_equal"], r
        else:
            assert "rank 0 of 2's optimizer state; this is rank 1 of 2" in r["rank0_file"], r
            assert "engine.load(root)" in r["rank0_file"], r
        assert "this rank's is" in r["plain"], r  # full-size moments against this shard
        assert "every rank's (replicated) optimizer state" in r["other_stage"], r


def test_at_stage_0_every_rank_may_load_rank_0s_dict_and_a_plain_torch_one(tmp_path):
    results = run_distributed(_worker, 2, 0, str(tmp_path))
    for r in results:
        assert r["rank0_file"] is None and r["own_file"] is None, r
        assert r["rank0_file_equal"] and r["own_file_equal"], r  # replicated state
        assert r["plain"] is None and r["plain_equal"], r
        assert "covers elements" in r["other_stage"], r  # a stage-2 rank's shards
