"""``zerostate inspect``: what a checkpoint holds, without reading tensor data."""

from __future__ import annotations

import argparse
from typing import Any

from zerostate_cli.common import (
    add_checkpoint_args,
    human_bytes,
    open_step,
    print_json,
)
from zerostate_cli.layouts import mesh_text, step_mesh, tensor_layout_json, tensor_layout_text

GROUPS = ("model", "optim", "buffers")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="list steps, mesh, stage and tensors of a checkpoint",
        description="Show a checkpoint's committed (and partial) steps and, for one step, "
        "its world size and mesh (dp_replicate x dp_shard x tp), engine settings, format "
        "version and every tensor with its layout (tensor-parallel dim and degree, fused "
        "sub-tensors, data-parallel partitioning). Reads metadata only.",
    )
    add_checkpoint_args(parser)
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(run=run)


def group_of(name: str) -> str:
    head = name.split("/", 1)[0]
    return head if head in GROUPS else "other"


def describe(ckpt: Any, st: Any, root: str) -> dict[str, Any]:
    engine = st.attrs.get("engine") if isinstance(st.attrs, dict) else None
    engine = engine if isinstance(engine, dict) else {}
    mesh = step_mesh(st)
    tensors = []
    totals: dict[str, dict[str, int]] = {
        g: {"num_tensors": 0, "numel": 0, "bytes": 0} for g in (*GROUPS, "other")
    }
    for name, info in st.tensors.items():
        layout = getattr(info, "layout", None)
        tensors.append(
            {
                "name": name,
                "shape": list(info.shape),
                "dtype": str(info.dtype).removeprefix("torch."),
                "numel": int(info.numel),
                "bytes": int(info.nbytes),
                "num_chunks": int(layout.num_chunks) if layout is not None else None,
                "layout": tensor_layout_text(st, name, info, mesh["tp"]),
                "layout_detail": tensor_layout_json(st, name, info),
            }
        )
        group = totals[group_of(name)]
        group["num_tensors"] += 1
        group["numel"] += int(info.numel)
        group["bytes"] += int(info.nbytes)
    totals = {g: t for g, t in totals.items() if t["num_tensors"] or g in GROUPS}
    dcp_entries = None
    if st.dcp_pieces:  # a step written through zerostate.dcp: its boxes, as stored
        from zerostate.dcp import describe_step

        dcp_entries = describe_step(st.stored)
    committed, partial = (list(steps) for steps in ckpt.scan())  # one listing of the root
    return {
        "checkpoint": root,
        "steps": committed,
        "partial_steps": partial,
        "step": st.step,
        "format_version": st.format_version,
        "objects": st.object_count,
        "world_size": st.world_size,
        "mesh": mesh,
        "stage": engine.get("stage"),
        "precision": engine.get("precision"),
        "tied": engine.get("tied") or {},
        "tensors": tensors,
        "totals": totals,
        "total_bytes": sum(t["bytes"] for t in tensors),
        "dcp": dcp_entries,
    }


def memory_steps(root: str) -> dict[str, Any] | None:
    """This node's memory-tier steps of ``root`` ([Note: memory tier layout] in
    zerostate.store.memory_tier): None when it has none; a refused directory says why."""
    from zerostate.errors import CheckpointError
    from zerostate.store.memory_tier import MemoryTier, memory_dir
    from zerostate.store.storage import canonical_location

    try:
        tier = MemoryTier(memory_dir(), canonical_location(root))
    except (CheckpointError, OSError, ValueError):
        return None
    if not tier.exists():
        return None
    try:
        held = tier.holdings(newest=1000)
    except (CheckpointError, OSError) as exc:
        return {"directory": tier.path, "refused": str(exc), "steps": []}
    steps = [
        {"step": h.step, "world_size": h.world_size, "ranks_held": sorted(h.ranks)}
        for h in sorted(held, key=lambda h: h.step)
    ]
    return {"directory": tier.path, "refused": None, "steps": steps}


def _memory_text(memory: dict[str, Any]) -> str:
    if memory["refused"]:
        return f"memory tier {memory['directory']}: refused ({memory['refused']})"
    parts = [
        f"{m['step']} (ranks {_ranges(m['ranks_held'])} of {m['world_size']} held here)"
        for m in memory["steps"]
    ]
    return f"memory tier {memory['directory']}: steps " + (", ".join(parts) or "none")


def _ranges(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks)) or "none"


def run(args: argparse.Namespace) -> int:
    ckpt, st = open_step(args)
    data = describe(ckpt, st, args.ckpt)
    memory = memory_steps(args.ckpt) if isinstance(args.ckpt, str) else None
    if memory is not None:  # only where this node has a memory tier of the root
        data["memory_tier"] = memory
    if args.json:
        print_json(data)
        return 0
    steps = data["steps"]
    print(f"checkpoint {data['checkpoint']}")
    print(f"committed steps ({len(steps)}): {_step_list(steps)}")
    if memory is not None:
        print(_memory_text(memory))
    if data["partial_steps"]:
        print(
            f"partial steps (not committed: crashed or in-flight saves, ignored by loads): "
            f"{_step_list(data['partial_steps'], latest=False)}"
        )
    engine = ", ".join(
        f"{key} {data[key]}" for key in ("stage", "precision") if data[key] is not None
    )
    print(
        f"step {data['step']}: world size {data['world_size']} {mesh_text(data['mesh'])}, "
        f"format version "
        f"{data['format_version']}, {data['objects']} objects" + (f", {engine}" if engine else "")
    )
    for alias, canonical in sorted(data["tied"].items()):
        print(f"tied: {alias} -> {canonical}")
    rows = [
        (
            t["name"],
            "x".join(map(str, t["shape"])) or "scalar",
            t["dtype"],
            t["bytes"],
            t["layout"],
        )
        for t in data["tensors"]
    ]
    width = max([len(r[0]) for r in rows] + [6])
    shape_width = max([len(r[1]) for r in rows] + [5])
    print(f"{'tensor':<{width}}  {'shape':<{shape_width}}  {'dtype':<9} {'bytes':>14}  layout")
    for name, shape, dtype, nbytes, layout in rows:
        print(f"{name:<{width}}  {shape:<{shape_width}}  {dtype:<9} {nbytes:>14,}  {layout}")
    for group, total in data["totals"].items():
        print(
            f"{group:<8} {total['num_tensors']:>6} tensors {total['numel']:>16,} elements "
            f"{human_bytes(total['bytes']):>12}"
        )
    print(
        f"{'total':<8} {len(rows):>6} tensors {'':>16}          "
        f"{human_bytes(data['total_bytes']):>12}"
    )
    if data["dcp"] is not None:
        _print_dcp(data["dcp"])
    return 0


def _print_dcp(entries: list[dict[str, Any]]) -> None:
    """The global tensors of a step written through ``zerostate.dcp`` and where each box
    lies: ``[rows, columns, ...] on rank r``."""
    print(f"torch.distributed.checkpoint state ({len(entries)} keys):")
    for entry in entries:
        if entry["kind"] == "value":
            print(f"  {entry['key']}  (non-tensor value, JSON)")
            continue
        shape = "x".join(map(str, entry["shape"])) or "scalar"
        boxes = ", ".join(
            "["
            + ", ".join(f"{o}:{o + n}" for o, n in zip(c["offsets"], c["sizes"], strict=True))
            + f"] rank {c['rank']}"
            for c in entry["chunks"]
        )
        print(f"  {entry['key']}  {shape} {entry['dtype']}: {boxes}")


def _step_list(steps: list[int], limit: int = 20, latest: bool = True) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-limit:]))
    return (
        ("..., " if len(steps) > limit else "")
        + shown
        + (f" (latest {steps[-1]})" if latest else "")
    )
