"""Models whose ranks run different submodules in one step (mixture of experts with a
module per expert, heads picked per sample, a block skipped on some ranks).

Every stage must train them exactly like single-process AdamW on the whole batch, with no
setting: at stage 3 the units that run on some ranks only are found at run time
([Note: conditional units] in zerostate.runtime.schedule). Ranks must never compute with
each other's weights, and never wait for each other for good.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from conditional_models import MODELS, data
from helpers_dist import run_distributed

import zerostate

STEPS = 3
LR = 1e-2


def _data(step: int, name: str, world_size: int, alike_until: int = 0):
    x, route = data(step, name, world_size)
    if step < alike_until:
        route = torch.zeros_like(route)  # every rank runs the same modules
    return x, route


def _reference(name: str, world_size: int, alike_until: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    per = None
    for step in range(STEPS):
        x, route = _data(step, name, world_size, alike_until)
        per = x.shape[0] // world_size
        # The mean of the ranks' local losses: what data parallelism optimises.
        loss = (
            sum(
                model(x[r * per : (r + 1) * per], route[r * per : (r + 1) * per])
                for r in range(world_size)
            )
            / world_size
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(
    rank: int, world_size: int, name: str, stage: int, settings: dict, alike_until: int = 0
) -> dict:
    torch.manual_seed(0)
    model = MODELS[name]()
    engine = zerostate.Engine(model, stage=stage, lr=LR, weight_decay=0.0, **settings)
    for step in range(STEPS):
        x, route = _data(step, name, world_size, alike_until)
        per = x.shape[0] // world_size
        loss = engine(x[rank * per : (rank + 1) * per], route[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
    return engine.full_state_dict()


def _worker(rank: int, world_size: int, name: str, runs: list[tuple[int, dict]]) -> list:
    return [_train(rank, world_size, name, stage, settings) for stage, settings in runs]


def _check(results: list, ref: dict, what: str) -> None:
    for rank_results in results:
        for k, state in enumerate(rank_results):
            for n, p in ref.items():
                err = (state[n] - p).norm() / p.norm().clamp_min(1e-12)
                assert err < 1e-5, (what, k, n, float(err))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_module_per_expert_trains_exactly_at_every_stage(world_size: int) -> None:
    # Default settings: the experts' ModuleList sits inside a block, which is gathered whole.
    runs = [(stage, {}) for stage in range(4)]
    results = run_distributed(_worker, world_size, "moe", runs, timeout=300)
    _check(results, _reference("moe", world_size), "moe")


@pytest.mark.slow
def test_heads_and_skipped_blocks_train_exactly_with_a_leaf_policy() -> None:
    for name, leaf in (("heads", ["heads"]), ("skip", ["blocks"])):
        runs = [(stage, {}) for stage in range(3)] + [(3, {"leaf_modules": leaf})]
        results = run_distributed(_worker, 2, name, runs, timeout=300)
        _check(results, _reference(name, 2), name)


def _timed_worker(rank: int, world_size: int, name: str, alike_until: int) -> tuple:
    start = time.monotonic()
    state = _train(rank, world_size, name, 3, {}, alike_until)
    return time.monotonic() - start, state


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["heads", "skip", "top_experts"])
def test_units_that_run_on_some_ranks_only_train_exactly_with_no_setting(
    name: str, world_size: int
) -> None:
    # Ranks differ from the first forward on (the one that records the gather order).
    results = run_distributed(_timed_worker, world_size, name, 0, timeout=300)
    for seconds, _ in results:
        assert seconds < 120, (name, world_size, seconds)
    _check([[state] for _, state in results], _reference(name, world_size), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heads", "skip", "top_experts"])
def test_ranks_leaving_the_recorded_order_differently_train_exactly(name: str) -> None:
    # Every rank runs the same units in the first step (recorded, then prefetched in that
    # order); from the second step they differ, which the ranks learn from a gather's tags.
    # The heads are equal-shaped: without the tags their gathers would silently swap weights.
    results = run_distributed(_timed_worker, 2, name, 1, timeout=300)
    for seconds, _ in results:
        assert seconds < 120, (name, seconds)
    _check([[state] for _, state in results], _reference(name, 2, alike_until=1), name)


def _eval_skip_worker(rank: int, world_size: int) -> float:
    # Every rank leaves the recorded order alike (an evaluation forward without the middle
    # block): that is not a mismatch.
    torch.manual_seed(0)
    model = MODELS["skip"]()
    engine = zerostate.Engine(copy.deepcopy(model), stage=3, lr=LR)
    x, route = data(0, "skip", world_size)
    zero = torch.zeros(4, dtype=torch.long)
    engine.backward(engine(x[:4], zero))
    engine.step()
    with torch.no_grad():
        value = engine(x[:4], torch.ones(4, dtype=torch.long))
    return float(value)


@pytest.mark.slow
def test_every_rank_leaving_the_recorded_order_alike_is_allowed() -> None:
    values = run_distributed(_eval_skip_worker, 2, timeout=120)
    assert values[0] == values[1]


def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    cfg = SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, expert_capacity=64, encoder_sparse_step=1,
        decoder_sparse_step=1, dropout_rate=0.0, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return SwitchTransformersForConditionalGeneration(cfg)


def _switch_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 6), generator=g)


def _switch_worker(rank: int, world_size: int, stages: list[int]) -> list:
    out = []
    for stage in stages:
        engine = zerostate.Engine(_switch(), stage=stage, lr=1e-3, eps=1e-6, weight_decay=0.0)
        per = 4 // world_size
        for step in range(2):
            x, y = _switch_batch(step)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            engine.backward(engine(input_ids=x, labels=y).loss)
            engine.step()
        out.append(engine.full_state_dict())
    return out


@pytest.mark.slow
def test_switch_transformers_with_a_module_per_expert_trains_at_stage_3() -> None:
    # transformers' SwitchTransformers keeps one module per expert in a ModuleDict and runs
    # only the routed ones: at stage 3 its sparse MLP is gathered whole by default.
    model = _switch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    for step in range(2):
        x, y = _switch_batch(step)
        loss = (model(input_ids=x[:2], labels=y[:2]).loss
                + model(input_ids=x[2:], labels=y[2:]).loss) / 2  # fmt: skip
        opt.zero_grad()
        loss.backward()
        opt.step()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    for rank_states in run_distributed(_switch_worker, 2, [1, 3], timeout=300):
        for state in rank_states:
            for n, p in ref.items():
                err = float((state[n] - p).norm() / p.norm().clamp_min(1e-12))
                assert err < 1e-5, (n, err)
