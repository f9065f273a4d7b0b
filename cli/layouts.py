"""How the commands word a step's mesh and each tensor's layout.

A step's world size alone does not say how it was laid out: a (dp 4) job and a
(dp_shard 2 x tp 2) job both write 4 rows. The step records each tensor's layout instead
(a format-3 tensor its :class:`~zerostate.layout.MeshLayout`, a format-2 tensor its
:class:`~zerostate.partition.TensorLayout` over the step's rows), and the mesh follows from
those. Nothing here imports torch (``--help`` stays fast); the step is any step reader.
"""

from __future__ import annotations

from typing import Any


def mesh_of(st: Any, name: str) -> Any:
    """The tensor-parallel x data-parallel layout ``name`` was stored in, or None (a plain
    data-parallel tensor, or a reader of a format without mesh tensors)."""
    lookup = getattr(st, "mesh_layout", None)
    return lookup(name) if callable(lookup) else None


def step_mesh(st: Any) -> dict[str, int]:
    """``{"dp_replicate", "dp_shard", "tp"}`` of the job that wrote ``st`` (as far as the step
    records it: a hybrid-sharded job's plain step is one replica's and says dp_replicate 1)."""
    meshes = [m for m in (mesh_of(st, name) for name in st.tensors) if m is not None]
    if not meshes:
        return {"dp_replicate": 1, "dp_shard": int(st.world_size), "tp": 1}
    dp_shard = max(m.dp_shard for m in meshes)
    tp = max((m.tp_degree for m in meshes if m.tp_dim is not None), default=1)
    if tp * dp_shard != st.world_size and st.world_size % dp_shard == 0:
        # Every tensor replicated across tp: the rows still count the tp ranks.
        tp = st.world_size // dp_shard
    return {
        "dp_replicate": max(m.dp_replicate for m in meshes),
        "dp_shard": dp_shard,
        "tp": tp,
    }


def mesh_text(mesh: dict[str, int]) -> str:
    """``(dp 4)``, ``(dp_shard 2 x tp 2)`` or ``(dp_replicate 2 x dp_shard 2 x tp 1)``."""
    replicate, dp_shard, tp = mesh["dp_replicate"], mesh["dp_shard"], mesh["tp"]
    if replicate == 1 and tp == 1:
        return f"(dp {dp_shard})"
    if replicate == 1:
        return f"(dp_shard {dp_shard} x tp {tp})"
    return f"(dp_replicate {replicate} x dp_shard {dp_shard} x tp {tp})"


def dp_text(layout: Any, ranks: str = "ranks") -> str:
    """How a (flattened) tensor is cut across ``ranks`` ([Note: partition rule]):
    ``even over 4 ranks``; ``whole on rank 2`` (a tensor under the smallest piece, see
    ``--min-shard-numel``); or ``3 pieces of 65,536 from rank 1``."""
    world, numel, chunk = layout.world_size, layout.numel, layout.chunk_numel
    one = ranks.removesuffix("s")
    if numel == 0:
        return "empty"
    if world == 1:
        return "whole"
    pieces = layout.num_chunks
    if pieces == 1:
        return f"whole on {one} {layout.first_owner}"
    if pieces == world and chunk == -(-numel // world) and layout.first_owner == 0:
        return f"even over {world} {ranks}"
    return f"{pieces} pieces of {chunk:,} from {one} {layout.first_owner}"


def tensor_layout_text(st: Any, name: str, info: Any, step_tp: int) -> str:
    """One tensor's layout in a few words: the tensor-parallel cut (dim, degree, fused
    sub-tensors) where the step has one, then the data-parallel cut of each tp shard."""
    mesh = mesh_of(st, name)
    if mesh is None:
        return dp_text(info.layout)
    parts = []
    if mesh.tp_dim is not None:
        tp = f"tp dim {mesh.tp_dim} of {mesh.tp_degree}"
        if len(mesh.fused_sizes) > 1:
            tp += " fused " + "+".join(map(str, mesh.fused_sizes))
        parts.append(tp)
    elif step_tp > 1:
        parts.append("tp replicated")
    # Every tp shard is cut the same way up to its size; shard 0 is the largest.
    parts.append(dp_text(mesh.dp_layout(0), "dp ranks"))
    return ", ".join(parts)


def tensor_layout_json(st: Any, name: str, info: Any) -> dict[str, Any]:
    """The layout as ``inspect --json`` shows it: the mesh entry, or the dp layout."""
    mesh = mesh_of(st, name)
    if mesh is not None:
        return {
            "tp_dim": mesh.tp_dim,
            "tp_degree": mesh.tp_degree,
            "fused_sizes": list(mesh.fused_sizes) if len(mesh.fused_sizes) > 1 else None,
            "dp_shard": mesh.dp_shard,
            "dp_replicate": mesh.dp_replicate,
            "min_shard_numel": mesh.min_shard_numel,
        }
    layout = info.layout
    return {
        "tp_dim": None,
        "dp_shard": layout.world_size,
        "chunk_numel": layout.chunk_numel,
        "num_chunks": layout.num_chunks,
        "first_owner": layout.first_owner,
    }
