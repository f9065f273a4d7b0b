"""Engine checkpoints: collective save (blocking or async) and load at any world size.

The engine exposes its state as :class:`~zerostate.engine.ShardView` objects (one per
logical tensor: fp32 master weights, Adam moments, buffers); this module moves them to and
from the store. It owns no training state and calls no collective except one all-reduce
and one barrier per save and one barrier per load, on the engine's process group, through
:mod:`zerostate.collectives`.

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
on one rank ends in one small all-gather of an error flag (``_agree``): preparing a save
(rank 0's checks of the target, each rank's previous async save), writing (blocking saves),
committing, and reading a load. After it, either every rank goes on or every rank raises:
the failing rank its own error, the others a CheckpointError naming the failed rank(s).
Background (async) writes cannot use collectives: a rank whose part fails leaves an abort
note in the step's storage, which the others' commit polling sees at once (if the failing
storage refuses the note too, they give up at the commit timeout); each rank's error
surfaces at its next save, load, ``handle.wait()`` or ``close()``.

On a GPU the deferred copy runs on a side stream created on the state's device, inside the
background thread (a fresh thread's current device is 0, which is not every local rank's).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zerostate import collectives, jsonstate, peer_settings
from zerostate.errors import (
    CheckpointError,
    ConfigError,
    DistributedMismatchError,
    ZerostateError,
)
from zerostate.frozen import RANK_STATE_KEY as FROZEN_KEY
from zerostate.frozen import adapter_attrs, plan_frozen
from zerostate.store import StepExistsError, TensorSpec
from zerostate.store.root import CheckpointRoot
from zerostate.store.sources import open_source

log = logging.getLogger(__name__)

# Codes ranks exchange before and during a save (see [Note: failing together]).
_OK, _FAILED, _EXISTS, _REFUSED, _NEWER = 0, 1, 2, 3, 4

#: Default seconds a rank waits for the others while committing a step.
DEFAULT_COMMIT_TIMEOUT_S = 600.0


class _Inflight:
    """The save in flight, shared with the finaliser (which must not hold the
    checkpointer, or the checkpointer could never be collected)."""

    __slots__ = ("handle", "executor")

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None
        self.executor: ThreadPoolExecutor | None = None


def _report_unfinished(state: _Inflight) -> None:
    """Finaliser: let an unfinished async save finish and report its failure on stderr."""
    handle, state.handle = state.handle, None
    try:
        if handle is not None:
            handle.wait()
    except BaseException as exc:  # noqa: BLE001 - a finaliser can only report
        print(
            f"zerostate: background checkpoint save of step {handle.step} to {handle.path} "
            f"failed: {exc!r}; call engine.close() to get this as an exception",
            file=sys.stderr,
        )
        sys.stderr.flush()
    finally:
        if state.executor is not None:
            state.executor.shutdown(wait=False)
            state.executor = None


class SaveHandle:
    """A save in flight (or done). ``wait()`` returns once the step is committed."""

    def __init__(self, step: int, path: str, future: Future | None, blocked_s: float) -> None:
        self.step = step
        self.path = path
        self._future = future
        #: Seconds the caller's thread spent inside ``save`` (snapshot and setup).
        self.blocked_s = blocked_s

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; re-raise the background error if the save failed."""
        if self._future is not None:
            self._future.result(timeout=timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"


@dataclass(frozen=True, slots=True)
class _Piece:
    """One logical tensor this rank writes: the owned slice of a view."""

    spec: TensorSpec
    source: torch.Tensor  # 1-D slice of the live tensor (may be on an accelerator)


def _digest(value: Any) -> int:
    """A 63-bit fingerprint of a JSON value, for comparing it across ranks."""
    raw = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def _check_stateful(stateful: Any, *, loading: bool) -> dict:
    if stateful is None:
        return {}
    if not isinstance(stateful, dict) or not all(isinstance(k, str) for k in stateful):
        raise ConfigError("stateful must be a dict of {name: object with state_dict()}")
    method = "load_state_dict" if loading else "state_dict"
    for name, obj in stateful.items():
        if not callable(getattr(obj, method, None)):
            raise ConfigError(
                f"stateful[{name!r}] ({type(obj).__name__}) has no {method}(); pass objects "
                "with state_dict() and load_state_dict(), such as LR schedulers"
            )
    return stateful


def _json_checked(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serialisable (dicts, lists, str, int, float, bool, None): {exc}"
        ) from exc
    return value


def _transformers_config(module: Any) -> dict | None:
    """A Hugging Face model's ``config.json`` content (what ``from_pretrained`` needs beside
    the weights), or None for other models."""
    module = getattr(module, "_orig_mod", module)  # torch.compile
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json) or not callable(getattr(module, "save_pretrained", None)):
        return None
    try:
        data = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError) as exc:
        log.warning("zerostate: not recording the model's config (not JSON): %s", exc)
        return None
    if isinstance(data, dict) and not data.get("architectures"):
        data["architectures"] = [type(module).__name__]  # as save_pretrained records it
    return data if isinstance(data, dict) else None


def _left_behind(st: Any, stateful: dict, world_size: int) -> list[str]:
    """What step ``st`` saved that a load with ``stateful`` at ``world_size`` does not restore."""
    shared, per_rank = st.attrs.get("stateful"), st.attrs.get("stateful_per_rank")
    saved = {n for n in shared if isinstance(n, str)} if isinstance(shared, dict) else set()
    if isinstance(per_rank, list):
        saved |= {n for n in per_rank if isinstance(n, str)}
    left = [f"stateful[{name!r}]" for name in sorted(saved - set(stateful))]
    if st.world_size != world_size and _saved_rng(st):
        left.append(
            f"RNG states of {st.world_size} ranks (restored only at the same world size; "
            f"this run has {world_size})"
        )
    return left


def _saved_rng(st: Any) -> bool:
    """Whether step ``st`` holds RNG states: every zerostate save keeps each rank's (in its
    manifest, or as ``rng/`` tensors in format 1); a peer's step (DeepSpeed, DCP) is read
    without them."""
    state = st.attrs.get("engine")
    if not (isinstance(state, dict) and state.get("source") in ("deepspeed", "dcp")):
        return True
    return any(name.startswith("rng/") for name in st.tensors)


class Checkpointer:
    """Saves and loads one engine's state. Created by the engine; use ``engine.save``."""

    def __init__(self, engine: Any, *, timeout_s: float | None = None) -> None:
        self.engine = engine
        if timeout_s is None:
            # The environment may shorten it (tests, schedulers with tight preemption).
            env = os.environ.get("ZEROSTATE_COMMIT_TIMEOUT_S")
            timeout_s = float(env) if env else DEFAULT_COMMIT_TIMEOUT_S
        self.timeout_s = timeout_s
        self._state = _Inflight()
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._snapshot_ready = threading.Event()
        self._snapshot_ready.set()
        self._checked_roots: set[str] = set()  # see [Note: save target] in store/root.py
        # Roots this engine loaded from or committed to: saving an older step there is
        # resuming or rewinding this run, not landing beside another run's steps.
        self._own_roots: set[str] = set()
        #: Seconds the training thread waited in before_update() for async snapshots.
        self.stall_s = 0.0
        self._closed = False
        self._finalizer = weakref.finalize(self, _report_unfinished, self._state)

    # ----------------------------------------------------------------- helpers
    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def _barrier(self) -> None:
        collectives.barrier(group=self.engine.group)

    def _exchange(self, row: list[int]) -> list[list[int]]:
        return collectives.exchange(
            row, group=self.engine.group, world_size=self.world_size, device=self.engine.device
        )

    def _agree(self, error: BaseException | None, what: str) -> None:
        """See [Note: failing together]: every rank learns whether any rank failed."""
        collectives.agree(
            error,
            what,
            group=self.engine.group,
            rank=self.rank,
            world_size=self.world_size,
            device=self.engine.device,
            error_cls=CheckpointError,
            note=" and nothing was committed",
        )

    def _raise_if_failed(self, error: BaseException | None, failed: list[bool], what: str) -> None:
        if error is not None:
            raise error
        ranks = [r for r, bad in enumerate(failed) if bad]
        if ranks:
            raise CheckpointError(
                f"{what} failed on rank(s) {ranks} (see the error rank {ranks[0]} raised); "
                f"rank {self.rank}'s part succeeded and nothing was committed"
            )

    @staticmethod
    def _rng_state() -> dict:
        """This rank's RNG states, JSON-encoded for the manifest's per-rank slot."""
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state()
        return jsonstate.encode(states, "RNG state")

    def _pieces(self) -> list[_Piece]:
        pieces = []
        for view in self.engine.state_views():
            lo, hi = view.layout.owned_range(self.rank)
            start = lo - view.local_start
            if hi > lo and not (0 <= start and hi - view.local_start <= view.local.numel()):
                raise CheckpointError(
                    f"internal: view {view.name} holds [{view.local_start}, "
                    f"{view.local_start + view.local.numel()}) but rank {self.rank} owns "
                    f"[{lo}, {hi})"
                )
            source = view.local.reshape(-1)[start : start + (hi - lo)] if hi > lo else None
            spec = TensorSpec(view.name, tuple(view.shape), view.dtype, view.layout)
            pieces.append(_Piece(spec, source if source is not None else view.local[:0]))
        return pieces

    def _host_buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != src.numel() or buf.dtype != src.dtype:
            buf = torch.empty(src.numel(), dtype=src.dtype, pin_memory=src.is_cuda)
            self._buffers[name] = buf
        return buf

    def _snapshot(
        self, pieces: list[_Piece], blocking: bool
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """Host tensors for this rank's owned ranges, and the copy that fills them.

        Buffers and RNG states can change in any forward pass, so they are copied now. The
        large states (master weights, Adam moments) change only inside the optimizer step;
        their copy is returned as a function for the background thread, and the engine's
        next step waits for it (:meth:`before_update`). See [Note: async save].
        """
        shards: dict[str, torch.Tensor] = {}
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Storage the user can reach and change between save() and the next step (fp32
        # masters are views of the module's own parameters at stages 0-2): copied now, so
        # the step holds the values as of save(), whatever the caller does next.
        visible = {
            p.untyped_storage().data_ptr()
            for p in self.engine.module.parameters()
            if p.untyped_storage().nbytes()
        }
        for piece in pieces:
            src, name = piece.source, piece.spec.name
            if src.numel() == 0:
                continue
            if blocking and not src.is_cuda:
                shards[name] = src.contiguous()  # written before save() returns: no copy
                continue
            buf = self._host_buffer(name, src)
            now = blocking or name.startswith(("buffers/", "rng/"))
            if now or src.untyped_storage().data_ptr() in visible:
                buf.copy_(src)
            else:
                deferred.append((buf, src))
            shards[name] = buf
        if not deferred:
            return shards, None
        event = None
        device = next((src.device for _, src in deferred if src.is_cuda), None)
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self._snapshot_ready.clear()

        def copy() -> None:
            try:
                if event is not None:
                    # On this thread the current device is 0; the stream must live on the
                    # state's device or the copy is not ordered after the recorded event.
                    with torch.cuda.device(device):
                        stream = torch.cuda.Stream(device=device)
                        stream.wait_event(event)  # copies see the state as of save()
                        with torch.cuda.stream(stream):
                            for buf, src in deferred:
                                buf.copy_(src, non_blocking=True)
                        stream.synchronize()
                else:
                    for buf, src in deferred:
                        buf.copy_(src)
            finally:
                self._snapshot_ready.set()

        return shards, copy

    def before_update(self) -> None:
        """Called by the engine before it changes master weights or optimizer states:
        waits until an async save's snapshot has finished reading them."""
        if not self._snapshot_ready.is_set():
            t0 = time.perf_counter()
            self._snapshot_ready.wait()
            self.stall_s += time.perf_counter() - t0

    # -------------------------------------------------------------------- save
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
    ) -> SaveHandle:
        start = time.perf_counter()
        self._check_open()
        stateful = _check_stateful(stateful, loading=False)
        # Encoded now, on the caller's thread: the objects keep changing after save() returns.
        objects = {
            name: jsonstate.encode(obj.state_dict(), f"stateful[{name!r}].state_dict()")
            for name, obj in stateful.items()
        }
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        step = int(self.engine.optimizer_steps if step is None else step)
        if step < 0 or step > 99_999_999:
            raise ConfigError(f"step must be in [0, 99999999], got {step}")
        attrs = {
            "engine": _json_checked(self.engine.engine_state(), "engine state"),
            "client_state": _json_checked(client_state, "client_state"),
            "saved_at_unix": time.time(),
            **adapter_attrs(self.engine.module),
        }
        model_config = _transformers_config(self.engine.module)
        if model_config is not None:
            attrs["model_config"] = model_config  # consolidate writes it as config.json
        # [Note: failing together] Rank 0 checks the target and picks a save id, every rank
        # finishes its previous save; one all-gather tells every rank the verdict of all
        # before anyone writes a byte (the id lets rank 0 ignore stale manifests).
        self._arrive("save")
        code, save_id, latest, error, refusal = _OK, 0, -1, None, None
        try:
            self.wait()  # one save in flight; surfaces a previous background failure
            # The root is opened once, here, and every part of the save uses it.
            root = CheckpointRoot.open(path, storage_options)
            if self.rank == 0:
                code, save_id, latest, refusal = self._check_root(root, step, allow_older_step)
        except Exception as exc:  # reported to every rank below, then re-raised here
            code, error = _FAILED, exc
        rows = self._exchange([code, save_id, step, _digest(sorted(objects)), latest])
        self._raise_if_failed(
            error, [r[0] == _FAILED for r in rows], f"preparing save of step {step}"
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
        states = self._exchange([_digest(objects[n]) for n in names]) if names else []
        per_rank = [n for i, n in enumerate(names) if len({row[i] for row in states}) > 1]
        code, save_id, latest = rows[0][0], rows[0][1], rows[0][4]
        if code == _REFUSED:
            raise ConfigError(refusal or f"rank 0 refused the save path {path!r}; see its error")
        if code == _NEWER:
            raise ConfigError(
                f"{path} already holds committed step {save_id}, newer than step {step} being "
                f"saved, and this engine did not load from {path}: it looks like another "
                "run's checkpoint, and a later load would resume that run's step "
                f"{save_id}. Call engine.load({path!r}) first to continue that run, save "
                "into a new directory, or pass allow_older_step=True to save beside it"
            )
        if code == _EXISTS:
            raise StepExistsError(
                f"step {step} is already committed in {path}; save under another step number "
                "or delete it first"
            )
        # Collective, never fails; ``latest``: rank 0's listing, so no rank lists again.
        frozen = plan_frozen(self, root, step, latest if latest >= 0 else None)
        try:
            rank_state = {"rng": self._rng_state()}
            if per_rank:  # see [Note: per-rank stateful objects]
                rank_state["stateful"] = {n: objects[n] for n in per_rank}
                attrs["stateful_per_rank"] = per_rank
            attrs["stateful"] = {n: v for n, v in objects.items() if n not in per_rank}
            if frozen.digests:
                rank_state[FROZEN_KEY] = frozen.digests
            pieces = [p for p in self._pieces() if p.spec.name not in frozen.skipped]
            writer = root.writer(
                step,
                rank=self.rank,
                world_size=self.world_size,
                specs=[p.spec for p in pieces],
                attrs=attrs,
                rank_state=rank_state,
                timeout_s=self.timeout_s,
                progress=progress,
                save_id=f"{save_id:016x}",
                refs=frozen.refs,
            )
            shards, copy = self._snapshot(pieces, blocking)
        except Exception as exc:
            error = exc
        self._agree(error, f"preparing save of step {step}")

        if blocking:
            # Each phase ends in an agreement, so one rank's failure fails every rank at
            # once instead of leaving them polling storage until the commit timeout.
            try:
                writer.write(shards)
            except Exception as exc:
                error = exc
            self._agree(error, f"writing step {step}")
            try:
                writer.commit(wait=False)  # rank 0 writes the commit record
                if self.rank == 0:
                    self._retain(root, step, keep_last)
            except Exception as exc:
                error = exc
            self._agree(error, f"committing step {step}")
            self._own_roots.add(root.location)
            return SaveHandle(step, path, None, time.perf_counter() - start)

        def finish() -> None:
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
            self._own_roots.add(root.location)
            if self.rank == 0:
                self._retain(root, step, keep_last)

        if self._state.executor is None:
            self._state.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zs-save")
        future = self._state.executor.submit(finish)
        handle = SaveHandle(step, path, future, time.perf_counter() - start)
        with self._lock:
            self._state.handle = handle
        return handle

    def _check_root(
        self, root: CheckpointRoot, step: int, allow_older_step: bool
    ) -> tuple[int, int, int, str | None]:
        """Rank 0's save guard: ``(code, save id or the newer step, latest committed step
        or -1, refusal)`` from one listing of the root. The model check runs once per root
        per engine; a newer committed step is refused unless this engine loaded from or
        saved to the root (then it is this run's own, see [Note: save target])."""
        shapes = None
        if root.location not in self._checked_roots:
            views = self.engine.state_views()
            shapes = {v.name: tuple(v.shape) for v in views if v.name.startswith("model/")}
        newer_ok = allow_older_step or root.location in self._own_roots
        check = root.check_save(step, model_shapes=shapes, newer_ok=newer_ok)
        latest = -1 if check.latest is None else check.latest
        if check.refusal is not None:
            return _REFUSED, 0, latest, check.refusal
        self._checked_roots.add(root.location)
        if check.newer is not None:
            return _NEWER, check.newer, latest, None
        if check.exists:
            return _EXISTS, 0, latest, None
        return _OK, secrets.randbits(62), latest, None

    def _arrive(self, what: str) -> None:
        """See [Note: arrival deadline] in zerostate.collectives."""
        collectives.arrive(
            what,
            group=self.engine.group,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.engine.config.collective_timeout_s,
        )

    def _remember_root(self, path: str) -> None:
        from zerostate.store.storage import canonical_location

        try:
            self._own_roots.add(canonical_location(path))
        except ZerostateError:
            pass

    @staticmethod
    def _retain(root: CheckpointRoot, step: int, keep_last: int | None) -> None:
        # Partial steps older than the one just committed belong to crashed saves.
        try:
            root.prune(keep_last=keep_last, partial_below=step, saved=step)
        except Exception as exc:  # retention must not fail a good save
            log.warning("zerostate: retention in %s after step %d failed: %s", root.url, step, exc)

    def wait(self) -> None:
        with self._lock:
            handle, self._state.handle = self._state.handle, None
        if handle is not None:
            handle.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                "the engine was closed; save() and load() need an open engine (close() "
                "is for the end of training)"
            )

    def close(self) -> None:
        """Wait for the in-flight save, re-raise its error, stop the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._state.executor is not None:
                self._state.executor.shutdown(wait=True)
                self._state.executor = None
            self._finalizer.detach()

    # -------------------------------------------------------------------- load
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
        stateful = _check_stateful(stateful, loading=True)
        self._arrive("load")
        error, st, restore, left, read_whole, undo, plan = None, None, None, [], set(), None, None
        try:
            self.wait()
            self.before_update()
            st, document = _open_any_step(self.engine, path, step, storage_options)
            # [Note: planned load]: every check runs before anything in the engine changes.
            plan = self.engine.plan_load(
                document, st.tensors, strict=strict, where=path, step=st.step
            )
            restore = self._saved_rank_state(st, stateful, strict)
            left = _left_behind(st, stateful, self.world_size)
            if left and strict_state:
                raise CheckpointError(
                    f"step {st.step} in {path} holds state this load was not asked to "
                    f"restore: {'; '.join(left)} (strict_state=True)"
                )
            undo = self.engine.apply_load(plan)
            read_whole = self._read_tensors(st)
        except Exception as exc:
            error = exc
        try:
            # Every rank must know before the collectives below whether all ranks read
            # their part ([Note: failing together]); a rank's read error fails every rank.
            try:
                self._agree(error, f"loading {path}")
            except BaseException:
                if undo is not None:
                    undo()
                raise
            self.engine.refresh_from_masters(read_whole)
            rng, objects = restore
            self._restore_rng(st, rng)
            for name, value in objects.items():
                stateful[name].load_state_dict(value)
            self._barrier()
        finally:
            if st is not None:
                st.close()  # its read threads wait for the next load ([Note: pool reuse])
        self._remember_root(path)
        if self.rank == 0:  # [Note: a peer's update settings]
            for warning in peer_settings.differences(st.attrs, self.engine.config, path):
                log.warning("zerostate: %s", warning)
            for group in plan.optimizer.mixed:
                log.warning(
                    "zerostate: load(strict=False) from %s step %d kept this engine's "
                    "hyperparameters for %s: its parameters were saved in different groups "
                    "([Note: groups by membership] in zerostate.optim)",
                    path,
                    st.step,
                    group,
                )
        if left and self.rank == 0:
            log.warning(
                "zerostate: loaded step %d from %s but left saved state unrestored: %s. "
                "Pass it to load(stateful={...}) to restore it, or strict_state=True to make "
                "this an error",
                st.step,
                path,
                "; ".join(left),
            )
        return st.attrs.get("client_state")

    def _read_tensors(self, st: Any) -> set[str]:
        """Read this rank's ranges of every view the step holds into the engine (whose
        optimizer state already holds the planned keys); the names of the working
        parameters read whole.

        [Note: whole replicas at load]
        At stages 1-2 the working parameters are replicated and the masters are the owned
        ranges. A load used to read each rank's ranges and then all-gather the parameters
        from the masters, as a step does. When the step reads locally (``reads_locally``:
        files on this host, whose pages every rank of the host shares) and a parameter is
        fp32 in host memory with its master a view of it, each rank reads the parameter
        whole instead: the master is filled by the same read, and the other ranks' ranges
        come from the page cache at the cost of a copy, while the all-gather moved them over
        the process group's transport. With 3 ranks of gloo on 2 cores, the gather of a
        42 MB model took 50-90 ms of a 0.19 s load. Parameters on an accelerator (NCCL
        gathers them faster than any disk), in another working dtype, offloaded, or read from
        object stores (every rank would fetch the whole model) are still gathered.
        ``Engine.whole_replicas`` names the same parameters on every rank, so every rank
        leaves the same ones out of the gather."""
        views = self.engine.state_views()
        # One batched read: every piece of storage this rank needs is fetched once, adjacent
        # pieces together, and lands in the engine's own memory where it can.
        whole = self.engine.whole_replicas() if st.reads_locally else {}
        requests, targets, read_whole = [], [], set()
        for view in views:
            info, local, start = st.tensors.get(view.name), view.local, view.local_start
            if info is None:
                continue
            if view.name in whole:
                local, start = whole[view.name], 0
                read_whole.add(view.name)
            if local.numel() == 0:
                continue
            direct = (
                local.device.type == "cpu" and local.is_contiguous() and local.dtype == info.dtype
            )
            out = local.detach().view(-1) if direct else None
            requests.append((view.name, start, start + local.numel(), out))
            targets.append(None if direct else local)
        results = st.read_many(requests)  # every format batches (see store/protocol.py)
        with torch.no_grad():
            for local, data in zip(targets, results, strict=True):
                if local is not None:
                    local.reshape(-1).copy_(data.to(local.dtype), non_blocking=True)
        return read_whole

    def _saved_rank_state(
        self, st: Any, stateful: dict, strict: bool
    ) -> tuple[dict | None, dict[str, Any]]:
        """``(RNG states to restore or None, {name: decoded state} for ``stateful``)``.

        [Note: per-rank stateful objects]
        A save compares the encoded state of each ``stateful`` object across ranks. One
        that is equal on every rank (a scheduler; a sampler that keeps a global position)
        is stored once, in the commit record, and restored on every rank at any world
        size. Otherwise each rank's states go into its own manifest and can only be restored
        at the same world size, each rank taking its own; at another world size the load
        fails naming them, because no mapping of N ranks' positions onto M ranks is right in
        general: keep such state global (derive per-rank parts such as RNG seeds from a
        saved base seed and the rank) or leave it out. RNG states are per rank too and are
        restored only at the same world size (elsewhere the ranks keep their own streams).
        Each rank reads at most its own manifest."""
        mine = None
        if st.world_size == self.world_size:
            mine = st.rank_state(self.rank) or {}
        objects: dict[str, Any] = {}
        shared = st.attrs.get("stateful")
        for name in stateful:
            if isinstance(shared, dict) and name in shared:
                value = shared[name]
            elif mine is not None and name in mine.get("stateful", {}):
                value = mine["stateful"][name]
            elif name in st.attrs.get("stateful_per_rank", ()):
                raise CheckpointError(
                    f"stateful[{name!r}] was saved with a different state on each of "
                    f"{st.world_size} ranks and cannot be mapped onto {self.world_size} "
                    "ranks; make its state the same on every rank (derive per-rank parts "
                    "from the rank) or leave it out of stateful= when the world size "
                    "changes"
                )
            elif strict:
                raise CheckpointError(
                    f"step {st.step} holds no state for stateful[{name!r}]; was it saved "
                    "with engine.save(..., stateful={...}) under that name? (strict=False "
                    "leaves the object as it is)"
                )
            else:
                continue
            objects[name] = jsonstate.decode(value, f"stateful[{name!r}]")
        rng = None
        if mine is not None and "rng" in mine:
            rng = jsonstate.decode(mine["rng"], f"RNG state of rank {self.rank}")
        return rng, objects

    def _restore_rng(self, st: Any, rng: dict | None) -> None:
        if st.world_size != self.world_size:
            return  # RNG streams of N ranks cannot be mapped onto M ranks
        if rng is None:  # format 1 kept them as tensors
            rng = {
                kind: st.read(f"rng/rank-{self.rank:05d}/{kind}")
                for kind in ("cpu", "cuda")
                if f"rng/rank-{self.rank:05d}/{kind}" in st.tensors
            }
        if isinstance(rng.get("cpu"), torch.Tensor):
            torch.set_rng_state(rng["cpu"].to(torch.uint8))
        if isinstance(rng.get("cuda"), torch.Tensor) and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))


def _open_any_step(
    engine: Any, path: str, step: int | None, storage_options: dict | None
) -> tuple[Any, dict]:
    """Open step ``step`` of the checkpoint at ``path`` in any readable format (zerostate,
    DeepSpeed ZeRO, DCP): ``(the step, its engine-state document)``; a peer's document is a
    copy fitted to ``engine`` (see :func:`_fit_foreign_step`)."""
    st = open_source(path, storage_options=storage_options).step(step)
    try:
        state = st.attrs.get("engine", {})
        if isinstance(state, dict) and state.get("source") in ("deepspeed", "dcp"):
            state = _fit_foreign_step(engine, st, copy.deepcopy(state))
        return st, state
    except BaseException:
        st.close()  # the caller never sees it: its threads go back now, not at GC
        raise


def _fit_foreign_step(engine: Any, st: Any, state: dict) -> dict:
    """``state`` (a peer step's engine-state document, the caller's copy) with what the
    peer does not record supplied by the loading engine: its weight tying (DCP stores tied
    aliases as separate tensors and says nothing of the tie; the aliases must hold the same
    values), its optimizer classes (when the peer's config does not name one), and its
    buffer names (DCP does not tell buffers from parameters: a buffer is read from
    ``model/<name>``). Refuses what cannot fit before the engine changes ([Note: planned
    load] in zerostate.engine_state)."""
    if state.get("tied") is None:
        for alias, canonical in engine.tied.items():
            if f"model/{alias}" in st.tensors and f"model/{canonical}" in st.tensors:
                if not torch.equal(st.read(f"model/{alias}"), st.read(f"model/{canonical}")):
                    raise CheckpointError(
                        f"this model ties {alias} to {canonical}, but the checkpoint at "
                        f"{st.url} holds different values for them"
                    )
        state["tied"] = dict(engine.tied)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("classes") is None:
        optimizer["classes"] = [cls.__name__ for cls in engine.optimizer_classes()]
    if isinstance(optimizer, dict):
        _regroup(engine, optimizer, st.url)
    for view in engine.state_views():
        model_name = "model/" + view.name.removeprefix("buffers/")
        if view.name.startswith("buffers/") and view.name not in st.tensors:
            if model_name in st.tensors and st.supports_aliases:
                st.alias(view.name, model_name)
    return state


def _regroup(engine: Any, optimizer: dict, url: str) -> None:
    """Give the peer's group hyperparameters to the engine's own param groups (in
    ``optimizer``, the caller's copy): each engine group takes the settings of the peer
    group its parameters were in (the engine's built-in AdamW splits decay / no-decay
    parameters, a peer may keep them in one group, decaying all; the run continues as the
    peer ran it)."""
    mine = engine.group_names()
    theirs = optimizer.get("group_params")
    hyper = optimizer.get("param_groups")
    if theirs == mine or not isinstance(theirs, list) or not isinstance(hyper, list):
        return
    if not theirs and not optimizer.get("state"):  # a model state dict alone: fresh optimizer
        optimizer["group_params"], optimizer["param_groups"] = mine, [{} for _ in mine]
        return
    where = {n: i for i, members in enumerate(theirs) for n in members}
    regrouped = []
    for members in mine:
        groups = {where.get(n) for n in members}
        if None in groups or len(groups) > 1:
            raise CheckpointError(
                f"the checkpoint at {url} groups the parameters {members} differently "
                f"(its groups: {theirs}); build the engine with an optimizer whose param "
                "groups match the run that saved it"
            )
        regrouped.append(hyper[groups.pop()] if groups else (hyper[0] if hyper else {}))
    optimizer["group_params"], optimizer["param_groups"] = mine, regrouped
