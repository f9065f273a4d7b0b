"""Small models whose ranks run different submodules in one step, and their data.

Every model takes ``(x, route)``: ``x`` a float batch, ``route`` an integer per sample
that picks what runs for that sample (an expert, a head, whether a block is skipped). The
test data give each rank's local batch its own routes, so ranks really run different
modules; the single-process reference sees the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM = 12
SAMPLES = 8  # global batch (divisible by 2 and 4)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing over one module per expert; only routed experts run."""

    def __init__(self, num_experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, num_experts)
        self.experts = nn.ModuleList([Expert() for _ in range(num_experts)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate = self.router(h).softmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows, e : e + 1])
        return x + out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, route)
        return self.out(h).square().mean()


class TwoHeads(nn.Module):
    """A shared trunk and two equal-shaped heads; each sample uses the head ``route``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.heads = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.trunk:
            h = torch.tanh(layer(h))
        total = x.new_zeros(())
        for k, head in enumerate(self.heads):
            rows = (route == k).nonzero().flatten()
            if rows.numel():
                total = total + head(h[rows]).square().sum()
        return total / x.shape[0]


class SkipBlock(nn.Module):
    """Three blocks; the middle one runs only when every sample's route is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(3)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        if bool((route == 0).all()):
            h = h + torch.tanh(self.blocks[1](h))
        return torch.tanh(self.blocks[2](h)).square().mean()


class TopExperts(nn.Module):
    """A list of experts at the top of the model (named so, and each its own unit at
    stage 3), and a dict of heads keyed by task; each sample picks one of each."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList([Expert() for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(DIM, 3), "b": nn.Linear(DIM, 3)})

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        total = x.new_zeros(())
        for k, key in enumerate(("a", "b")):
            rows = (route % 2 == k).nonzero().flatten()
            if rows.numel():
                total = total + self.heads[key](out[rows]).square().sum()
        return total / x.shape[0]


def data(step: int, model: str, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``; its routes differ between ranks' local slices."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(SAMPLES, DIM, generator=g)
    per_rank = SAMPLES // world_size
    rank_of = torch.arange(SAMPLES) // per_rank
    if model == "moe":
        route = (rank_of + step) % 2 * 2 + torch.arange(SAMPLES) % 2  # ranks: {0,1} / {2,3}
    elif model == "top_experts":  # rank 0 (and 2) uses experts {0, 1}, rank 1 (and 3) {2}
        route = torch.where(rank_of % 2 == 0, (torch.arange(SAMPLES) + step) % 2, 2)
    elif model == "heads":
        route = (rank_of + step) % 2
    else:  # skip: rank 1 (and 3) skip the middle block
        route = rank_of % 2
    return x, route


MODELS = {"moe": MoEModel, "heads": TwoHeads, "skip": SkipBlock, "top_experts": TopExperts}
