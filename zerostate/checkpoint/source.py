"""What a save session writes, as a small typed source: the engine's state is one source,
a DCP-contract state (``zerostate.save``) another.

[Note: save sources]
One session (zerostate.checkpoint.save) runs every save into the store: the save guard,
failing together, the snapshot fence and background writer, the memory tier, retention.
What differs between an engine's save and ``zerostate.save`` is only what the step holds,
and a :class:`SaveSource` says exactly that: this rank's pieces (one 1-D tensor per
:class:`~zerostate.store.TensorSpec`), the commit record's ``attrs``, this rank's
``rank_state``, the step it saves by default, the facts the save guard checks, and how the
pieces are copied for an async save. A source may have to agree with the other ranks on
what the step holds (which stateful objects are per rank; DCP's global plan): the session
calls :meth:`SaveSource.plan` once the target is agreed and before anything is written.
The engine's source (:class:`EngineSource`) is built from its parts ([Note: engine
parts]); the DCP one lives in zerostate.dcp.source.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from zerostate import jsonstate
from zerostate.checkpoint.async_save import Piece
from zerostate.checkpoint.frozen import adapter_attrs
from zerostate.checkpoint.state import (
    check_stateful,
    digest,
    json_checked,
    rng_state,
    transformers_config,
)
from zerostate.checkpoint.tensor_parallel import saved_piece
from zerostate.errors import CheckpointError, ConfigError, DistributedMismatchError
from zerostate.store import TensorSpec
from zerostate.store.geometry import stored_layout

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts
    from zerostate.dist.coordinator import Coordinator

__all__ = ["EngineSource", "SaveSource", "Snapshot", "owned_pieces"]

#: ``snapshot(pieces, blocking) -> (host shards, deferred copy or None)``.
Snapshot = Callable[[list[Piece], bool], tuple[dict[str, torch.Tensor], Callable[[], None] | None]]


class SaveSource(Protocol):
    """What one save writes ([Note: save sources])."""

    step: int | None
    """The step to save; None: the one after the newest committed (rank 0 lists the root)."""
    document: dict
    """The engine-state document of the step (its ``frozen`` names are referenced, not
    rewritten, where an earlier step holds them); ``{}`` for other sources."""
    newer_hint: str
    """How to go on when the root holds a newer step of another run (the save guard)."""

    def guard_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Rank 0: the ``model/`` tensor shapes the save guard compares with the root's
        latest step, or None to skip that check ([Note: save target])."""
        ...

    def plan(self, coordinator: Coordinator, step: int) -> None:
        """Collective, once the target is agreed: settle what the step holds. It raises
        on every rank together or on none (a rank that fails still takes part in every
        collective, then all raise)."""
        ...

    @property
    def pieces(self) -> list[Piece]:
        """This rank's pieces, in a fixed order (after :meth:`plan`)."""
        ...

    @property
    def attrs(self) -> dict:
        """The commit record's ``attrs`` (rank 0's are committed; after :meth:`plan`)."""
        ...

    @property
    def rank_state(self) -> dict | None:
        """This rank's manifest state (after :meth:`plan`), or None."""
        ...

    @property
    def writer_options(self) -> dict[str, Any]:
        """Further ``StepWriter`` keywords of this rank (after :meth:`plan`): the row views
        of a rank given only its own specs, and rank 0's digests of theirs ([Note: row
        views] in zerostate.store.rows); ``{}`` where every rank has every spec."""
        ...

    def snapshot(
        self, pieces: list[Piece], blocking: bool
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """Host tensors to write for ``pieces``, and a copy left for the background thread
        (or None): see [Note: async save] in zerostate.checkpoint."""
        ...

    def written(self) -> None:
        """The session is done with the snapshot (written, or the save failed)."""
        ...


def owned_pieces(views: list[Any], rank: int, world_size: int) -> list[Piece]:
    """This rank's owned slice of every view (empty where it owns nothing); a view with a
    tp x dp layout gives its padded piece ([Note: tensor-parallel checkpoints] in
    zerostate.checkpoint.tensor_parallel)."""
    pieces = []
    for view in views:
        if view.mesh is not None:
            layout = stored_layout(view.mesh, world_size, view.name)
            spec = TensorSpec(
                view.name, tuple(view.shape), view.dtype, layout, view.attrs, mesh=view.mesh
            )
            lo, hi = layout.owned_range(rank)
            source = saved_piece(view, hi - lo) if view.piece is not None and hi > lo else None
            pieces.append(Piece(spec, source if source is not None else view.local[:0]))
            continue
        lo, hi = view.layout.owned_range(rank)
        start = lo - view.local_start
        if hi > lo and not (0 <= start and hi - view.local_start <= view.local.numel()):
            raise CheckpointError(
                f"internal: view {view.name} holds [{view.local_start}, "
                f"{view.local_start + view.local.numel()}) but rank {rank} owns [{lo}, {hi})"
            )
        source = view.local.reshape(-1)[start : start + (hi - lo)] if hi > lo else None
        spec = TensorSpec(view.name, tuple(view.shape), view.dtype, view.layout, view.attrs)
        pieces.append(Piece(spec, source if source is not None else view.local[:0]))
    return pieces


class EngineSource:
    """An engine's state as a save source ([Note: save sources]): its state views, its
    engine-state document, the ``stateful=`` objects and ``client_state``, the model's
    config and adapters. Validates on construction (nothing collective yet)."""

    newer_hint = "Call engine.load({path!r}) first to continue that run"

    def __init__(
        self,
        parts: EngineParts,
        *,
        rank: int,
        world_size: int,
        step: int | None,
        client_state: Any,
        stateful: dict | None,
        snapshot: Snapshot,
    ) -> None:
        self.parts, self.rank, self.world_size = parts, rank, world_size
        self._snapshot = snapshot
        stateful = check_stateful(stateful, loading=False)
        # Encoded now, on the caller's thread: the objects keep changing after save() returns.
        self._objects = {
            name: jsonstate.encode(obj.state_dict(), f"stateful[{name!r}].state_dict()")
            for name, obj in stateful.items()
        }
        self.step = int(parts.optimizer_steps if step is None else step)
        #: The engine-state document this save records (computed once).
        self.document = json_checked(parts.engine_state(), "engine state")
        self._attrs = {
            "engine": self.document,
            # Encoded now as well: a non-blocking save used to write the caller's dict as it
            # was when the write ran, changes made after save() returned included.
            "client_state": jsonstate.encode(client_state, "client_state"),
            "saved_at_unix": time.time(),
            **adapter_attrs(parts.module),
        }
        model_config = transformers_config(parts.module)
        if model_config is not None:
            self._attrs["model_config"] = model_config  # consolidate writes it as config.json
        self._rank_state: dict = {}
        self._views: list[Any] | None = None
        self._pieces: list[Piece] | None = None

    @property
    def views(self) -> list[Any]:
        """The engine's state views, listed once per save."""
        if self._views is None:
            self._views = self.parts.state_views()
        return self._views

    @property
    def pieces(self) -> list[Piece]:
        """This rank's owned slice of every view, computed once per save."""
        if self._pieces is None:
            self._pieces = owned_pieces(self.views, self.rank, self.world_size)
        return self._pieces

    @property
    def attrs(self) -> dict:
        return self._attrs

    @property
    def writer_options(self) -> dict[str, Any]:
        return {}  # every rank places its rows from every spec

    @property
    def rank_state(self) -> dict:
        return self._rank_state

    def guard_shapes(self) -> dict[str, tuple[int, ...]]:
        return {v.name: tuple(v.shape) for v in self.views if v.name.startswith("model/")}

    def plan(self, coordinator: Coordinator, step: int) -> None:
        """Objects whose state is the same on every rank are saved once, in the commit
        record; the others every rank keeps its own (see [Note: per-rank stateful
        objects] in zerostate.checkpoint.state). Two small exchanges, then every rank
        raises together or none does."""
        objects = self._objects
        names = sorted(objects)
        rows = coordinator.exchange([digest(names)])
        if len({r[0] for r in rows}) > 1:
            raise DistributedMismatchError(
                "ranks passed different stateful= names to save(); pass the same objects "
                "(by name) on every rank"
            )
        states = coordinator.exchange([digest(objects[n]) for n in names]) if names else []
        per_rank = [n for i, n in enumerate(names) if len({row[i] for row in states}) > 1]
        self._rank_state = {"rng": rng_state()}
        if per_rank:
            self._rank_state["stateful"] = {n: objects[n] for n in per_rank}
            self._attrs["stateful_per_rank"] = per_rank
        self._attrs["stateful"] = {n: v for n, v in objects.items() if n not in per_rank}

    def snapshot(
        self, pieces: list[Piece], blocking: bool
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        return self._snapshot(pieces, blocking)

    def written(self) -> None:
        """Nothing to release: the snapshot buffers live as long as the checkpointer."""


def check_step(step: int | None) -> int | None:
    """``step`` after checking it is a step number the store holds (None passes)."""
    if step is not None and not 0 <= step <= 99_999_999:
        raise ConfigError(f"step must be in [0, 99999999], got {step}")
    return step
