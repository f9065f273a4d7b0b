"""Elements handed to torch.distributed per optimizer step, counted independently.

Transformers from 0.1M to 100M parameters (various widths, depths, odd vocabulary sizes,
tied and untied embeddings) at default settings on 2-4 gloo ranks. The count wraps the
``torch.distributed`` functions themselves (not ``comm_stats``) with the ZeRO paper's rule:
an all-reduce of X elements moves 2X; a reduce-scatter or all-gather whose full tensor has
X elements moves X. On gloo the engine runs a reduce-scatter as one ``reduce`` per segment
and an all-gather as one ``broadcast`` per segment ([Note: gloo segments] in
zerostate.collectives): a reduce or broadcast of X elements moves X, counted with the
collective it is a segment of, so the segments of a full tensor of X add up to X. When
the ranks share a host, the large collectives go through shared memory instead ([Note:
shared-memory transport] in zerostate.dist.shm): the count wraps that transport's three
collectives the same way (its barriers carry no data; setting it up, once per group and
when its segments grow, is control traffic like the engine's construction and is not
counted). Psi is
the number of trainable parameters (a tied weight once).
Frozen parameters are not in Psi: after construction they are never communicated at
stages 0-2, and at stage 3 they are gathered for forward and backward like any other
parameter (so they add up to twice their size); these models have none.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from common import batch, local
from helpers_dist import run_distributed

import zerostate
from zerostate.dist import collectives, shm
from zerostate.models.gpt2 import GPT2, GPT2Config

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks wrap
# torch.distributed's collectives to count them and keep the wrappers. Each call forks new
# processes ([Note: forked workers] in tests/fork_server.py); nothing here needs a new interpreter,
# so the ranks are not spawned.

# name -> (GPT2Config fields, tie the embedding)
MODELS = {
    "0.08M": (dict(vocab_size=97, n_positions=16, n_embd=32, n_layer=6, n_head=4), True),
    "2.0M tied d256": (
        dict(vocab_size=1000, n_positions=32, n_embd=256, n_layer=2, n_head=4),
        True,
    ),
    "3.6M untied odd vocab": (
        dict(vocab_size=5003, n_positions=16, n_embd=160, n_layer=4, n_head=5),
        False,
    ),
    "12M d384": (dict(vocab_size=8191, n_positions=32, n_embd=384, n_layer=6, n_head=6), True),
}
BIG = {"100M": (dict(vocab_size=32003, n_positions=16, n_embd=768, n_layer=10, n_head=12), True)}

_COUNTED = {
    # name in torch.distributed -> (kind, elements counted from (args, kwargs))
    "all_reduce": ("all_reduce", lambda a, k: 2 * a[0].numel()),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: a[1].numel()),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: a[1].numel()),
    "all_gather_into_tensor": ("all_gather", lambda a, k: a[0].numel()),
    "all_gather_single": ("all_gather", lambda a, k: a[0].numel()),
    # One segment each ([Note: gloo segments]): the tensor is the segment.
    "reduce": ("reduce_scatter", lambda a, k: a[0].numel()),
    "broadcast": ("all_gather", lambda a, k: a[0].numel()),
}
_OTHER = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
_SHARED = {
    # shm.Transport method -> (kind, elements counted from (args, kwargs)); args[0] is self
    "all_reduce": ("all_reduce", lambda a, k: 2 * a[1].numel()),
    "reduce_scatter": ("reduce_scatter", lambda a, k: a[2].numel()),
    "all_gather": ("all_gather", lambda a, k: a[1].numel()),
}


class WireCounter:
    """Wraps torch.distributed's collectives; counts elements while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.counts = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "other": 0}
        for name, (kind, numel) in _COUNTED.items():
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), kind, numel))
        for name in _OTHER:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), "other", lambda a, k: 1))
        for name, (kind, numel) in _SHARED.items():
            setattr(shm.Transport, name, self._wrap(getattr(shm.Transport, name), kind, numel))
        self.shared = 0  # elements that went through shared memory (to show it was used)
        shm.Transport.reserve = self._paused(shm.Transport.reserve)
        collectives._new_transport = self._paused(collectives._new_transport)

    def _paused(self, fn):
        def wrapper(*args, **kwargs):
            active, self.active = self.active, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = active

        return wrapper

    def _wrap(self, fn, kind, numel):
        def wrapper(*args, **kwargs):
            if self.active:
                self.counts[kind] += numel(args, kwargs)
                if args and isinstance(args[0], shm.Transport):
                    self.shared += numel(args, kwargs)
            return fn(*args, **kwargs)

        return wrapper

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.shared = 0


def _model(fields: dict, tied: bool) -> GPT2:
    torch.manual_seed(0)
    model = GPT2(GPT2Config(**fields))
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _worker(rank: int, world_size: int, models: dict, stages: list[int], warmup: int) -> dict:
    counter = WireCounter()
    out = {}
    for name, (fields, tied) in models.items():
        for stage in stages:
            model = _model(fields, tied)
            psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
            engine = zerostate.Engine(model, stage=stage)
            vocab = fields["vocab_size"]
            for step in range(warmup + 1):
                x, y = batch(step, 0, vocab=vocab, size=world_size * 2)
                x, y = x[:, :8], y[:, :8]
                counter.reset()
                counter.active = step == warmup
                engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
                engine.step()
                counter.active = False
            wire = dict(counter.counts, shared=counter.shared)
            out[(name, stage)] = (psi, wire, engine.comm_stats())
            del engine, model
    return out


def _check(results: list[dict], world_size: int) -> None:
    for key, (psi, wire, stats) in sorted(results[0].items()):
        name, stage = key
        total = wire["all_reduce"] + wire["reduce_scatter"] + wire["all_gather"]
        ratio = total / psi
        print(
            f"N={world_size} {name} (Psi={psi:,}) stage {stage}: {ratio:.4f} Psi on the wire "
            f"{wire}; comm_stats total {stats['total']['elements']:,}"
        )
        assert wire["other"] == 0, (key, wire)
        if name in ("12M d384", "100M"):  # its large collectives took the shared memory
            assert wire["shared"] > 0, (key, wire)
        if stage < 3:
            assert abs(ratio - 2.0) <= 0.02, (key, ratio)  # within 1% of 2 Psi
        else:
            assert ratio <= 3.0, (key, ratio)
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            assert stats[kind]["elements"] == wire[kind], (key, kind, stats, wire)
        for rank_result in results[1:]:
            assert rank_result[key][1] == wire  # every rank hands over the same volume


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_wire_volume_is_the_papers_at_default_settings(world_size: int) -> None:
    results = run_distributed(_worker, world_size, MODELS, [0, 1, 2, 3], 1, timeout=600)
    _check(results, world_size)


@pytest.mark.slow
def test_wire_volume_at_100m_parameters() -> None:
    results = run_distributed(_worker, 2, BIG, [0, 1, 2, 3], 0, timeout=600)
    _check(results, 2)
