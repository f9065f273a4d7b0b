"""Gradients that reach an engine's parameters from a backward it did not start: a DDP
script's ``loss.backward()``, and a GAN's generator loss through the discriminator's engine
(the recipe of PyTorch's DCGAN example). Each is refused inside that backward, on every
rank, with the fix named, and leaves nothing behind in the engine; the DCGAN recipe with
the discriminator frozen around the generator's backward equals torch step for step
([Note: gradients from another backward] in zerostate/engine.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_dist import run_distributed

import zerostate
from zerostate.engine import EngineUsageError

ITERS, BATCH, LR = 4, 8, 1e-2


def _gan():
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7))
    d = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 1))
    return g, d


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(BATCH, 7, generator=gen), torch.randn(BATCH, 5, generator=gen)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _torch_dcgan() -> dict[str, torch.Tensor]:
    """PyTorch's DCGAN loop, one process, the whole batch; the discriminator frozen in the
    generator's step (the same updates as its zero_grad() recipe)."""
    g, d = _gan()
    opt_g = torch.optim.AdamW(g.parameters(), lr=LR, weight_decay=0.0)
    opt_d = torch.optim.AdamW(d.parameters(), lr=LR, weight_decay=0.0)
    for i in range(ITERS):
        real, z = _data(i)
        opt_d.zero_grad()
        (_bce(d(real), 1.0) + _bce(d(g(z).detach()), 0.0)).backward()
        opt_d.step()
        opt_g.zero_grad()
        d.requires_grad_(False)
        _bce(d(g(z)), 1.0).backward()
        d.requires_grad_(True)
        opt_g.step()
    return {f"g.{n}": p.detach() for n, p in g.named_parameters()} | {
        f"d.{n}": p.detach() for n, p in d.named_parameters()
    }


def _gan_worker(rank: int, world_size: int, stage: int, freeze: bool) -> dict:
    g, d = _gan()
    eg = zerostate.Engine(g, stage=stage, lr=LR)
    ed = zerostate.Engine(d, stage=stage, lr=LR)
    per = BATCH // world_size
    part = slice(rank * per, (rank + 1) * per)
    error = None
    for i in range(ITERS):
        real, z = _data(i)
        fake = eg(z[part]).detach()
        ed.backward(_bce(ed(real[part]), 1.0) + _bce(ed(fake), 0.0))
        ed.step()
        if freeze:
            d.requires_grad_(False)
        try:
            eg.backward(_bce(ed(eg(z[part])), 1.0))
        except EngineUsageError as exc:
            error = str(exc)
            break
        finally:
            d.requires_grad_(True)
        eg.step()
    out = {"error": error, "iteration": i}
    if error is None:
        out["state"] = {f"g.{n}": t for n, t in eg.full_state_dict().items()} | {
            f"d.{n}": t for n, t in ed.full_state_dict().items()
        }
    eg.close()
    ed.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_generator_loss_through_the_discriminator_engine_is_refused_with_the_fix(stage):
    for result in run_distributed(_gan_worker, 2, stage, False):
        assert result["iteration"] == 0  # the first generator step, not a later one
        error = result["error"]
        assert error is not None and "arrived outside this engine's backward()" in error
        assert error.split()[3] in {"0.weight", "0.bias", "2.weight", "2.bias"}  # D's
        assert "engine.backward(loss)" in error and "requires_grad_(False)" in error


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_discriminator_frozen_in_the_generator_step_equals_torch(stage):
    want = _torch_dcgan()
    for result in run_distributed(_gan_worker, 2, stage, True):
        assert result["error"] is None
        for name, ref in want.items():
            torch.testing.assert_close(result["state"][name], ref, rtol=1e-5, atol=1e-6)


def _habit_worker(rank: int, world_size: int, stage: int) -> dict:
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.GELU(), torch.nn.Linear(17, 3))
        return model, zerostate.Engine(model, stage=stage, lr=LR)

    model, engine = build()
    _, twin = build()  # never makes the mistake
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(rank))
    refused = None
    try:
        engine(x).square().mean().backward()  # the DDP habit
    except EngineUsageError as exc:
        refused = str(exc)
    losses = {"engine": [], "twin": []}
    for _ in range(3):
        for key, e in (("engine", engine), ("twin", twin)):
            loss = e(x).square().mean()
            e.backward(loss)
            e.step()
            losses[key].append(loss.item())
    state = engine.full_state_dict()
    twin_state = twin.full_state_dict()
    equal = all(torch.equal(state[n], twin_state[n]) for n in twin_state)
    engine.close()
    twin.close()
    return {"refused": refused, "losses": losses, "equal": equal}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_instead_of_engine_backward_is_refused_and_leaves_nothing(stage):
    for result in run_distributed(_habit_worker, 2, stage):
        assert result["refused"] is not None
        assert "loss.backward() instead of engine.backward(loss)" in result["refused"]
        # Nothing of the refused backward reaches the next steps.
        assert result["losses"]["engine"] == result["losses"]["twin"]
        assert result["equal"]
