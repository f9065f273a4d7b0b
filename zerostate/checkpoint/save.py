"""A save session: one collective save into the store, from its arrival to its commit.

What is saved comes from a source ([Note: save sources] in zerostate.checkpoint.source: an
engine's state for ``engine.save``, a DCP-contract state for ``zerostate.save``). The
session runs the phases of [Note: failing together] in zerostate.checkpoint: prepare (rank
0 checks the target and, where the source names no step, chooses it), the source's plan,
the frozen tensors, snapshot, then write and commit on the caller's thread (blocking) or on
the background thread (async), and retention.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerostate.checkpoint.async_save import BackgroundSaves, Piece, SaveHandle
from zerostate.checkpoint.frozen import RANK_STATE_KEY as FROZEN_KEY
from zerostate.checkpoint.frozen import reference_frozen
from zerostate.checkpoint.roots import EngineRoots
from zerostate.checkpoint.source import check_step
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import ConfigError, DistributedMismatchError
from zerostate.store import StepExistsError
from zerostate.store.root import CheckpointRoot

if TYPE_CHECKING:
    from zerostate.checkpoint.source import SaveSource

log = logging.getLogger(__name__)

# Codes ranks exchange before and during a save (see [Note: failing together]).
OK, FAILED, EXISTS, REFUSED, NEWER = 0, 1, 2, 3, 4

#: Default seconds a rank waits for the others while committing a step.
DEFAULT_COMMIT_TIMEOUT_S = 600.0


def commit_timeout_s() -> float:
    """Seconds a save waits for the other ranks' commit: the default, or what the
    environment sets (tests, schedulers with tight preemption)."""
    env = os.environ.get("ZEROSTATE_COMMIT_TIMEOUT_S")
    return float(env) if env else DEFAULT_COMMIT_TIMEOUT_S


class SaveSession:
    """One collective save of a :class:`~zerostate.checkpoint.source.SaveSource` into the
    store (``engine.save``, ``zerostate.save``). Validates its arguments on construction
    (nothing collective yet); :meth:`run` is collective."""

    def __init__(
        self,
        source: SaveSource,
        path: str,
        *,
        coordinator: Coordinator,
        roots: EngineRoots,
        saves: BackgroundSaves,
        timeout_s: float,
        blocking: bool,
        keep_last: int | None,
        storage_options: dict | None,
        progress: Callable[[int], None] | None,
        allow_older_step: bool,
        tier: Any = None,
        persisting: Callable[[], None] | None = None,
    ) -> None:
        self.source, self.path, self.coordinator = source, path, coordinator
        #: A :class:`~zerostate.checkpoint.tiers.MemorySave` for ``tier="memory"``, else None.
        self.tier = tier
        #: Waits for the memory tier's copy to a durable root in flight (re-raising its
        #: error); a durable save runs it first: its retention deletes the partial steps
        #: below its own, and the copy is one until its commit record is written.
        self._persisting = persisting
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self._roots, self._saves = roots, saves
        self._timeout_s, self._blocking, self._progress = timeout_s, blocking, progress
        self._storage_options, self._keep_last = storage_options, keep_last
        self._allow_older_step = allow_older_step
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        #: The step saved: the source's, or (None) rank 0's choice once :meth:`run` agreed it.
        self.step = check_step(source.step)

    @property
    def document(self) -> dict:
        """The source's engine-state document (what :func:`reference_frozen` reads)."""
        return self.source.document

    @property
    def pieces(self) -> list[Piece]:
        """The source's pieces of this rank."""
        return self.source.pieces

    def run(self, start: float) -> SaveHandle:
        """Save; ``start``: when ``save`` was entered (for the handle's ``blocked_s``)."""
        root, save_id, latest = self._prepare()
        step, error, copy = self.step, None, None
        self.source.plan(self.coordinator, step)  # raises on every rank or on none
        if self.tier is not None:  # [Note: memory tier] in zerostate.checkpoint.tiers
            root, latest = self.tier.prepare(step, self._blocking, root), -1  # no references
        # Collective, never fails; ``latest``: rank 0's listing, so no rank lists again.
        frozen = reference_frozen(self, root, step, latest if latest >= 0 else None)
        try:
            if self.tier is not None:
                self.tier.check()  # what its preparation met, agreed below
            rank_state = self.source.rank_state
            if frozen.digests:
                rank_state = {**(rank_state or {}), FROZEN_KEY: frozen.digests}
            pieces = [p for p in self.pieces if p.spec.name not in frozen.skipped]
            writer = root.writer(
                step,
                rank=self.rank,
                world_size=self.world_size,
                specs=[p.spec for p in pieces],
                attrs=self.source.attrs,
                rank_state=rank_state,
                timeout_s=self._timeout_s,
                progress=self._progress,
                save_id=f"{save_id:016x}",
                refs=frozen.refs,
                **self.source.writer_options,
            )
            shards, copy = self.source.snapshot(pieces, self._blocking)
        except Exception as exc:
            error = exc
        try:
            self.coordinator.agree(error, f"preparing save of step {step}")
        except BaseException:
            # Nothing will write this snapshot: run its copy so that the fence it holds is
            # released (else the next step would wait for it forever).
            if copy is not None:
                copy()
            self.source.written()
            raise
        if self.tier is not None and self.tier.background is not None:  # [Note: memory tier]
            finish, written = self.tier.finish_background, self.source.written

            def run() -> None:
                try:
                    finish(copy, writer, shards, step, self._keep_last)
                finally:
                    written()

            return self._saves.submit(run, step, self.path, start)
        if self.tier is not None:  # written, replicated and committed before save() returns
            try:
                self.tier.finish(self.coordinator, writer, shards, step)
            finally:
                self.source.written()
            future = self.tier.persist_maybe(step, self._keep_last)
            return SaveHandle(step, self.path, future, time.perf_counter() - start)
        if self._blocking:
            self._write_and_commit(root, writer, shards)
            return SaveHandle(step, self.path, None, time.perf_counter() - start)
        return self._saves.submit(
            lambda: self._finish(root, writer, shards, copy), step, self.path, start
        )

    def _prepare(self) -> tuple[CheckpointRoot, int, int]:
        """``(root, save id, latest committed step or -1)``; sets :attr:`step`.

        [Note: failing together] Rank 0 checks the target (choosing the step where the
        source names none) and picks a save id, every rank finishes its previous save; one
        all-gather tells every rank the verdict of all before anyone writes a byte (the id
        lets rank 0 ignore stale manifests)."""
        asked = -1 if self.step is None else self.step
        self.coordinator.arrive("save")
        code, save_id, latest, step, error, refusal = OK, 0, -1, asked, None, None
        try:
            self._saves.wait()  # one save in flight; surfaces a previous background failure
            if self.tier is None and self._persisting is not None:
                self._persisting()  # [Note: memory tier]: not a partial step to retention
            # The engine's root object of this location, opened by its first save or load
            # there ([Note: one root per location]); every part of the save uses it.
            root = self._roots.open(self.path, self._storage_options)
            if self.rank == 0:
                code, save_id, latest, step, refusal = self._check_root(root)
        except Exception as exc:  # reported to every rank below, then re-raised here
            code, error = FAILED, exc
        rows = self.coordinator.exchange([code, save_id, asked, latest, step])
        what = "preparing save" + ("" if asked < 0 else f" of step {asked}")
        self.coordinator.raise_if_failed(error, [r[0] == FAILED for r in rows], what)
        asks = [r[2] for r in rows]
        if len(set(asks)) > 1:
            shown = {r: (s if s >= 0 else None) for r, s in enumerate(asks)}
            raise DistributedMismatchError(
                f"ranks are saving different steps ({shown}); every rank must call save() "
                "with the same step (the default agrees)"
            )
        code, save_id, latest, self.step = rows[0][0], rows[0][1], rows[0][3], rows[0][4]
        self._raise_verdict(code, save_id, refusal)
        return root, save_id, latest

    def _raise_verdict(self, code: int, newer: int, refusal: str | None) -> None:
        path, step = self.path, self.step
        if code == REFUSED:
            raise ConfigError(refusal or f"rank 0 refused the save path {path!r}; see its error")
        if code == NEWER:
            raise ConfigError(
                f"{path} already holds committed step {newer}, newer than step {step} being "
                "saved, and this run did not load from or save to it: it looks like another "
                f"run's checkpoint, and a later load would resume that run's step {newer}. "
                f"{self.source.newer_hint.format(path=path)}, save into a new directory, or "
                "pass allow_older_step=True to save beside it"
            )
        if code == EXISTS:
            raise StepExistsError(
                f"step {step} is already committed in {path}; save under another step number "
                "or delete it first"
            )

    def _check_root(self, root: CheckpointRoot) -> tuple[int, int, int, int, str | None]:
        """Rank 0's save guard: ``(code, save id or the newer step, latest committed step
        or -1, the step, refusal)`` from one listing of the root. The model check runs once
        per root per engine (and not at all for a source without model shapes); a newer
        committed step is refused unless this run loaded from or saved to the root (then it
        is this run's own, see [Note: save target])."""
        shapes, memory = None, root.memory
        if not memory.shapes_checked:
            shapes = self.source.guard_shapes()
        newer_ok = self._allow_older_step or memory.own
        # A memory save writes nothing into the root: it leaves its partial steps alone (one
        # may be the memory tier's copy of an earlier step, still being written).
        clean = self.tier is None
        check = root.check_save(self.step, model_shapes=shapes, newer_ok=newer_ok, clean=clean)
        newest = self.tier.newest() if self.tier is not None and self.step is None else None
        if newest is not None and newest >= check.step:  # the memory tier is ahead
            check = root.check_save(newest + 1, model_shapes=shapes, newer_ok=newer_ok, clean=clean)
        latest = -1 if check.latest is None else check.latest
        if check.refusal is not None:
            return REFUSED, 0, latest, check.step, check.refusal
        memory.shapes_checked = True
        if check.newer is not None:
            return NEWER, check.newer, latest, check.step, None
        if check.exists:
            return EXISTS, 0, latest, check.step, None
        return OK, secrets.randbits(62), latest, check.step, None

    def _write_and_commit(self, root: CheckpointRoot, writer: Any, shards: dict) -> None:
        # Each phase ends in an agreement, so one rank's failure fails every rank at
        # once instead of leaving them polling storage until the commit timeout.
        step, error = self.step, None
        try:
            writer.write(shards)
        except Exception as exc:
            error = exc
        finally:
            self.source.written()
        self.coordinator.agree(error, f"writing step {step}")
        try:
            writer.commit(wait=False)  # rank 0 writes the commit record
            if self.rank == 0:
                root.retain(step, self._keep_last)
        except Exception as exc:
            error = exc
        self.coordinator.agree(error, f"committing step {step}")
        root.memory.own = True

    def _finish(
        self, root: CheckpointRoot, writer: Any, shards: dict, copy: Callable[[], None] | None
    ) -> None:
        """The background thread's part of an async save."""
        try:
            try:
                if copy is not None:
                    copy()
                writer.write(shards)
            finally:
                self.source.written()
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
            root.retain(self.step, self._keep_last)
