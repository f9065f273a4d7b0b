"""A gradient penalty (WGAN-GP): ``torch.autograd.grad(D(x).sum(), x, create_graph=True)``
inside the loss. At stage 3 the penalty's graph holds partitioned parameters outside any
module's forward, and the loss's backward raised torch's "setStorage: ... out of bounds for
storage of size 0"; the units such a backward goes through now stay gathered until the
next backward ends ([Note: backward with create_graph] in zerostate.runtime.runtime). Every
stage equals torch's AdamW step for step, on a critic of linear units and on a transformers
GPT-2 critic over ``inputs_embeds``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers_dist import run_distributed
from torch import nn

import zerostate

STEPS, BATCH, LAMBDA = 3, 8, 10.0


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _BlockCritic(nn.Module):
    """Residual blocks in a ModuleList: the blocks activation checkpointing wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 11)
        self.blocks = nn.ModuleList(_Residual(11) for _ in range(3))
        self.out = nn.Linear(11, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _critic(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "blocks":
        return _BlockCritic()
    if kind == "mlp":  # each Linear is a stage-3 unit; odd widths
        return nn.Sequential(
            nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 1)
        )
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        vocab_size=16, n_positions=8, n_embd=12, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0
    )
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    cfg._attn_implementation = "eager"  # double backward through attention
    return _GPT2Critic(GPT2Model(cfg))


class _GPT2Critic(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(inputs_embeds=x.view(x.shape[0], 4, 12)).last_hidden_state
        return hidden.mean(dim=(1, 2))


def _width(kind: str) -> int:
    return 48 if kind == "gpt2" else 6


def _loss(critic, real, fake, alpha):
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + LAMBDA * penalty


def _data(step: int, micro: int, kind: str):
    gen = torch.Generator().manual_seed(100 * step + micro)
    width = _width(kind)
    return (
        torch.randn(BATCH, width, generator=gen),
        torch.randn(BATCH, width, generator=gen),
        torch.rand(BATCH, 1, generator=gen),
    )


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t[rank * BATCH // world : (rank + 1) * BATCH // world]


def _reference(kind: str, world: int, accum: int) -> dict[str, torch.Tensor]:
    """One process: the mean of every rank's and micro-batch's loss, torch's AdamW."""
    critic = _critic(kind)
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(accum):
            data = _data(step, micro, kind)
            for r in range(world):
                total = total + _loss(critic, *(_rows(t, r, world) for t in data))
        (total / (world * accum)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in critic.named_parameters()}


def _worker(
    rank: int, world: int, kind: str, stage: int, accum: int, checkpointing: str | None = None
) -> dict:
    critic = _critic(kind)
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    engine = zerostate.Engine(
        critic,
        stage=stage,
        optimizer=opt,
        grad_accum_steps=accum,
        activation_checkpointing=checkpointing,
    )
    for step in range(STEPS):
        for micro in range(accum):
            data = _data(step, micro, kind)
            engine.backward(_loss(engine, *(_rows(t, rank, world) for t in data)))
            engine.step()
    full = engine.full_state_dict()
    out = {n: t.clone() for n, t in full.items()}
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "kind,stage,accum",
    [("mlp", 0, 1), ("mlp", 2, 1), ("mlp", 3, 1), ("mlp", 3, 2), ("gpt2", 3, 1)],
)
def test_a_gradient_penalty_trains_as_torch_at_every_stage(kind, stage, accum):
    want = _reference(kind, 2, accum)
    got = run_distributed(_worker, 2, kind, stage, accum)[0]
    # The reference backpropagates both ranks' losses through one graph; a data-parallel
    # job backpropagates each rank's and sums the gradients, which rounds differently. On
    # the GPT-2 critic torch's own data-parallel recipe lands 1.9e-6 from the reference
    # after 3 steps on an AVX-512 machine, so that case is held to the reference at 1e-5
    # and to the data-parallel recipe at 1e-7 (zerostate equals it bit for bit there).
    atol = 1e-5 if kind == "gpt2" else 1e-6
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=atol, msg=name)
    if kind == "gpt2":
        ddp = run_distributed(_data_parallel, 2, kind, accum)[0]
        for name, value in ddp.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-7, msg=name)


def _data_parallel(rank: int, world: int, kind: str, accum: int) -> dict:
    """torch's data-parallel recipe by hand: each rank's loss backpropagated, the gradients
    averaged by all-reduce, torch's AdamW."""
    critic = _critic(kind)
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            data = _data(step, micro, kind)
            (_loss(critic, *(_rows(t, rank, world) for t in data)) / accum).backward()
        for p in critic.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    return {n: p.detach().clone() for n, p in critic.named_parameters()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_gradient_penalty_through_checkpointed_blocks_trains_as_torch(stage):
    """[Note: checkpoints under create_graph] in zerostate.runtime.activation: the second-order
    terms through checkpointed blocks were dropped (0.059 away after 3 steps)."""
    want = _reference("blocks", 2, 1)
    got = run_distributed(_worker, 2, "blocks", stage, 1, "full")[0]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _sliced(rank: int, world: int) -> str | None:
    try:
        _worker(rank, world, "blocks", 2, 1, "partitioned_cpu")
    except zerostate.ConfigError as exc:
        return str(exc)
    return None


def test_a_gradient_penalty_through_sliced_checkpoints_is_refused_naming_full():
    for error in run_distributed(_sliced, 2):
        assert error is not None and "activation_checkpointing='full'" in error, error
