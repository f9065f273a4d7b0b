"""A save session: one collective save of an engine's state, from its arrival to its commit.

A session computes what the save needs once (the engine-state document, the state views,
this rank's pieces, the root) and runs the phases of [Note: failing together] in
zerostate.checkpoint: prepare (rank 0 checks the target), plan the frozen tensors, snapshot,
then write and commit on the caller's thread (blocking) or on the background thread (async).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerostate import jsonstate
from zerostate.checkpoint.async_save import BackgroundSaves, Piece, SaveHandle
from zerostate.checkpoint.frozen import RANK_STATE_KEY as FROZEN_KEY
from zerostate.checkpoint.frozen import adapter_attrs, reference_frozen
from zerostate.checkpoint.roots import EngineRoots
from zerostate.checkpoint.state import (
    check_stateful,
    digest,
    json_checked,
    rng_state,
    transformers_config,
)
from zerostate.checkpoint.tensor_parallel import saved_piece
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError, ConfigError, DistributedMismatchError
from zerostate.store import StepExistsError, TensorSpec
from zerostate.store.geometry import stored_layout
from zerostate.store.root import CheckpointRoot

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts

log = logging.getLogger(__name__)

# Codes ranks exchange before and during a save (see [Note: failing together]).
OK, FAILED, EXISTS, REFUSED, NEWER = 0, 1, 2, 3, 4

#: ``snapshot(pieces, blocking) -> (host shards, deferred copy or None)``.
Snapshot = Callable[[list[Piece], bool], tuple[dict[str, torch.Tensor], Callable[[], None] | None]]


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


def retain(root: CheckpointRoot, step: int, keep_last: int | None) -> None:
    """Retention after ``step`` committed; never fails the save."""
    # Partial steps older than the one just committed belong to crashed saves.
    try:
        root.prune(keep_last=keep_last, partial_below=step, saved=step)
    except Exception as exc:  # retention must not fail a good save
        log.warning("zerostate: retention in %s after step %d failed: %s", root.url, step, exc)


class SaveSession:
    """One call of ``engine.save``. Validates its arguments on construction (nothing
    collective yet); :meth:`run` is collective."""

    def __init__(
        self,
        parts: EngineParts,
        path: str,
        *,
        coordinator: Coordinator,
        roots: EngineRoots,
        saves: BackgroundSaves,
        snapshot: Snapshot,
        timeout_s: float,
        step: int | None,
        blocking: bool,
        client_state: Any,
        keep_last: int | None,
        storage_options: dict | None,
        progress: Callable[[int], None] | None,
        stateful: dict | None,
        allow_older_step: bool,
        tier: Any = None,
    ) -> None:
        self.parts, self.path, self.coordinator = parts, path, coordinator
        #: A :class:`~zerostate.checkpoint.tiers.MemorySave` for ``tier="memory"``, else None.
        self.tier = tier
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self._roots, self._saves, self._snapshot = roots, saves, snapshot
        self._timeout_s, self._blocking, self._progress = timeout_s, blocking, progress
        self._storage_options, self._keep_last = storage_options, keep_last
        self._allow_older_step = allow_older_step
        stateful = check_stateful(stateful, loading=False)
        # Encoded now, on the caller's thread: the objects keep changing after save() returns.
        self._objects = {
            name: jsonstate.encode(obj.state_dict(), f"stateful[{name!r}].state_dict()")
            for name, obj in stateful.items()
        }
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        step = int(parts.optimizer_steps if step is None else step)
        if step < 0 or step > 99_999_999:
            raise ConfigError(f"step must be in [0, 99999999], got {step}")
        self.step = step
        #: The engine-state document this save records (computed once).
        self.document = json_checked(parts.engine_state(), "engine state")
        self._attrs = {
            "engine": self.document,
            "client_state": json_checked(client_state, "client_state"),
            "saved_at_unix": time.time(),
            **adapter_attrs(parts.module),
        }
        model_config = transformers_config(parts.module)
        if model_config is not None:
            self._attrs["model_config"] = model_config  # consolidate writes it as config.json
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

    def run(self, start: float) -> SaveHandle:
        """Save; ``start``: when ``save`` was entered (for the handle's ``blocked_s``)."""
        root, save_id, latest, per_rank = self._prepare()
        step, error, copy = self.step, None, None
        if self.tier is not None:  # [Note: memory tier] in zerostate.checkpoint.tiers
            root, latest = self.tier.prepare(step, self._blocking, root), -1  # no references
        # Collective, never fails; ``latest``: rank 0's listing, so no rank lists again.
        frozen = reference_frozen(self, root, step, latest if latest >= 0 else None)
        try:
            if self.tier is not None:
                self.tier.check()  # what its preparation met, agreed below
            attrs, objects = self._attrs, self._objects
            rank_state = {"rng": rng_state()}
            if per_rank:  # see [Note: per-rank stateful objects]
                rank_state["stateful"] = {n: objects[n] for n in per_rank}
                attrs["stateful_per_rank"] = per_rank
            attrs["stateful"] = {n: v for n, v in objects.items() if n not in per_rank}
            if frozen.digests:
                rank_state[FROZEN_KEY] = frozen.digests
            pieces = [p for p in self.pieces if p.spec.name not in frozen.skipped]
            writer = root.writer(
                step,
                rank=self.rank,
                world_size=self.world_size,
                specs=[p.spec for p in pieces],
                attrs=attrs,
                rank_state=rank_state,
                timeout_s=self._timeout_s,
                progress=self._progress,
                save_id=f"{save_id:016x}",
                refs=frozen.refs,
            )
            shards, copy = self._snapshot(pieces, self._blocking)
        except Exception as exc:
            error = exc
        try:
            self.coordinator.agree(error, f"preparing save of step {step}")
        except BaseException:
            # Nothing will write this snapshot: run its copy so that the fence it holds is
            # released (else the next step would wait for it forever).
            if copy is not None:
                copy()
            raise
        if self.tier is not None and self.tier.background is not None:  # [Note: memory tier]
            finish = self.tier.finish_background
            run = lambda: finish(copy, writer, shards, step, self._keep_last)  # noqa: E731
            return self._saves.submit(run, step, self.path, start)
        if self.tier is not None:  # written, replicated and committed before save() returns
            self.tier.finish(self.coordinator, writer, shards, step)
            future = self.tier.persist_maybe(step, self._keep_last)
            return SaveHandle(step, self.path, future, time.perf_counter() - start)
        if self._blocking:
            self._write_and_commit(root, writer, shards)
            return SaveHandle(step, self.path, None, time.perf_counter() - start)
        return self._saves.submit(
            lambda: self._finish(root, writer, shards, copy), step, self.path, start
        )

    def _prepare(self) -> tuple[CheckpointRoot, int, int, list[str]]:
        """``(root, save id, latest committed step or -1, per-rank stateful names)``.

        [Note: failing together] Rank 0 checks the target and picks a save id, every rank
        finishes its previous save; one all-gather tells every rank the verdict of all
        before anyone writes a byte (the id lets rank 0 ignore stale manifests)."""
        step, objects = self.step, self._objects
        self.coordinator.arrive("save")
        code, save_id, latest, error, refusal = OK, 0, -1, None, None
        try:
            self._saves.wait()  # one save in flight; surfaces a previous background failure
            # The engine's root object of this location, opened by its first save or load
            # there ([Note: one root per location]); every part of the save uses it.
            root = self._roots.open(self.path, self._storage_options)
            if self.rank == 0:
                code, save_id, latest, refusal = self._check_root(root)
        except Exception as exc:  # reported to every rank below, then re-raised here
            code, error = FAILED, exc
        rows = self.coordinator.exchange([code, save_id, step, digest(sorted(objects)), latest])
        self.coordinator.raise_if_failed(
            error, [r[0] == FAILED for r in rows], f"preparing save of step {step}"
        )
        steps = [r[2] for r in rows]
        if len(set(steps)) > 1:
            raise DistributedMismatchError(
                f"ranks are saving different steps ({dict(enumerate(steps))}); every rank must "
                "call save() with the same step (the default, optimizer_steps, agrees)"
            )
        if len({r[3] for r in rows}) > 1:
            raise DistributedMismatchError(
                "ranks passed different stateful= names to save(); pass the same objects "
                "(by name) on every rank"
            )
        # Objects whose state is the same on every rank are saved once, in the commit
        # record; the others every rank keeps its own (see [Note: per-rank stateful objects]).
        names = sorted(objects)
        states = self.coordinator.exchange([digest(objects[n]) for n in names]) if names else []
        per_rank = [n for i, n in enumerate(names) if len({row[i] for row in states}) > 1]
        code, save_id, latest = rows[0][0], rows[0][1], rows[0][4]
        self._raise_verdict(code, save_id, refusal)
        return root, save_id, latest, per_rank

    def _raise_verdict(self, code: int, newer: int, refusal: str | None) -> None:
        path, step = self.path, self.step
        if code == REFUSED:
            raise ConfigError(refusal or f"rank 0 refused the save path {path!r}; see its error")
        if code == NEWER:
            raise ConfigError(
                f"{path} already holds committed step {newer}, newer than step {step} being "
                f"saved, and this engine did not load from {path}: it looks like another "
                "run's checkpoint, and a later load would resume that run's step "
                f"{newer}. Call engine.load({path!r}) first to continue that run, save "
                "into a new directory, or pass allow_older_step=True to save beside it"
            )
        if code == EXISTS:
            raise StepExistsError(
                f"step {step} is already committed in {path}; save under another step number "
                "or delete it first"
            )

    def _check_root(self, root: CheckpointRoot) -> tuple[int, int, int, str | None]:
        """Rank 0's save guard: ``(code, save id or the newer step, latest committed step
        or -1, refusal)`` from one listing of the root. The model check runs once per root
        per engine; a newer committed step is refused unless this engine loaded from or
        saved to the root (then it is this run's own, see [Note: save target])."""
        shapes, memory = None, root.memory
        if not memory.shapes_checked:
            shapes = {v.name: tuple(v.shape) for v in self.views if v.name.startswith("model/")}
        newer_ok = self._allow_older_step or memory.own
        check = root.check_save(self.step, model_shapes=shapes, newer_ok=newer_ok)
        latest = -1 if check.latest is None else check.latest
        if check.refusal is not None:
            return REFUSED, 0, latest, check.refusal
        memory.shapes_checked = True
        if check.newer is not None:
            return NEWER, check.newer, latest, None
        if check.exists:
            return EXISTS, 0, latest, None
        return OK, secrets.randbits(62), latest, None

    def _write_and_commit(self, root: CheckpointRoot, writer: Any, shards: dict) -> None:
        # Each phase ends in an agreement, so one rank's failure fails every rank at
        # once instead of leaving them polling storage until the commit timeout.
        step, error = self.step, None
        try:
            writer.write(shards)
        except Exception as exc:
            error = exc
        self.coordinator.agree(error, f"writing step {step}")
        try:
            writer.commit(wait=False)  # rank 0 writes the commit record
            if self.rank == 0:
                retain(root, step, self._keep_last)
        except Exception as exc:
            error = exc
        self.coordinator.agree(error, f"committing step {step}")
        root.memory.own = True

    def _finish(
        self, root: CheckpointRoot, writer: Any, shards: dict, copy: Callable[[], None] | None
    ) -> None:
        """The background thread's part of an async save."""
        try:
            if copy is not None:
                copy()
            writer.write(shards)
            writer.commit(wait=True)
        except Exception as exc:
            # No collectives on this thread: a note in storage stops the other ranks
            # waiting for a commit that cannot come (see [Note: failing together]).
            writer.abort(exc)
            raise
        # Only a committed step makes the root this run's own ([Note: save target]); a
        # failed save leaves the root's newest step another run's.
        root.memory.own = True
        if self.rank == 0:
            retain(root, self.step, self._keep_last)
