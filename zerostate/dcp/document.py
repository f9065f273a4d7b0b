"""What every DCP save into the store computes the same way, whichever door it came through
(``dcp.save`` with :class:`~zerostate.dcp.StorageWriter`, or ``zerostate.save``'s session):
the pieces of a global plan, the non-tensor values as JSON, and the step's DCP document
([Note: DCP steps] in zerostate.dcp)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from zerostate import jsonstate
from zerostate.dcp.common import DCP_VERSION, Piece, piece_name
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import format as fmt

__all__ = ["encode_value", "metadata_json", "plan_pieces"]


def plan_pieces(plans: list[SavePlan], coordinator: int) -> tuple[Piece, ...]:
    """The pieces of every rank's tensor items in a global plan (one plan per DCP rank):
    each chunk one piece, owned by the store rank of the DCP rank that writes it (the
    coordinator is the store's rank 0: it commits)."""
    world_size = len(plans)
    if world_size > fmt.MAX_RANKS + 1:
        raise ConfigError(f"{world_size} ranks exceed the store's {fmt.MAX_RANKS + 1}")
    pieces: list[Piece] = []
    for index, plan in enumerate(plans):
        store_rank = (index - coordinator) % world_size
        seq = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            td = item.tensor_data
            if td is None:
                raise ConfigError(f"{item.index.fqn}: a tensor item without tensor data")
            try:
                fmt.dtype_name(td.properties.dtype)
            except ConfigError as exc:
                raise ConfigError(f"{item.index.fqn}: {exc}") from None
            pieces.append(
                Piece(
                    piece_name(store_rank, seq, item.index.fqn),
                    item.index.fqn,
                    tuple(int(o) for o in td.chunk.offsets),
                    tuple(int(s) for s in td.chunk.sizes),
                    td.properties.dtype,
                    store_rank,
                )
            )
            seq += 1
    return tuple(pieces)


def encode_value(item: WriteItem, planner: SavePlanner) -> Any:
    """A non-tensor value as JSON (``zerostate.jsonstate``), looked up in the state the
    planner holds; a value that JSON cannot hold raises ConfigError naming its key."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        obj = lookup(item.index)
    else:  # a planner without the default's lookup: undo its torch.save of our own value
        buffer = planner.resolve_data(item)
        buffer.seek(0)  # type: ignore[union-attr]
        try:
            obj = torch.load(buffer, weights_only=True)  # type: ignore[arg-type]
        except Exception as exc:
            raise ConfigError(
                f"non-tensor value {fqn!r} holds objects a checkpoint cannot store without "
                f"pickle ({exc})"
            ) from exc
    what = f"non-tensor value {fqn!r}"
    value = jsonstate.encode(obj, what)
    fmt.check_json(value, what)
    return value


def metadata_json(metadata: Metadata, pieces: tuple[Piece, ...], values: dict[str, Any]) -> dict:
    """DCP's metadata as the JSON document of a step (see [Note: DCP steps]); ``values``:
    every non-tensor value's encoding by key."""
    by_chunk = {(p.fqn, p.offsets): p for p in pieces}
    tensors: dict[str, dict] = {}
    non_tensors: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if fqn not in values:
                raise CheckpointError(f"internal: no rank wrote the value of {fqn!r}")
            non_tensors[fqn] = values[fqn]
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError(f"{fqn}: DCP metadata of type {type(entry).__name__}")
        chunks = []
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            piece = by_chunk.get((fqn, offsets))
            if piece is None or piece.sizes != tuple(int(s) for s in chunk.sizes):
                raise CheckpointError(f"internal: chunk {list(offsets)} of {fqn} has no piece")
            chunks.append(
                {"offsets": list(offsets), "sizes": list(piece.sizes), "piece": piece.name}
            )
        tensors[fqn] = {
            "dtype": fmt.dtype_name(entry.properties.dtype),
            "shape": [int(d) for d in entry.size],
            "chunks": chunks,
        }
    planner_data = None
    if metadata.planner_data is not None:
        planner_data = jsonstate.encode(metadata.planner_data, "DCP planner data")
        fmt.check_json(planner_data, "DCP planner data")
    meta = metadata.storage_meta
    return {
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "values": non_tensors,
        "planner_data": planner_data,
        "modules": [str(m) for m in (meta.modules if meta is not None else [])],
    }
