"""The engine's statistics: model-state bytes per tier and communication per mesh
dimension (``Engine.memory_stats``, ``Engine.comm_stats``)."""

from __future__ import annotations

import torch

from zerostate.dist import collectives
from zerostate.dist.collectives import CommStats
from zerostate.dist.comm import BufferPool, CommContext
from zerostate.errors import ConfigError
from zerostate.optim import ShardedOptimizer
from zerostate.runtime import process_groups
from zerostate.runtime.offload import HostTier
from zerostate.runtime.runtime import GroupRuntime
from zerostate.runtime.sharded import ShardedParam
from zerostate.runtime.tp import TensorParallel


def memory_stats(
    *,
    runtime: GroupRuntime,
    sharded: list[ShardedParam],
    optimizer: ShardedOptimizer,
    pool: BufferPool,
    host_tier: HostTier | None,
) -> dict[str, int]:
    """Bytes of model state this rank holds now, by kind.

    ``model_states`` (params + grads + master + optim_states) is the quantity of the
    ZeRO paper. Beside it, every working buffer by name: ``gathered_params`` (stage 3:
    storage of the units gathered right now, at most the one computing and the one
    prefetched), ``comm_buffers`` (the pooled pack / gather buffers of the collectives
    in flight, at most two per kind, reused every step, and this process's segments of the
    shared-memory transport, [Note: shared-memory transport] in zerostate.dist.shm);
    ``peer_segments`` (the other ranks' segments that transport maps here: their memory,
    counted by them, not in ``total``); ``buffers_in_flight`` is their
    sum and ``total`` adds it to ``model_states``. Storage shared
    by the master and the working copy (fp32) is counted once, as params. ``grads``
    counts what the reduce precision costs (docs/engine.md, "Precision"): fp32
    gradient shards at stages 1-3, and at stages 0-1 an fp32 flat accumulation buffer
    of the full gradients when ``reduce_dtype`` is wider than the working dtype.

    Per memory tier: ``device_bytes`` and ``host_bytes`` split ``total``;
    ``device_optimizer_bytes`` / ``host_optimizer_bytes`` split the optimizer part
    (fp32 masters held apart from the working copy, plus optimizer states). Without
    offload everything is on the device tier; with ``offload`` the masters, optimizer
    states and ``host_grads`` (the host staging buffer of the step's gradient shards)
    are on the host, and with ``offload="params"`` the parameter shards too.

    Under tensor parallelism every count is of this rank's local tp shards (Psi/TP of a
    tp-sharded matrix, all of a tp-replicated parameter), partitioned over ``dp_shard``.
    """

    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    held = runtime.bytes_held()
    params, grads = held["params"], held["grads"]
    master = sum(nbytes(sp.master) for sp in sharded if not sp.master_aliased)
    optim = optimizer.state_bytes()
    gathered = held["gathered_params"]
    own_segments, peer_segments = collectives.shared_memory_bytes()
    comm = pool.allocated_bytes + own_segments
    staging = host_tier.staging_bytes() if host_tier is not None else 0
    model_states = params + grads + master + optim
    total = model_states + gathered + comm + staging
    # Tiers ([Note: offload]): with offload the masters, optimizer states and the
    # gradient staging buffer are host memory (and the shards with offload="params").
    host_optim = master + optim if host_tier is not None else 0
    host = host_optim + staging
    if host_tier is not None and host_tier.params_too:
        host += params
    return {
        "params": params,
        "grads": grads,
        "master": master,
        "optim_states": optim,
        "model_states": model_states,
        "gathered_params": gathered,
        "comm_buffers": comm,
        "peer_segments": peer_segments,
        "buffers_in_flight": gathered + comm,
        "host_grads": staging,
        "total": total,
        "device_bytes": total - host,
        "host_bytes": host,
        "device_optimizer_bytes": master + optim - host_optim,
        "host_optimizer_bytes": host_optim,
    }


def comm_stats(
    counters: CommStats, ctx: CommContext, tensor_parallel: TensorParallel | None, dim: str | None
) -> dict[str, dict[str, int]]:
    """Communication of the last completed optimizer step, per collective kind and in
    total, counted as in [Note: comm accounting] (zerostate.dist.collectives).

    With a mesh, ``dim=`` gives one dimension's part and the default adds them up:
    ``"dp_shard"`` (ZeRO's gathers and reduce-scatters, of each rank's local tp shards
    under tensor parallelism: 2 Psi/TP at stages 0-2, 3 Psi/TP at stage 3),
    ``"dp_replicate"`` (hybrid sharding's all-reduce of the reduced gradient shard) and
    ``"tp"``. Over ``tp`` only the collectives the engine itself issues are counted: the
    norm-and-flags all-reduce and the summing of ``Partial`` gradients of replicated
    DTensor parameters. The collectives torch's DTensor runs inside the module's forward
    and backward (activations, the parallel styles' input/output redistributions) are
    not counted: they are torch's, and the engine does not see them."""
    reports = {"dp_shard": counters.report()}
    if ctx.replicas is not None:
        reports["dp_replicate"] = ctx.replicas.stats.report()
    if tensor_parallel is not None:
        reports["tp"] = tensor_parallel.stats.report()
    if dim is None:
        return process_groups.sum_reports(list(reports.values()))
    if dim not in reports:
        raise ConfigError(
            f"comm_stats(dim={dim!r}): this engine communicates over {sorted(reports)}"
        )
    return reports[dim]


def end_step(counters: CommStats, ctx: CommContext, tensor_parallel: TensorParallel | None) -> None:
    """Close the step's communication counts, on every mesh dimension."""
    counters.end_step()
    if ctx.replicas is not None:
        ctx.replicas.stats.end_step()
    if tensor_parallel is not None:
        tensor_parallel.stats.end_step()
