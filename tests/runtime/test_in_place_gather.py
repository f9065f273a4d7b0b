"""On gloo, stages 1-2 gather large parameters straight into their full tensors after the
step ([Note: in-place gathers] in zerostate.dist.comm): the working parameters must equal
those of stage 0, which gathers nothing, in fp32 (masters aliasing the parameters) and in
bf16 (separate fp32 masters), with parameters on both sides of the size threshold."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.dist import comm

# A 1,800 x 1,800 weight (at most 3 ranks: >= 1,080,000 elements a rank) is gathered in
# place; the biases and the 7 x 1,800 weight are packed.
WIDTH = 1800


def _worker(rank: int, world_size: int) -> dict:
    assert -(-WIDTH * WIDTH // world_size) >= comm.IN_PLACE_MIN_PIECE > 7 * WIDTH
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in (0, 1, 2):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 7))
            engine = zerostate.Engine(model, stage=stage, lr=1e-2, precision=precision)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(4, WIDTH, generator=g)
                loss = engine(x.to(engine.dtype)).float().square().mean()
                engine.backward(loss)
                engine.step()
            out[(precision, stage)] = [p.detach().float().clone() for p in model.parameters()]
            out[(precision, stage, "comm")] = engine.comm_stats()["all_gather"]["elements"]
            engine.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_gathers_give_stage_0s_parameters(world_size: int) -> None:
    results = run_distributed(_worker, world_size, timeout=300)
    psi = WIDTH * WIDTH + WIDTH + 7 * WIDTH + 7
    for r in results:
        for precision in ("fp32", "bf16"):
            for stage in (1, 2):
                # Sums in another order (all-reduce against reduce-scatter) differ by
                # rounding, which Adam's normalisation can lift to ~1e-5 on one of millions
                # of elements; a range left stale would be off by the updates, ~1e-2 a step.
                tol = dict(rtol=1e-4, atol=1e-4) if precision == "fp32" else dict(rtol=0, atol=1e-3)
                for got, want in zip(r[(precision, stage)], r[(precision, 0)], strict=True):
                    torch.testing.assert_close(got, want, **tol)
                # One all-gather of Psi elements per step, padding of the packed ones aside.
                gathered = r[(precision, stage, "comm")]
                assert psi <= gathered <= psi + 3 * world_size, (precision, stage, gathered)
    for r in results[1:]:
        for key, value in r.items():
            if isinstance(value, list):
                for a, b in zip(value, results[0][key], strict=True):
                    assert torch.equal(a, b), key
