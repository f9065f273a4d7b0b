"""Ranks that initialise their models differently still train one model: the engine
broadcasts rank 0's initial parameters (sync_module_states, on by default)."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed

import zerostate
from zerostate.models.gpt2 import GPT2, GPT2Config

TINY = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)


def _worker(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(100 + rank)  # deliberately different on every rank
    model = GPT2(GPT2Config(**TINY))
    engine = zerostate.Engine(model, stage=stage)
    state = engine.full_state_dict()
    torch.manual_seed(100)
    rank0_init = GPT2(GPT2Config(**TINY)).state_dict()
    return {
        "max_diff_to_rank0_init": max((state[k] - rank0_init[k]).abs().max().item() for k in state),
        "checksum": float(sum(t.double().sum() for t in state.values())),
    }


@pytest.mark.slow
def test_initial_parameters_come_from_rank_0():
    for stage in (0, 2, 3):
        results = run_distributed(_worker, 2, stage)
        assert all(r["max_diff_to_rank0_init"] == 0.0 for r in results), (stage, results)
        assert results[0]["checksum"] == results[1]["checksum"]
