"""Saving and loading an engine that runs tensor parallelism: format 3's tp x dp pieces.

[Note: tensor-parallel checkpoints]
Under tensor parallelism each rank's masters and optimizer states are its dp piece of its
*local* tp shard ([Note: tensor parallelism] in zerostate.runtime.tp). A checkpoint stores
them as format 3's mesh tensors ([Note: mesh tensors] in zerostate.store.geometry): the logical
(global) tensor under the model's own name, with its :class:`~zerostate.layout.MeshLayout`
(the DTensor's shard dim at the tp degree, or replicated across tp; every tp shard split
evenly over ``dp_shard``, as the engine partitions it), so any layout reads it: a plain
data-parallel engine, another tp degree, ``consolidate``.

* **Who writes.** The ``tp x dp_shard`` ranks of one replica save together, through one
  process group over them (made once at engine construction: :func:`checkpoint_world`);
  rank ``(t, d)`` is the step's rank ``t * dp_shard + d`` and writes piece ``(t, d)`` of
  every tensor split across tp, and of a tensor replicated across tp only tp rank 0
  writes (its pieces are ``(0, d)``). Buffers are one chunk, written by the step's rank 0.
  Other replicas write nothing ([Note: one replica writes] in zerostate.runtime.process_groups).
* **Reading.** A load asks, for each view, for the local range the view holds in the
  engine's own layout (:func:`layout_read`, ``StepSource.read_layout_many``), whatever
  layout the step was written in: a format-3 step plans it with
  :func:`zerostate.layout_plan.plan_range`, other formats read its global segments
  (:meth:`MeshLayout.local_segments`) as logical ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import TensorLayout
from zerostate.runtime.sharded import ShardView


@dataclass(frozen=True, slots=True)
class CheckpointWorld:
    """The ranks that save one checkpoint together, from this rank's side."""

    group: Any
    rank: int
    """This rank's rank in the step: ``t * dp_shard + d``."""
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def checkpoint_world(mesh: Any, tp_rank: int, tp_size: int, dp_rank: int, dp_size: int) -> Any:
    """The process group over the ``tp x dp_shard`` ranks of this rank's replica (collective:
    every rank of the world creates every replica's group, in the same order)."""
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh
    if "dp_replicate" in names:
        dim = names.index("dp_replicate")
        replicas = [ranks.select(dim, r).reshape(-1).tolist() for r in range(ranks.shape[dim])]
    else:
        replicas = [ranks.reshape(-1).tolist()]
    group = collectives.new_subgroups(replicas)
    return CheckpointWorld(
        group=group,
        rank=tp_rank * dp_size + dp_rank,
        world_size=tp_size * dp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def global_shape(param: Any) -> tuple[int, ...]:
    """A parameter's logical shape (a DTensor's global shape; else its own)."""
    dparam = getattr(param, "dparam", None)
    return tuple((dparam if dparam is not None else param).shape)


def mesh_of(param: Any, world: CheckpointWorld) -> MeshLayout:
    """The tp x dp layout of one engine parameter ([Note: tensor-parallel checkpoints])."""
    shape = global_shape(param)
    dparam = getattr(param, "dparam", None)
    placements = collectives.dtensor_placements(dparam) if dparam is not None else ()
    shard = [p for p in placements if p.startswith("shard(")]
    if not shard:
        return MeshLayout(shape=shape, dp_shard=world.dp_size)
    dim = int(shard[0][len("shard(") : -1])
    return MeshLayout(shape=shape, tp_dim=dim, tp_degree=world.tp_size, dp_shard=world.dp_size)


def mesh_views(
    views: list[ShardView],
    params: list[Any],
    world: CheckpointWorld,
    sharded_buffers: dict[str, int] | None = None,
) -> list[ShardView]:
    """The engine's views with their tp x dp layouts (parameter and optimizer-state views,
    in ``state_views`` order: each parameter's views first, then buffers).
    ``sharded_buffers``: the buffer views (name -> tp dim) of DTensor buffers sharded over
    tp, whose views hold the whole local shard; they are stored as parameters are."""
    layouts = {}
    for sp in params:
        mesh = mesh_of(sp.param, world)
        layouts[sp.name] = mesh
    out = []
    for view in views:
        kind, _, name = view.name.partition("/")
        if kind == "optim":
            name = name.partition("/")[2]
        mesh = layouts.get(name) if kind in ("model", "optim") else None
        tp_dim = (sharded_buffers or {}).get(view.name) if kind == "buffers" else None
        if tp_dim is not None:
            mesh = MeshLayout(
                shape=view.shape, tp_dim=tp_dim, tp_degree=world.tp_size, dp_shard=world.dp_size
            )
            layout = mesh.dp_layout(world.tp_rank)
            piece = (world.tp_rank, world.dp_rank)
            out.append(replace(view, layout=layout, mesh=mesh, tp_index=world.tp_rank, piece=piece))
            continue
        if mesh is None:  # a buffer: one chunk, written by the step's rank 0
            numel = view.layout.numel
            layout = TensorLayout(numel, world.world_size, max(1, numel), 0)
            out.append(replace(view, layout=layout))
            continue
        t = world.tp_rank if mesh.tp_dim is not None else 0
        writes = mesh.tp_dim is not None or world.tp_rank == 0
        out.append(
            replace(
                view,
                shape=mesh.shape,
                mesh=mesh,
                tp_index=t,
                piece=(t, world.dp_rank) if writes else None,
            )
        )
    return out


def saved_piece(view: ShardView, chunk: int) -> torch.Tensor:
    """What this rank writes of a mesh view: its piece, padded with zeros to ``chunk``."""
    assert view.mesh is not None and view.piece is not None
    lo, hi = view.mesh.dp_layout(view.piece[0]).owned_range(view.piece[1])
    flat = view.local.reshape(-1)
    piece = flat[lo - view.local_start : hi - view.local_start]
    if piece.numel() == chunk:
        return piece
    padded = torch.zeros(chunk, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    return padded


def layout_read(view: ShardView) -> tuple[str, MeshLayout, int, int, int, torch.Tensor]:
    """The read filling a mesh view's local range, as ``StepSource.read_layout_many`` takes
    it: the range of its tp shard in the engine's own layout, landing in the view's memory.
    A format-3 step plans it whole ([Note: row bands] in zerostate.layout_plan); others read
    its global segments (one per row of a ``Shard(1)`` tensor)."""
    assert view.mesh is not None
    flat = view.local.reshape(-1)
    start = view.local_start
    return view.name, view.mesh, view.tp_index, start, start + flat.numel(), flat
