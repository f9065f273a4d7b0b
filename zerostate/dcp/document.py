"""What every DCP save into the store computes the same way, whichever door it came through
(``dcp.save`` with :class:`~zerostate.dcp.StorageWriter`, or ``zerostate.save``'s session):
the pieces of a global plan, the non-tensor values as JSON, and the step's DCP document
([Note: DCP steps] in zerostate.dcp)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from zerostate import jsonstate
from zerostate.dcp.common import (
    DCP_VERSION,
    Piece,
    check_save_key,
    document_dtype_name,
    piece_name,
)
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store.rows import RowView, row_views

__all__ = ["RankParts", "encode_value", "metadata_json", "plan_pieces", "split_pieces"]


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
            check_save_key(item.index.fqn)  # before anything is written
            if item.type == WriteItemType.BYTE_IO:
                continue
            td = item.tensor_data
            if td is None:
                raise ConfigError(f"{item.index.fqn}: a tensor item without tensor data")
            try:
                document_dtype_name(td.properties.dtype)
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


@dataclasses.dataclass(frozen=True)
class RankParts:
    """A global plan's pieces split by store rank ([Note: row views] in
    zerostate.store.rows): what the coordinator sends each rank is its own pieces and the
    row views that place them, O(its chunks), never the whole list; the coordinator (store
    rank 0) keeps every piece and the digest each rank's manifest must carry."""

    pieces: list[tuple[Piece, ...]]  # by store rank; rank 0's is every piece
    specs: list[Any]  # the spec of every piece, in the order of ``pieces[0]``
    views: list[dict[str, RowView] | None]  # by store rank; None for rank 0
    digests: dict[int, str]  # store rank (not 0) -> its manifest's specs digest

    def writer_options(self, store_rank: int) -> dict[str, Any]:
        """``StepWriter`` keywords of a store rank besides its specs."""
        if store_rank == 0:
            return {"manifest_digests": self.digests}
        return {"views": self.views[store_rank]}


@fmt.gc_paused  # [Note: GC paused while parsing] in zerostate.store.format
def split_pieces(pieces: tuple[Piece, ...], world_size: int) -> RankParts:
    """Every rank's own pieces, its row views and its manifest digest, in one pass over the
    pieces (``plan_pieces`` names them rank first: each rank's are consecutive)."""
    specs = [p.spec(world_size) for p in pieces]
    # One plan of every piece: the views come from it, and so do each rank's entries (a
    # view places a rank's tensors where this plan does, so their entries are the same).
    entries, plans = format2.tensor_entries(specs, world_size)
    views = row_views(plans, {p.name: p.owner for p in pieces})
    own: list[list[Piece]] = [[] for _ in range(world_size)]
    for piece in pieces:
        own[piece.owner].append(piece)
    digests = {
        r: format2.writer_digest({p.name: entries[p.name] for p in own[r]}, {}, views.get(r, {}))
        for r in range(1, world_size)
    }
    return RankParts(
        [tuple(pieces)] + [tuple(own[r]) for r in range(1, world_size)],
        specs,
        [None] + [views.get(r, {}) for r in range(1, world_size)],
        digests,
    )


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


@fmt.gc_paused  # [Note: GC paused while parsing] in zerostate.store.format
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
            "dtype": document_dtype_name(entry.properties.dtype),
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
