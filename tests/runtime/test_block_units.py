"""Stage 3 takes a model's blocks as units whatever container keeps them ([Note: module
units] in zerostate.runtime.grouping): a list (Hugging Face), a dict keyed by layer
(torchtitan), containers inside containers. While a block computes, the gathered
parameters are at most that block, the one prefetched and the root group, and training
equals torch's AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.runtime.grouping import select_units

DIM, VOCAB = 24, 40


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        return h + self.down(F.gelu(self.up(h)))


class ListModel(nn.Module):
    """Blocks in a ModuleList (Hugging Face's layout)."""

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(num_blocks)])
        self.head = nn.Linear(DIM, VOCAB)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks():
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.roll(1, 1).flatten())


class DictModel(ListModel):
    """Blocks in a ModuleDict keyed by layer id, with a non-persistent buffer beside them
    (torchtitan's layout: ``layers`` and its RoPE cache)."""

    def __init__(self, num_blocks: int = 5) -> None:
        super().__init__(0)
        del self.layers
        self.layers = nn.ModuleDict({str(i): Block(hidden=3 * DIM - i) for i in range(num_blocks)})
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks():
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.roll(1, 1).flatten())


class NestedModel(ListModel):
    """A dict of lists (an encoder stack and a decoder stack), odd block sizes."""

    def __init__(self) -> None:
        super().__init__(0)
        del self.layers
        self.stacks = nn.ModuleDict(
            {
                "encoder": nn.ModuleList([Block(hidden=17), Block(hidden=31)]),
                "decoder": nn.ModuleList([Block(hidden=29) for _ in range(3)]),
            }
        )

    def blocks(self) -> list[nn.Module]:
        return [*self.stacks["encoder"], *self.stacks["decoder"]]


MODELS = {"list": ListModel, "dict": DictModel, "nested": NestedModel}
UNITS = {
    "list": [f"layers.{i}" for i in range(4)],
    "dict": [f"layers.{i}" for i in range(5)],
    "nested": [f"stacks.encoder.{i}" for i in range(2)] + [f"stacks.decoder.{i}" for i in range(3)],
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_block_is_its_own_unit_whatever_the_container(name: str) -> None:
    units = select_units(MODELS[name](), None, None)
    assert sorted(units) == sorted(UNITS[name])


def test_unit_policy_and_leaf_modules_are_honoured_over_a_dict_of_blocks() -> None:
    model = DictModel()
    # unit_policy replaces the default choice (before, a ModuleDict of blocks kept every
    # block in the root group whatever the policy said).
    units = select_units(model, lambda n, m: isinstance(m, nn.Linear) and n.endswith(".up"), None)
    assert sorted(units) == [f"layers.{i}.up" for i in range(5)]
    # leaf_modules on the container: its blocks are gathered with the root.
    assert select_units(model, None, ["layers"]) == {}
    assert sorted(select_units(model, None, ["Block"])) == UNITS["dict"]


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _worker(rank: int, world_size: int, name: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[name]()
    blocks = model.blocks()
    sizes = [_nbytes(b) for b in blocks]
    root = _nbytes(model) - sum(sizes)
    engine = zerostate.Engine(model, stage=3, lr=1e-2, weight_decay=0.0)
    seen: list[tuple[int, int]] = []

    def probe(i: int):
        def hook(module, args, output):  # runs before the engine releases the block
            seen.append((i, engine.memory_stats()["gathered_params"]))

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_hook(probe(i), prepend=True)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (2 * world_size, 7), generator=g)
        loss = engine(ids[rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = engine.full_state_dict()
    engine.close()
    return {"seen": seen, "sizes": sizes, "root": root, "losses": losses, "state": state}


def _reference(name: str, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (2 * world_size, 7), generator=g)
        loss = sum(model(ids[r * 2 : r * 2 + 2]) for r in range(world_size)) / world_size
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gathered_parameters_stay_at_one_block_and_the_prefetched_one(name: str) -> None:
    world_size = 2
    results = run_distributed(_worker, world_size, name, timeout=300)
    ref = _reference(name, world_size)
    for r in results:
        sizes, root = r["sizes"], r["root"]
        assert len(r["seen"]) == 3 * len(sizes)
        for i, gathered in r["seen"]:
            # The block computing, the next one (prefetched), the root group: nothing more.
            bound = root + sizes[i] + (sizes[i + 1] if i + 1 < len(sizes) else 0)
            assert gathered <= bound, (name, i, gathered, bound, sum(sizes) + root)
            assert gathered >= root + sizes[i], (name, i, gathered)
        for n, p in ref.items():
            err = float((r["state"][n] - p).norm() / p.norm().clamp_min(1e-12))
            assert err < 1e-5, (name, n, err)
