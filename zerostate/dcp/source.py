"""A DCP-contract state as a save source: ``zerostate.save`` through the store's save session.

[Note: zerostate.save through the session]
``zerostate.save`` writes the same step ``dcp.save`` with :class:`~zerostate.dcp.StorageWriter`
writes ([Note: DCP steps] in zerostate.dcp), but through the save session the engine uses
([Note: save sources] in zerostate.checkpoint.source), so it gets the session's save guard,
failing together, background writer and :class:`~zerostate.checkpoint.SaveHandle`,
retention and memory tier. What is saved is planned by torch's own ``DefaultSavePlanner``
exactly as ``dcp.save`` drives it: each rank's local plan, gathered on rank 0, whose
``create_global_plan`` de-duplicates replicated tensors (each is written by one rank) and
builds DCP's metadata; each rank's part is scattered back and finished. The pieces, the
non-tensor values and the DCP document come from the same functions the storage writer
uses (zerostate.dcp.document), so the two doors write one format.

Planning is collective and may fail on one rank (a value JSON cannot hold, a state torch's
planner refuses): that rank still takes part in the gather and the scatter with nothing to
contribute, and one agreement at the end makes every rank raise together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from zerostate.checkpoint.async_save import Piece
from zerostate.dcp.common import ATTR, check_has_data, plain_data, stored_data
from zerostate.dcp.common import Piece as ChunkPiece
from zerostate.dcp.document import (
    RankParts,
    encode_value,
    metadata_json,
    plan_pieces,
    split_pieces,
)
from zerostate.dcp.staging import StagingBuffers
from zerostate.dist import collectives
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError, ConfigError

__all__ = ["DcpSource"]


@dataclasses.dataclass(frozen=True)
class _Part:
    """What rank 0 sends each rank: its part of the global plan, its own pieces and the row
    views that place them ([Note: row views] in zerostate.store.rows); rank 0's own part
    has no pieces: it keeps every piece."""

    plan: SavePlan
    pieces: tuple[ChunkPiece, ...]
    views: dict | None


class DcpSource:
    """A DCP-contract state (modules and optimizers already wrapped as ``Stateful``) as a
    save source ([Note: zerostate.save through the session])."""

    document: dict = {}  # noqa: RUF012 - no engine document: nothing is referenced
    newer_hint = "Call zerostate.load(state, {path!r}) first to continue that run"

    def __init__(
        self,
        state: dict[str, Any],
        *,
        root: str,
        step: int | None,
        rank: int,
        world_size: int,
        staging: StagingBuffers,
    ) -> None:
        self.step, self.rank, self.world_size = step, rank, world_size
        self._root, self._staging = root, staging
        # As dcp.save: each Stateful's state now, on the caller's thread.
        self._state = {
            k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()
        }
        self._pieces: list[Piece] = []
        self._attrs: dict = {}
        self._parts: RankParts | None = None  # rank 0: every rank's part
        self._writer_options: dict[str, Any] = {}
        self._staged: list[torch.Tensor] = []

    @property
    def pieces(self) -> list[Piece]:
        return self._pieces

    @property
    def attrs(self) -> dict:
        return self._attrs

    @property
    def rank_state(self) -> None:
        return None

    @property
    def writer_options(self) -> dict[str, Any]:
        return self._writer_options

    def guard_shapes(self) -> None:
        return None  # a DCP state has no model/ tensors to compare

    def plan(self, coordinator: Coordinator, step: int) -> None:
        """DCP's two planning phases over the coordinator's group (see the module's note)."""
        planner, error, local = DefaultSavePlanner(), None, None
        try:
            planner.set_up_planner(
                state_dict=self._state,
                storage_meta=StorageMeta(checkpoint_id=self._root),
                is_coordinator=self.rank == 0,
            )
            plan = planner.create_local_plan()
            values = {
                item.index.fqn: encode_value(item, planner)
                for item in plan.items
                if item.type == WriteItemType.BYTE_IO
            }
            local = (plan, values)
        except Exception as exc:  # the others learn it at the agreement below
            error = exc
        gathered = collectives.gather_objects(
            local, group=coordinator.group, rank=self.rank, world_size=self.world_size
        )
        parts: list[_Part | None] | None = None
        if gathered is not None:  # rank 0
            parts = [None] * self.world_size
            if all(g is not None for g in gathered):
                try:
                    parts = self._global_plan(planner, gathered)
                except Exception as exc:
                    error = exc
        part = collectives.scatter_objects(parts, group=coordinator.group, rank=self.rank)
        if part is not None and error is None:
            try:
                if self.rank == 0:  # every piece, kept when planning
                    if self._parts is None:
                        raise CheckpointError("internal: rank 0 lost its global plan")
                    part = dataclasses.replace(part, pieces=self._parts.pieces[0])
                    self._writer_options = self._parts.writer_options(0)
                else:
                    self._writer_options = {"views": part.views}
                self._pieces = self._own_pieces(planner, planner.finish_plan(part.plan), part)
            except Exception as exc:
                error = exc
        coordinator.agree(error, f"planning the save of step {step}")

    def _global_plan(self, planner: DefaultSavePlanner, gathered: list[Any]) -> list[_Part | None]:
        """Rank 0: torch's global plan, its pieces, and the commit record's DCP document."""
        plans, metadata = planner.create_global_plan([plan for plan, _ in gathered])
        pieces = plan_pieces(plans, 0)
        values: dict[str, Any] = {}
        for plan, (_, encoded) in zip(plans, gathered, strict=True):
            for item in plan.items:  # the value of the rank that keeps it after de-duplication
                if item.type == WriteItemType.BYTE_IO:
                    values[item.index.fqn] = encoded[item.index.fqn]
        self._attrs = {ATTR: metadata_json(metadata, pieces, values)}
        self._parts = parts = split_pieces(pieces, self.world_size)
        return [
            _Part(plan, parts.pieces[r] if r else (), parts.views[r])
            for r, plan in enumerate(plans)
        ]

    def _own_pieces(self, planner: DefaultSavePlanner, plan: SavePlan, part: _Part) -> list[Piece]:
        """The pieces this rank's writer is given (rank 0: every piece, the others' with no
        data; any other rank: its own), each with its chunk data as the source."""
        data: dict[tuple, torch.Tensor] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            offsets = tuple(int(o) for o in item.tensor_data.chunk.offsets)  # type: ignore[union-attr]
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"{item.index.fqn}: the planner gave {type(tensor).__name__}")
            check_has_data(tensor, item.index.fqn)
            data[(item.index.fqn, offsets)] = plain_data(tensor.detach(), item.index.fqn)
        empty: dict[torch.dtype, torch.Tensor] = {}  # one per dtype: never read or written
        pieces = []
        specs = self._parts.specs if self._parts is not None and self.rank == 0 else None
        for i, chunk in enumerate(part.pieces):
            spec = specs[i] if specs is not None else chunk.spec(self.world_size)
            if chunk.owner != self.rank:
                if spec.dtype not in empty:
                    empty[spec.dtype] = torch.empty(0, dtype=spec.dtype)
                pieces.append(Piece(spec, empty[spec.dtype]))
                continue
            tensor = data.pop((chunk.fqn, chunk.offsets), None)
            if tensor is None:
                raise CheckpointError(f"internal: no data planned for {chunk.fqn}")
            if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
                raise ConfigError(
                    f"{chunk.fqn}: the planner gave a {tensor.dtype} tensor of shape "
                    f"{list(tensor.shape)} for a chunk of {chunk.dtype} {list(chunk.sizes)}"
                )
            # A complex chunk as its real pairs ([Note: complex chunks] in zerostate.dcp.common).
            pieces.append(Piece(spec, stored_data(tensor).reshape(-1)))
        if data:
            raise CheckpointError(f"internal: no piece planned for {next(iter(data))[0]}")
        return pieces

    def snapshot(
        self, pieces: list[Piece], blocking: bool
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """Blocking: this rank's chunks as they are (on the host). Otherwise a copy into the
        staging buffers kept from save to save ([Note: reused staging buffers] in
        zerostate.dcp.staging), made now: the caller may change the state once save returns."""
        mine = {p.spec.name: p.source for p in pieces if p.source.numel()}
        if blocking:
            return {n: t.to("cpu").contiguous() for n, t in mine.items()}, None
        staged = self._staging.stage(mine)
        self._staged = list(staged.values())
        return staged, None

    def written(self) -> None:
        """The session is done with the snapshot: its staging buffers may serve the next save."""
        if self._staged:
            self._staging.release(self._staged)
            self._staged = []
