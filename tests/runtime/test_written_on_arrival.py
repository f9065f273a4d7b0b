"""Stages 0 and 1 never zero their gradient buffer between steps ([Note: written on
arrival] in zerostate.runtime.group): a parameter's first gradient of a window overwrites
its place, and a parameter without one must count as zeros, not as last step's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from zerostate.layout.partition import even_layout
from zerostate.runtime.sharded import FlatLayout, ShardedParam


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if use_b:
            x = self.b(x)
        return x.square().mean()


def _reference_norm(model: _TwoLayers, x: torch.Tensor, use_b: bool) -> float:
    model.zero_grad(set_to_none=True)
    model(x, use_b).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(sum(g.double().square().sum() for g in grads)))


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("bucket_mb", [25.0, 1e-4])  # one bucket; a bucket per parameter
def test_a_parameter_without_a_gradient_counts_as_zeros(stage: int, bucket_mb: float) -> None:
    model, reference = _TwoLayers(), _TwoLayers()
    engine = zerostate.Engine(model, stage=stage, lr=0.0, weight_decay=0.0, bucket_mb=bucket_mb)
    try:
        for step, use_b in enumerate([True, False, True, False]):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x, use_b))
            engine.step()
            expected = _reference_norm(reference, x, use_b)
            assert engine.last_grad_norm == pytest.approx(expected, rel=1e-5), step
            # After the step no gradient is held in .grad, as after torch's zero_grad().
            assert all(p.grad is None for p in model.parameters())
    finally:
        engine.close()


@pytest.mark.usefixtures("world_of_one")
def test_accumulated_gradient_is_the_sum_over_the_window_at_stage_0() -> None:
    model, reference = _TwoLayers(), _TwoLayers()
    engine = zerostate.Engine(model, stage=0, lr=0.0, weight_decay=0.0, grad_accum_steps=2)
    try:
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(2)]
        reference.zero_grad(set_to_none=True)
        for x, use_b in zip(xs, [False, True], strict=True):
            engine.backward(engine(x, use_b))
            (reference(x, use_b) / 2).backward()
            if not use_b:  # between micro-steps .grad is the window's sum so far
                assert model.b.weight.grad is None
                assert torch.equal(model.a.weight.grad, reference.a.weight.grad * 2)
        engine.step()
        expected = torch.sqrt(sum(p.grad.double().square().sum() for p in reference.parameters()))
        assert engine.last_grad_norm == pytest.approx(float(expected), rel=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("world_size", [1, 3])
def test_copying_a_parameter_into_its_block_overwrites_and_keeps_the_padding(
    world_size: int,
) -> None:
    numels = [17, 5, 2]
    for rank in range(world_size):
        params = [
            ShardedParam(f"p{i}", nn.Parameter(torch.zeros(n)), even_layout(n, world_size),
                         rank, False)
            for i, n in enumerate(numels)
        ]  # fmt: skip
        layout = FlatLayout(params, world_size, rank)
        buffer = torch.zeros(layout.numel)
        sources = [torch.arange(1.0, n + 1) for n in numels]
        packed = torch.zeros(layout.numel)
        layout.pack(packed, sources)
        buffer.fill_(7.0)  # stale values everywhere, then the padding zeroed as at creation
        for i in range(len(numels)):
            layout.zero_param(buffer, i)
        assert torch.equal(buffer, torch.zeros(layout.numel))
        for i, source in enumerate(sources):
            layout.add_param(buffer, i, source * 5, accumulate=False)  # stale: overwritten
            layout.add_param(buffer, i, source * 5, accumulate=False)
            layout.add_param(buffer, i, -4 * source)
        assert torch.equal(buffer, packed)
