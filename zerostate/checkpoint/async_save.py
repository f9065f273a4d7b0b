"""The async half of a save: the snapshot fence, the background writer, the handle.

See [Note: async save] in zerostate.checkpoint. :class:`Snapshots` copies this rank's
owned ranges into host buffers reused from save to save and holds the fence every writer
of masters or optimizer state passes first (:meth:`Snapshots.before_update`);
:class:`BackgroundSaves` runs one save at a time on a single thread and reports an
unfinished one's failure from a finaliser; :class:`SaveHandle` is what ``save`` returns.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.store import TensorSpec


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
class Piece:
    """One logical tensor this rank writes: the owned slice of a view."""

    spec: TensorSpec
    source: torch.Tensor  # 1-D slice of the live tensor (may be on an accelerator)


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


class BackgroundSaves:
    """At most one save in flight, written on one background thread.

    ``owner`` is the object whose collection (or the interpreter's exit) lets an unfinished
    save finish and prints its failure on stderr; it cannot raise there, and it must not
    end a process that other code is still running in."""

    def __init__(self, owner: Any) -> None:
        self._state = _Inflight()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(owner, _report_unfinished, self._state)

    def submit(self, finish: Callable[[], None], step: int, path: str, start: float) -> SaveHandle:
        """Run ``finish`` in the background; ``start``: when ``save`` was entered."""
        if self._state.executor is None:
            self._state.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zs-save")
        future = self._state.executor.submit(finish)
        handle = SaveHandle(step, path, future, time.perf_counter() - start)
        with self._lock:
            self._state.handle = handle
        return handle

    def wait(self) -> None:
        """Wait for the save in flight (if any) and re-raise its error."""
        with self._lock:
            handle, self._state.handle = self._state.handle, None
        if handle is not None:
            handle.wait()

    def close(self) -> None:
        """Wait for the save in flight, re-raise its error, stop the thread."""
        try:
            self.wait()
        finally:
            if self._state.executor is not None:
                self._state.executor.shutdown(wait=True)
                self._state.executor = None
            self._finalizer.detach()


class Snapshots:
    """Host copies of this rank's owned ranges for async saves, and the fence before
    updates. See [Note: async save] in zerostate.checkpoint."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._ready = threading.Event()
        self._ready.set()
        #: Seconds the training thread waited in before_update() for async snapshots.
        self.stall_s = 0.0

    def _host_buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != src.numel() or buf.dtype != src.dtype:
            buf = torch.empty(src.numel(), dtype=src.dtype, pin_memory=src.is_cuda)
            self._buffers[name] = buf
        return buf

    def take(
        self, pieces: list[Piece], blocking: bool, module: torch.nn.Module
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """Host tensors for this rank's owned ranges, and the copy that fills them.

        Buffers and RNG states can change in any forward pass, so they are copied now. The
        large states (master weights, Adam moments) change only inside the optimizer step;
        their copy is returned as a function for the background thread, and the engine's
        next step waits for it (:meth:`before_update`).
        """
        shards: dict[str, torch.Tensor] = {}
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Storage the user can reach and change between save() and the next step (fp32
        # masters are views of the module's own parameters at stages 0-2): copied now, so
        # the step holds the values as of save(), whatever the caller does next.
        visible = {
            p.untyped_storage().data_ptr()
            for p in map(_local, module.parameters())
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
        return shards, self._deferred_copy(deferred)

    def _deferred_copy(self, deferred: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable:
        event = None
        device = next((src.device for _, src in deferred if src.is_cuda), None)
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self._ready.clear()

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
                self._ready.set()

        return copy

    def before_update(self) -> None:
        """Wait until an async save's snapshot has finished reading the masters and
        optimizer states (called before anything changes them)."""
        if not self._ready.is_set():
            t0 = time.perf_counter()
            self._ready.wait()
            self.stall_s += time.perf_counter() - t0


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage (a DTensor's local tensor under tensor parallelism)."""
    return collectives.dtensor_local(param) if collectives.is_dtensor(param) else param
