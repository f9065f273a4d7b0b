"""Engine checkpoints: collective save (blocking or async) and load at any world size.

The engine exposes its state as :class:`~zerostate.engine.ShardView` objects (one per
logical tensor: fp32 master weights, Adam moments, buffers); this module moves them to and
from the store. It owns no training state and calls no collective except one all-reduce
and one barrier per save and one barrier per load, on the engine's process group, through
:mod:`zerostate.dist.collectives`.

[Note: async save]
``save(..., blocking=False)`` splits a save in two. On the caller's thread it copies this
rank's owned ranges into host buffers that are reused from save to save (pinned, and
copied on a side CUDA stream, when the state lives on a GPU) and returns a
:class:`SaveHandle`. A single background thread then writes the chunks, waits for the
commit (coordinated through storage, see the store's commit protocol) and applies
retention. At most one save is in flight: a new save, a load, ``handle.wait()`` and
``engine.close()`` wait for it first and re-raise its error. A checkpointer that is
garbage-collected or still open at interpreter exit waits for its save in a finaliser and
prints a failure on stderr (it cannot raise there, and it must not end a process that
other code is still running in), so a failed background save is never silent.

[Note: failing together]
A save or load is collective, and one rank's failure must not leave the others waiting
for a commit record or inside a collective until a timeout. So every phase that can fail
on one rank ends in one small all-gather of an error flag (``Coordinator.agree``, in
zerostate.dist.coordinator): preparing a save
(rank 0's checks of the target, each rank's previous async save), writing (blocking saves),
committing, and reading a load. After it, either every rank goes on or every rank raises:
the failing rank its own error, the others a CheckpointError naming the failed rank(s).
Background (async) writes cannot use collectives: a rank whose part fails leaves an abort
note in the step's storage, which the others' commit polling sees at once (if the failing
storage refuses the note too, they give up at the commit timeout); each rank's error
surfaces at its next save, load, ``handle.wait()`` or ``close()``.

On a GPU the deferred copy runs on a side stream created on the state's device, inside the
background thread (a fresh thread's current device is 0, which is not every local rank's).

The package: :class:`Checkpointer` (here) is the engine's facade; ``save.py`` and ``load.py``
hold one session per call, ``roots.py`` the roots the engine keeps (one per location),
``async_save.py`` the snapshot fence, background writer and :class:`SaveHandle`,
``state.py`` the JSON state, RNG and model config, ``foreign.py`` the fitting of a peer's
step (DeepSpeed, DCP) to the loading engine, ``parts.py`` what the sessions see of an
engine ([Note: engine parts]), ``load_plan.py`` the checked plan of a load and its undo,
``source.py`` what a save writes ([Note: save sources]: the engine's state is one source,
``zerostate.save``'s DCP state another), ``frozen.py`` frozen tensors a save references
instead of rewriting, ``pretrained.py``
``load_pretrained``, ``peer_settings.py`` a peer's update settings compared at load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerostate.checkpoint.async_save import BackgroundSaves, Piece, SaveHandle, Snapshots
from zerostate.checkpoint.foreign import fit_foreign_step, open_any_step, regroup
from zerostate.checkpoint.load import LoadSession
from zerostate.checkpoint.roots import EngineRoots
from zerostate.checkpoint.save import DEFAULT_COMMIT_TIMEOUT_S, SaveSession, commit_timeout_s
from zerostate.checkpoint.source import EngineSource
from zerostate.checkpoint.state import (
    check_stateful,
    digest,
    json_checked,
    left_behind,
    saved_rng,
    transformers_config,
)
from zerostate.checkpoint.tier_load import load as load_tiers
from zerostate.checkpoint.tiers import TIERS, MemoryTiers
from zerostate.errors import CheckpointError, ConfigError
from zerostate.runtime.process_groups import watch_commit

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts

__all__ = [
    "DEFAULT_COMMIT_TIMEOUT_S",
    "CheckpointError",
    "Checkpointer",
    "SaveHandle",
    "fit_foreign_step",
    "open_any_step",
    "regroup",
    "transformers_config",
]

# The names this module had before it became a package.
_Piece = Piece
_digest = digest
_check_stateful = check_stateful
_json_checked = json_checked
_transformers_config = transformers_config
_left_behind = left_behind
_saved_rng = saved_rng
_open_any_step = open_any_step
_fit_foreign_step = fit_foreign_step
_regroup = regroup


class Checkpointer:
    """Saves and loads one engine's state. Created by the engine; use ``engine.save``.

    A thin facade: each call runs a :class:`~zerostate.checkpoint.save.SaveSession` or a
    :class:`~zerostate.checkpoint.load.LoadSession` over what lives as long as the engine
    (the background writer, the snapshot buffers and fence, the roots it used: one
    :class:`~zerostate.store.root.CheckpointRoot` per location, see [Note: one root per
    location] in zerostate.checkpoint.roots)."""

    def __init__(self, parts: EngineParts, *, timeout_s: float | None = None) -> None:
        #: The engine's state ([Note: engine parts] in zerostate.checkpoint.parts).
        self.parts = parts
        self.timeout_s = commit_timeout_s() if timeout_s is None else timeout_s
        # Under tensor parallelism the tp x dp_shard ranks of a replica save together
        # ([Note: tensor-parallel checkpoints] in zerostate.checkpoint.tensor_parallel).
        coordinator, world = parts.coordinator, parts.checkpoint_world
        if world is not None:
            coordinator = coordinator.over(world.group, world.rank, world.world_size)
        self.coordinator = coordinator.with_errors(CheckpointError, " and nothing was committed")
        self.saves = BackgroundSaves(self)
        self.snapshots = Snapshots()
        self.roots = EngineRoots()
        config = parts.config  # [Note: memory tier] in .tiers
        self.tiers = MemoryTiers(
            self.coordinator,
            directory=getattr(config, "memory_dir", None),
            keep_last=getattr(config, "memory_keep_last", 2),
            durable_every=getattr(config, "memory_durable_every", 10),
            timeout_s=self.timeout_s,
        )
        self._closed = False

    @property
    def rank(self) -> int:
        """This rank's rank in the steps it writes."""
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        """The world size of the steps it writes."""
        return self.coordinator.world_size

    @property
    def stall_s(self) -> float:
        """Seconds the training thread waited in :meth:`before_update` for async snapshots."""
        return self.snapshots.stall_s

    def _snapshot(
        self, pieces: list[Piece], blocking: bool
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        return self.snapshots.take(pieces, blocking, self.parts.module)

    def before_update(self) -> None:
        """Called before anything changes master weights or optimizer states: waits until
        an async save's snapshot has finished reading them ([Note: async save])."""
        self.snapshots.before_update()

    def settle(self) -> None:
        """Wait for the save in flight (re-raising its error) and for its snapshot: what a
        load runs first, inside its agreement."""
        self.wait()
        self.before_update()

    def save(
        self,
        path: str,
        *,
        step: int | None = None,
        blocking: bool = True,
        client_state: Any = None,
        keep_last: int | None = None,
        storage_options: dict | None = None,
        progress: Callable[[int], None] | None = None,
        stateful: dict | None = None,
        allow_older_step: bool = False,
        tier: str = "durable",
    ) -> SaveHandle:
        start = time.perf_counter()
        self._check_open()
        if tier not in TIERS:
            raise ConfigError(f"tier must be one of {TIERS}, got {tier!r}")
        memory = None
        if tier == "memory":  # [Note: memory tier] in zerostate.checkpoint.tiers
            memory = self.tiers.saving(self.roots.open(path, storage_options))
        source = EngineSource(
            self.parts,
            rank=self.rank,
            world_size=self.world_size,
            step=step,
            client_state=client_state,
            stateful=stateful,
            snapshot=self._snapshot,
        )
        session = SaveSession(
            source,
            path,
            coordinator=self.coordinator,
            roots=self.roots,
            saves=self.saves,
            timeout_s=self.timeout_s,
            blocking=blocking,
            keep_last=keep_last,
            storage_options=storage_options,
            progress=progress,
            allow_older_step=allow_older_step,
            tier=memory,
            persisting=self.tiers.wait,
        )
        return session.run(start)

    def skipped_save(
        self, path: str, step: int, blocking: bool, storage_options: dict | None
    ) -> SaveHandle:
        """The handle of a save this rank's replica does not write ([Note: one replica
        writes] in zerostate.runtime.process_groups): blocking, replica 0's verdict follows; async,
        the handle watches this engine's root for the step's commit."""
        if blocking:
            return SaveHandle(step, path, None, 0.0)
        root = self.roots.open(path, storage_options)
        watch = watch_commit(lambda: root.is_committed(step), f"step {step}", self.timeout_s)
        return SaveHandle(step, path, watch, 0.0)

    def load(
        self,
        path: str,
        *,
        step: int | None = None,
        storage_options: dict | None = None,
        strict: bool = True,
        stateful: dict | None = None,
        strict_state: bool = False,
    ) -> Any:
        self._check_open()

        def run(memory: Any, at: int | None) -> Any:  # memory: the memory tier's storage
            return self._load_session(
                path if memory is None else memory,
                at,
                None if memory is not None else storage_options,
                strict,
                stateful,
                strict_state,
            )

        # [Note: memory tier]: the newest step this node's memory, its peers' or the root has
        return load_tiers(
            self.tiers, self.roots.open(path, storage_options), step, run, self.settle
        )

    def _load_session(
        self,
        path: Any,
        step: int | None,
        storage_options: dict | None,
        strict: bool,
        stateful: dict | None,
        strict_state: bool,
    ) -> Any:
        session = LoadSession(
            self.parts,
            path,
            # [Note: nothing lands before every rank has read] in zerostate.checkpoint.load
            coordinator=self.coordinator.with_errors(
                CheckpointError, ", and nothing was loaded: this engine is as it was"
            ),
            roots=self.roots,
            settle=self.settle,
            step=step,
            storage_options=storage_options,
            strict=strict,
            stateful=stateful,
            strict_state=strict_state,
        )
        return session.run()

    def wait(self) -> None:
        """Wait for the save in flight (if any) and re-raise its error."""
        self.saves.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                "the engine was closed; save() and load() need an open engine (close() "
                "is for the end of training)"
            )

    def close(self) -> None:
        """Wait for the in-flight save, re-raise its error, stop the thread and release the
        roots; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.saves.close()
            self.tiers.close()
        finally:
            self.roots.close()
