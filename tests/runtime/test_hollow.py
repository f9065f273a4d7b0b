"""Stage 3 never hands out hollow weights: ``model.state_dict()`` of a partitioned module
raises naming the calls that work, and after ``engine.close()`` the model holds its full
trained weights, which ``torch.save`` / ``save_pretrained`` write as usual
([Note: no hollow state dict] in zerostate.runtime.runtime)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from common import error_of
from helpers_dist import run_distributed

import zerostate


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def _train(engine, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        x = torch.randint(0, 80, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _worker(rank: int, world_size: int, out: str) -> dict:
    model = _gpt2()
    engine = zerostate.Engine(model, stage=3, lr=1e-2)
    _train(engine, rank)
    result = {
        "whole": error_of(model.state_dict),
        "block": error_of(model.transformer.h[0].state_dict),
    }
    full = engine.full_state_dict()
    with engine.gathered():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    result["inside_equal"] = all(torch.equal(inside[k], v) for k, v in full.items())
    engine.close()
    # The documented line: after close() the model is a plain module with its weights.
    if rank == 0:
        torch.save(model.state_dict(), f"{out}/model.pt")
        model.save_pretrained(f"{out}/hf")
    dist.barrier()
    result["train_after_close"] = error_of(lambda: engine(input_ids=torch.ones(1, 4).long()))
    result["full"] = full
    result["full_after_close"] = engine.full_state_dict()
    return result


@pytest.mark.slow
def test_stage3_state_dict_is_never_hollow_and_close_leaves_the_weights(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    results = run_distributed(_worker, 2, str(tmp_path), timeout=240)
    full = results[0]["full"]
    for r in results:
        for key in ("whole", "block"):
            assert r[key] is not None, f"{key}: state_dict() returned hollow tensors"
            assert "engine.full_state_dict()" in r[key] and "engine.gathered()" in r[key]
        assert r["inside_equal"]
        assert "close()" in r["train_after_close"]
        for k, v in full.items():
            assert torch.equal(r["full"][k], v) and torch.equal(r["full_after_close"][k], v), k
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    pretrained = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    for k, v in full.items():
        assert torch.equal(loaded[k], v), k
        assert torch.equal(pretrained[k], v), k
    assert torch.equal(loaded["lm_head.weight"], full["transformer.wte.weight"])  # tied


def _context_worker(rank: int, world_size: int, out: str) -> bool:
    model = _gpt2()
    with zerostate.Engine(copy.deepcopy(model), stage=3, lr=1e-2) as engine:
        _train(engine, rank, steps=1)
        full = engine.full_state_dict()
    state = engine.module.state_dict()  # __exit__ closed it: whole weights, any rank
    return all(torch.equal(state[k], v) for k, v in full.items())


@pytest.mark.slow
def test_stage3_context_manager_exit_leaves_the_weights(tmp_path: Path) -> None:
    assert run_distributed(_context_worker, 2, str(tmp_path), timeout=240) == [True, True]
