"""Write whole tensors as a checkpoint step from one process.

For conversions (importing weights from elsewhere), tools and tests: the process plays
every rank of a ``world_size``-rank save in turn, so the result is exactly what that many
ranks would have written, and any number of ranks can load it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zerostate.layout.partition import even_layout, plan_layouts
from zerostate.store import format as fmt
from zerostate.store.writer import StepWriter, TensorSpec


def plan_specs(
    tensors: Mapping[str, torch.Tensor],
    world_size: int,
    min_shard_numel: int | None = None,
) -> list[TensorSpec]:
    """One :class:`TensorSpec` per tensor. By default every tensor is split evenly over
    the ranks (``even_layout``: format 2 stores a rank's pieces of all tensors in one row,
    so small pieces cost no objects); ``min_shard_numel`` gives ``plan_layouts``' older
    placement, in mapping order, which keeps small tensors whole on one rank."""
    # A complex tensor is stored as its real pairs ([Note: complex tensors] in format.py).
    stored = {name: fmt.as_real_pairs(t) for name, t in tensors.items()}
    numels = [t.numel() for t, _ in stored.values()]
    if min_shard_numel is None:
        layouts = [even_layout(n, world_size) for n in numels]
    else:
        layouts = plan_layouts(numels, world_size, min_shard_numel)
    return [
        TensorSpec(name, tuple(t.shape), t.dtype, layout, attrs or None)
        for (name, (t, attrs)), layout in zip(stored.items(), layouts, strict=True)
    ]


def owned_shards(
    tensors: Mapping[str, torch.Tensor], specs: Iterable[TensorSpec], rank: int
) -> dict[str, torch.Tensor]:
    """``rank``'s owned range of every tensor (flattened), as :meth:`StepWriter.write` takes."""
    out = {}
    for spec in specs:
        start, stop = spec.layout.owned_range(rank)
        if stop > start:
            out[spec.name] = fmt.as_real_pairs(tensors[spec.name])[0].reshape(-1)[start:stop]
    return out


def save_tensors(
    root: str,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    world_size: int = 1,
    min_shard_numel: int | None = None,
    attrs: dict | None = None,
    storage_options: dict | None = None,
    ranks: Iterable[int] | None = None,
    progress: Callable[[int], Any] | None = None,
    rank_states: Mapping[int, dict] | None = None,
) -> list[TensorSpec]:
    """Write ``tensors`` (full, CPU) as step ``step`` of a ``world_size``-rank checkpoint.
    ``rank_states`` gives ranks their ``rank_state`` (see :class:`StepWriter`).

    ``ranks`` writes only those ranks and does not commit (what a crashed save leaves);
    by default every rank writes and rank 0 commits last. Returns the specs written.
    """
    specs = plan_specs(tensors, world_size, min_shard_numel)
    commit = ranks is None
    order = [*range(1, world_size), 0] if ranks is None else list(ranks)
    for rank in order:
        writer = StepWriter(
            root,
            step,
            rank=rank,
            world_size=world_size,
            specs=specs,
            attrs=attrs,
            storage_options=storage_options,
            progress=progress,
            rank_state=(rank_states or {}).get(rank),
        )
        writer.write(owned_shards(tensors, specs, rank))
        if commit:
            writer.commit(wait=False)  # rank 0 goes last and waits for every manifest
    return specs
