"""Engine checkpoints: collective save (blocking or async) and load at any world size.

The engine exposes its state as :class:`~zerostate.engine.ShardView` objects (one per
logical tensor: fp32 master weights, Adam moments, buffers); this module moves them to and
from the store. It owns no training state and calls no collective except one barrier per
save and per load, on the engine's process group.

[Note: async save]
``save(..., blocking=False)`` splits a save in two. On the caller's thread it copies this
rank's owned ranges into host buffers that are reused from save to save (pinned, and
copied on a side CUDA stream, when the state lives on a GPU) and returns a
:class:`SaveHandle`. A single background thread then writes the chunks, waits for the
commit (coordinated through storage, see the store's commit protocol) and applies
retention. At most one save is in flight: a new save, a load, ``handle.wait()`` and
interpreter exit all wait for it first and re-raise its error, so a failed background save
is never silent.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerostate import jsonstate
from zerostate.errors import CheckpointError, ConfigError, CorruptCheckpointError
from zerostate.partition import TensorLayout
from zerostate.store import (
    StepExistsError,
    StepWriter,
    TensorSpec,
    open_checkpoint,
    prune_steps,
    remove_partial_steps,
)

log = logging.getLogger(__name__)

#: Default seconds a rank waits for the others while committing a step.
DEFAULT_COMMIT_TIMEOUT_S = 600.0


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


def _rank_state_to_store(
    state: dict, *, rank: int, world_size: int, group: Any, device: torch.device
) -> list[_Piece]:
    """Pieces that store this rank's JSON ``state`` (collective over ``group``).

    Interim encoding until the store has a per-rank JSON slot: one uint8 tensor per rank,
    ``rank_state/rank-<r>``, holding that rank's JSON padded with spaces to the longest
    rank's length (one all-reduce agrees on it, since every rank must list the same
    tensors), each rank writing only its own as one whole chunk.
    """
    raw = json.dumps(state, allow_nan=True).encode()
    length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    numel = int(length.item())
    raw += b" " * (numel - len(raw))
    pieces = []
    for r in range(world_size):
        layout = TensorLayout(numel, world_size, max(1, numel), r)
        spec = TensorSpec(f"rank_state/rank-{r:05d}", (numel,), torch.uint8, layout)
        data = torch.tensor(list(raw), dtype=torch.uint8) if r == rank else torch.empty(0)
        pieces.append(_Piece(spec, data.to(torch.uint8)))
    return pieces


def _rank_state_from_store(st: Any, rank: int) -> dict | None:
    """The JSON state rank ``rank`` of the saving run stored, or None if it stored none."""
    name = f"rank_state/rank-{rank:05d}"
    if name not in st.tensors:
        return None
    raw = bytes(st.read(name).to(torch.uint8).tolist())
    try:
        state = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{name} in step {st.step} is not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{name} in step {st.step} is not a JSON object")
    return state


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


class Checkpointer:
    """Saves and loads one engine's state. Created by the engine; use ``engine.save``."""

    def __init__(self, engine: Any, *, timeout_s: float | None = None) -> None:
        self.engine = engine
        if timeout_s is None:
            # The environment may shorten it (tests, schedulers with tight preemption).
            env = os.environ.get("ZEROSTATE_COMMIT_TIMEOUT_S")
            timeout_s = float(env) if env else DEFAULT_COMMIT_TIMEOUT_S
        self.timeout_s = timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._snapshot_ready = threading.Event()
        self._snapshot_ready.set()
        #: Seconds the training thread waited in before_update() for async snapshots.
        self.stall_s = 0.0
        atexit.register(self._wait_at_exit)

    # ----------------------------------------------------------------- helpers
    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.engine.group)

    def _rng_pieces(self) -> list[_Piece]:
        # Every rank lists every rank's RNG tensor (the spec list must be identical on all
        # ranks); each rank owns only its own, as one whole chunk.
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state()
        pieces = []
        for kind, state in states.items():
            numel = state.numel()
            for r in range(self.world_size):
                layout = TensorLayout(numel, self.world_size, max(1, numel), r)
                spec = TensorSpec(f"rng/rank-{r:05d}/{kind}", (numel,), torch.uint8, layout)
                if r == self.rank:
                    pieces.append(_Piece(spec, state.reshape(-1)))
                else:
                    pieces.append(_Piece(spec, state.new_empty(0)))
        return pieces

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
        return pieces + self._rng_pieces()

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
        for piece in pieces:
            src, name = piece.source, piece.spec.name
            if src.numel() == 0:
                continue
            if blocking and not src.is_cuda:
                shards[name] = src.contiguous()  # written before save() returns: no copy
                continue
            buf = self._host_buffer(name, src)
            if name.startswith(("buffers/", "rng/", "rank_state/")) or blocking:
                buf.copy_(src)
            else:
                deferred.append((buf, src))
            shards[name] = buf
        if not deferred:
            return shards, None
        event = None
        if any(src.is_cuda for _, src in deferred):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self._snapshot_ready.clear()

        def copy() -> None:
            try:
                if event is not None:
                    stream = torch.cuda.Stream()
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
    ) -> SaveHandle:
        start = time.perf_counter()
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
        }
        self.wait()  # one save in flight; surfaces a previous background failure
        # Rank 0 checks the target and picks a save id; one all-reduce tells every rank both
        # before anyone writes a byte (the id lets rank 0 ignore stale manifests).
        already = 0
        if self.rank == 0:
            if open_checkpoint(path, storage_options=storage_options).is_committed(step):
                already = 1
            else:
                remove_partial_steps(path, storage_options=storage_options, only_step=step)
        token = torch.tensor(
            [already, secrets.randbits(62) if self.rank == 0 else 0],
            dtype=torch.int64,
            device=self.engine.device,
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(token, group=self.engine.group)
        already, save_id = (int(v) for v in token.tolist())
        if already:
            raise StepExistsError(
                f"step {step} is already committed in {path}; save under another step number "
                "or delete it first"
            )
        pieces = self._pieces() + _rank_state_to_store(
            {"stateful": objects},
            rank=self.rank,
            world_size=self.world_size,
            group=self.engine.group,
            device=self.engine.device,
        )
        specs = [p.spec for p in pieces]
        writer = StepWriter(
            path,
            step,
            rank=self.rank,
            world_size=self.world_size,
            specs=specs,
            attrs=attrs,
            storage_options=storage_options,
            timeout_s=self.timeout_s,
            progress=progress,
            save_id=f"{save_id:016x}",
        )
        shards, copy = self._snapshot(pieces, blocking)

        def finish() -> None:
            if copy is not None:
                copy()
            writer.write(shards)
            writer.commit(wait=True)
            if self.rank == 0:
                self._retain(path, step, keep_last, storage_options)

        if blocking:
            finish()
            self._barrier()
            handle = SaveHandle(step, path, None, time.perf_counter() - start)
            return handle
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zs-save")
        future = self._executor.submit(finish)
        handle = SaveHandle(step, path, future, time.perf_counter() - start)
        with self._lock:
            self._inflight = handle
        return handle

    @staticmethod
    def _retain(
        path: str, step: int, keep_last: int | None, storage_options: dict | None
    ) -> None:
        # Partial steps older than the one just committed belong to crashed saves.
        try:
            prune_steps(
                path, keep_last=keep_last, partial_below=step, storage_options=storage_options
            )
        except Exception as exc:  # retention must not fail a good save
            log.warning("zerostate: retention in %s after step %d failed: %s", path, step, exc)

    def wait(self) -> None:
        with self._lock:
            handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.wait()

    def _wait_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:
            print(f"zerostate: background checkpoint save failed: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

    # -------------------------------------------------------------------- load
    def load(
        self,
        path: str,
        *,
        step: int | None = None,
        storage_options: dict | None = None,
        strict: bool = True,
        stateful: dict | None = None,
    ) -> Any:
        stateful = _check_stateful(stateful, loading=True)
        self.wait()
        self.before_update()
        ckpt = open_checkpoint(path, storage_options=storage_options)
        st = ckpt.step(step)
        self.engine.prepare_engine_state(st.attrs.get("engine", {}), strict=strict)
        views = self.engine.state_views()
        missing = [v.name for v in views if v.name not in st.tensors]
        if missing and strict:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise CheckpointError(
                f"step {st.step} in {path} lacks {len(missing)} tensor(s) the model needs: "
                f"{shown}. Is it a checkpoint of this model? (strict=False skips them)"
            )
        for view in views:
            info = st.tensors.get(view.name)
            if info is None:
                continue
            if tuple(info.shape) != tuple(view.shape):
                raise CheckpointError(
                    f"{view.name}: checkpoint shape {tuple(info.shape)} != model shape "
                    f"{tuple(view.shape)}"
                )
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="zs-load") as pool:
            futures = [
                pool.submit(self._load_view, st, view) for view in views if view.name in st.tensors
            ]
            for fut in futures:
                fut.result()
        self.engine.load_engine_state(st.attrs.get("engine", {}))
        self.engine.refresh_from_masters()
        self._restore_rng(st)
        self._restore_stateful(st, stateful, strict)
        self._barrier()
        return st.attrs.get("client_state")

    def _restore_stateful(self, st: Any, stateful: dict, strict: bool) -> None:
        """[Note: per-rank stateful objects]
        Every rank saves its own objects' states. On load, an object whose saved state is
        the same on every saving rank (a scheduler; a sampler that keeps a global position)
        is restored on every rank at any world size. One whose state differed between
        ranks can only be restored at the same world size, each rank taking its own; at
        another world size the load fails naming it, because no mapping of N ranks'
        positions onto M ranks is right in general: keep such state global (derive per-rank
        parts such as RNG seeds from a saved base seed and the rank) or leave it out."""
        if not stateful:
            return
        saved = [_rank_state_from_store(st, r) for r in range(st.world_size)]
        for name, obj in stateful.items():
            states = [(s or {}).get("stateful", {}).get(name) for s in saved]
            if any(v is None for v in states):
                if strict:
                    raise CheckpointError(
                        f"step {st.step} holds no state for stateful[{name!r}]; was it saved "
                        "with engine.save(..., stateful={...}) under that name? (strict=False "
                        "leaves the object as it is)"
                    )
                continue
            if all(v == states[0] for v in states):
                value = states[0]
            elif st.world_size == self.world_size:
                value = states[self.rank]
            else:
                raise CheckpointError(
                    f"stateful[{name!r}] was saved with a different state on each of "
                    f"{st.world_size} ranks and cannot be mapped onto {self.world_size} ranks; "
                    "make its state the same on every rank (derive per-rank parts from the "
                    "rank) or leave it out of stateful= when the world size changes"
                )
            obj.load_state_dict(jsonstate.decode(value, f"stateful[{name!r}]"))

    @staticmethod
    def _load_view(st: Any, view: Any) -> None:
        numel = view.local.numel()
        if numel == 0:
            return
        start, stop = view.local_start, view.local_start + numel
        local = view.local
        if (
            local.device.type == "cpu"
            and local.is_contiguous()
            and local.dtype == st.tensors[view.name].dtype
        ):
            # Straight into the engine's own memory: no temporary, no second copy.
            st.read_range(view.name, start, stop, out=local.detach().view(-1))
            return
        data = st.read_range(view.name, start, stop)
        with torch.no_grad():
            local.reshape(-1).copy_(data.to(local.dtype), non_blocking=True)

    def _restore_rng(self, st: Any) -> None:
        if st.world_size != self.world_size:
            return  # RNG streams of N ranks cannot be mapped onto M ranks
        name = f"rng/rank-{self.rank:05d}/cpu"
        if name in st.tensors:
            torch.set_rng_state(st.read(name).to(torch.uint8))
        name = f"rng/rank-{self.rank:05d}/cuda"
        if name in st.tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(st.read(name).to(torch.uint8))
