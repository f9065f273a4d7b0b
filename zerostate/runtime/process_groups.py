"""ZeRO inside a named device mesh: which process groups the engine partitions over.

``Engine(model, mesh=mesh)`` takes a ``torch.distributed.device_mesh.DeviceMesh`` whose
dimension names are among :data:`DIM_NAMES`. This module checks the mesh (before any
collective) and turns it into a :class:`MeshPlan`: the group ZeRO partitions over and, for
hybrid sharding, the group the partitions are replicated over. Everything else in the engine
keeps seeing one data-parallel group (``engine.group``, ``engine.rank``,
``engine.world_size`` are those of ``dp_shard``); the replicated dimension only adds the
collectives of [Note: hybrid sharding]. A ``"tp"`` dimension is torch's tensor parallelism,
whose DTensor parameters the engine partitions as their local shards ([Note: tensor
parallelism] in zerostate.runtime.tp); a mesh of ``"tp"`` without ``"dp_shard"`` makes
each rank a ZeRO world of one.

[Note: hybrid sharding]
With a ``("dp_replicate", "dp_shard")`` mesh, every replica (a ``dp_replicate`` coordinate)
is a complete ZeRO group over ``dp_shard`` and holds the same partitions as every other
replica: the layouts, buckets, stage-3 units and gathers are those of a ``dp_shard``-sized
world. Only gradients cross replicas: once a group's gradient reduce over ``dp_shard`` is
final on an accumulation boundary, the part this rank owns (the 1/dp_shard shard at stages
1-3; the whole gradient at stage 0, which partitions nothing) is all-reduced over
``dp_replicate`` (:func:`zerostate.comm.all_reduce_replicas`, run as the group's completion
hook, before offload copies it to the host). From then on the replicas hold identical
gradient shards, so they take identical optimizer steps and the optimizer state stays
replicated without further traffic. The step divides by ``dp_shard * dp_replicate``; the
gradient norm counts one replica's squares, while the per-parameter "got a gradient" flags
sum over the whole mesh, so the norm, clipping and the fp16 overflow verdict agree
everywhere. Parameters start equal across the whole mesh (``sync_module_states`` broadcasts
over both dimensions). A checkpoint is written by replica 0 alone ([Note: one replica
writes]); every replica reads it.

[Note: one replica writes]
Replicas hold identical partitions, so a save would write every object ``dp_replicate``
times, to the same names. Replica 0 runs the save (its ``dp_shard`` group is a complete
world of the checkpoint, as without a mesh); the other replicas write nothing and wait for
replica 0's verdict (one exchange over ``dp_replicate``), so a failed save fails on every
rank and a blocking save returns everywhere only after the step is committed. The stored
checkpoint is therefore exactly the one a ``dp_shard``-sized world writes, and loads at
any world size. A non-blocking save agrees the same way on its preparation (replica 0
returns once its snapshot is taken); the other replicas' handles then watch storage for
the step's commit record (:func:`watch_commit`), so ``handle.wait()`` returns on every rank
only once the step is committed. A background failure surfaces on replica 0 (at its next
save, ``wait()`` or ``close()``, and that save's verdict reaches every replica); the other
replicas' ``wait()`` raises at the commit timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.dist.collectives import KINDS, CommStats
from zerostate.dist.comm import Replicas
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError, CommitTimeoutError, ConfigError
from zerostate.runtime.tp import TensorParallel

#: Mesh dimension names the engine understands, outermost first.
DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


def check_mesh(mesh: Any) -> tuple[str, ...]:
    """The dimension names of ``mesh`` once they are a combination the engine runs;
    :class:`ConfigError` naming the field ``mesh`` otherwise. Local: no collective."""
    if not collectives.is_device_mesh(mesh):
        raise ConfigError(
            f"mesh={type(mesh).__name__} is not a torch DeviceMesh; build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, shape, "
            "mesh_dim_names=(...)), or pass mesh=None"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ConfigError(
            f"mesh has {mesh.ndim} unnamed dimension(s); name them from {DIM_NAMES} "
            "with init_device_mesh(..., mesh_dim_names=(...))"
        )
    unknown = [n for n in names if n not in DIM_NAMES]
    if unknown:
        raise ConfigError(
            f"mesh dimension name(s) {unknown} are not among {DIM_NAMES}: ZeRO partitions "
            "over 'dp_shard', replicates over 'dp_replicate' and leaves 'tp' to torch's "
            "tensor parallelism; rename the dimensions"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"mesh names a dimension twice: {names}; give each one name once")
    if "dp_shard" not in names and "tp" not in names:
        raise ConfigError(
            f"mesh={names} has no 'dp_shard' dimension, which ZeRO partitions over; a mesh "
            "of replicas alone is plain data parallelism: name it ('dp_shard',) and use "
            "stage=0 for that"
        )
    return names


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshPlan:
    """What the engine does with a checked mesh ([Note: hybrid sharding])."""

    dim_names: tuple[str, ...]
    """The mesh's dimension names, outermost first."""
    dim_sizes: tuple[int, ...]
    """The size of each dimension, aligned with ``dim_names``."""
    shard_group: Any
    """Process group of ``dp_shard``: ZeRO partitions, gathers and reduce-scatters over it."""
    replicas: Replicas | None
    """The ``dp_replicate`` group and its counters; None for a mesh without one."""
    tp: TensorParallel | None = None
    """The ``tp`` dimension ([Note: tensor parallelism] in zerostate.runtime.tp); None for
    a mesh without one."""

    @property
    def num_replicas(self) -> int:
        return 1 if self.replicas is None else self.replicas.size

    def describe(self) -> dict[str, int]:
        return dict(zip(self.dim_names, self.dim_sizes, strict=True))


def plan_mesh(mesh: Any, device: torch.device) -> MeshPlan:
    """Check ``mesh`` against this process's world and ``device``; no collective."""
    names = check_mesh(mesh)
    sizes = tuple(int(mesh.size(i)) for i in range(mesh.ndim))
    _, world_size = collectives.group_info(None)
    if mesh.size() != world_size:
        shown = " x ".join(f"{n} {s}" for n, s in zip(names, sizes, strict=True))
        raise ConfigError(
            f"mesh ({shown}) spans {mesh.size()} ranks but the world has {world_size}; the "
            "mesh must cover every rank: make the product of its sizes the world size"
        )
    if mesh.device_type != device.type:
        raise ConfigError(
            f"mesh is a {mesh.device_type!r} mesh but the model is on {device}; build the "
            f"mesh with init_device_mesh({device.type!r}, ...) or move the model"
        )
    replicas = None
    if "dp_replicate" in names:
        replicas = Replicas(
            group=mesh.get_group("dp_replicate"),
            rank=int(mesh.get_local_rank("dp_replicate")),
            size=int(mesh.size(names.index("dp_replicate"))),
            stats=CommStats(),
        )
    tp = None
    if "tp" in names:
        tp = TensorParallel(
            mesh=mesh["tp"],
            group=mesh.get_group("tp"),
            rank=int(mesh.get_local_rank("tp")),
            size=int(mesh.size(names.index("tp"))),
        )
    if "dp_shard" in names:
        shard_group = mesh.get_group("dp_shard")
    else:
        # A tp-only mesh: each rank is a ZeRO world of one over its local shards.
        shard_group = collectives.new_singleton_group()
    return MeshPlan(
        dim_names=names, dim_sizes=sizes, shard_group=shard_group, replicas=replicas, tp=tp
    )


def broadcast_from_first(tensors: list[torch.Tensor], plan: MeshPlan) -> None:
    """Rank (replica 0, shard 0)'s values on every rank of the mesh: first across replicas
    (each shard position takes replica 0's), then across ``dp_shard`` within each replica."""
    if plan.replicas is not None:
        collectives.broadcast_from_first(tensors, group=plan.replicas.group)
    collectives.broadcast_from_first(tensors, group=plan.shard_group)


def replica_coordinator(plan: MeshPlan | None, coordinator: Coordinator) -> Coordinator | None:
    """The engine's ``coordinator`` over the ``dp_replicate`` group, raising
    :class:`CheckpointError` where a replica failed ([Note: one coordinator] in
    zerostate.coordinator); None without replicas."""
    replicas = None if plan is None else plan.replicas
    if replicas is None:
        return None
    return coordinator.over(replicas.group, replicas.rank, replicas.size).with_errors(
        CheckpointError
    )


def save_on_first_replica(
    replicas: Coordinator | None, save: Callable[[], Any], skipped: Callable[[], Any]
) -> Any:
    """``save()`` on replica 0, ``skipped()`` on the others, and one verdict for all
    ([Note: one replica writes]); ``replicas``: the coordinator of the ``dp_replicate``
    group (:func:`replica_coordinator`), None without one."""
    if replicas is None:
        return save()
    result, error = None, None
    if replicas.rank == 0:
        try:
            result = save()
        except Exception as exc:  # shared with the other replicas below, then re-raised
            error = exc
    else:
        result = skipped()
    replicas.agree(error, "save (written by replica 0 of dp_replicate)")
    return result


def watch_commit(committed: Callable[[], bool], what: str, timeout_s: float) -> Future:
    """A future that completes once ``committed()`` is true, checked on a daemon thread
    every 50 ms, or fails with :class:`CommitTimeoutError` after ``timeout_s`` seconds
    ([Note: one replica writes]). Daemon: a process that exits is never held by it."""
    future: Future = Future()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not committed():
                if time.monotonic() > deadline:
                    raise CommitTimeoutError(
                        f"{what} was not committed by replica 0 of dp_replicate within "
                        f"{timeout_s:g} s; see the error replica 0 raised"
                    )
                time.sleep(0.05)
        except Exception as exc:  # handed to whoever waits on the handle
            future.set_exception(exc)
            return
        future.set_result(None)

    threading.Thread(target=watch, name="zs-commit-watch", daemon=True).start()
    return future


def sum_reports(reports: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Communication reports (``CommStats.report()``) of several dimensions, added up."""
    keys = (*KINDS, "total")
    return {
        k: {f: sum(r[k][f] for r in reports) for f in ("elements", "bytes", "calls")} for k in keys
    }
