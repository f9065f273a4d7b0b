"""Gloo workers kept alive across tests, one pool per world size.

A multi-rank test used to pay for its processes: spawn, import torch (often transformers
or DeepSpeed too), build a gloo group, then run a second of work. A pool starts its
workers once; each later call ships ``(fn, args, kwargs)`` to every rank and costs only
its work. :func:`helpers_dist.run_distributed` uses it for the files listed in
``tests/conftest.py``'s ``POOLED_FILES`` unless a test asks for fresh processes (the
``fresh_processes`` marker, or ``pooled=False``). Since workers are forked from fork
servers that imported everything once ([Note: forked workers] in tests/fork_server.py), a
new forked process per call is cheaper than a pooled call with its isolation checks, so
the suite forks and only the pool's own tests use the pool (and only they import this
module). The pool's workers are forked from those fork servers too.

[Note: pool isolation]: a pooled worker must be indistinguishable from a fresh one at
the start of every call. Settings a test may change on purpose (RNG states, thread count,
default dtype, grad mode, environment, working directory, ``sys.path``) are put back
before each call. State a test must not leave behind is checked after each call, and a
leak fails the test that left it, names the leak, and replaces the pool's workers:
- a live ``zerostate.Engine`` (after a garbage collection),
- a thread that was not there when the worker started (zerostate's idle read pools, a
  cache by design, are shut down first: a fresh process has none),
- a global module hook (``torch.nn.modules.module``'s ``_global_*_hooks``),
- a handler added to, or a level set on, the root or a zerostate logger,
- the default process group gone, replaced or out of step (a barrier must pass); groups
  the test created are destroyed, as a fresh process would not have them,
- a module attribute of zerostate, or of the torch modules peers patch, rebound (a
  monkeypatch that was not undone); zerostate's log-once flags are put back first, and
  torch's profiling wrapper of an optimizer class's ``step`` is not a rebinding.
The same check runs before each call too, so state that appears between calls (a
thread started late) fails the next call, naming the call before it. A worker that
fails, crashes or overruns its time bound is killed with the rest of its pool; the next
call starts fresh workers. Each call sets the default group's and its store's timeout to
its own, as a fresh process would have them, so calls with different time bounds share
one pool instead of each starting its own.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import pickle
import pkgutil
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from fork_server import (
    WorkerError,
    enter_worker,
    new_process,
    running_test,
    start_context,
    stop_fork_servers,
    worker_environment,
)
from ports import free_port

#: Live pooled workers at most (all pools together); the least recently used pool goes
#: first. Each worker holds torch (and whatever the tests imported): ~0.3-1 GB.
MAX_POOLED_WORKERS = 7
#: Starting a pool (spawn, import torch and zerostate, a gloo group) may take this long.
STARTUP_TIMEOUT_S = 180.0
#: After one rank fails, the others get this long to report their own errors.
FAILURE_GRACE_S = 10.0
#: Threads a call started get this long to finish before they count as left behind.
THREAD_GRACE_S = 2.0


class LeakError(WorkerError):
    """A pooled call left state behind in its workers; the message names it."""


# ------------------------------------------------------------------- worker-side state
# Not ``torch`` itself: it rebinds some of its own functions when a submodule first loads
# (torch._dynamo wraps ``torch.manual_seed``). Tests wrap torch.distributed's collectives
# to count them; DeepSpeed replaces torch.nn.functional.linear.
_WATCHED_TORCH = ("torch.nn.functional", "torch.distributed")
_WATCHED_CLASSES = ("torch.nn.Module", "torch.Tensor", "torch.optim.Optimizer")
_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _import_zerostate() -> None:
    """Every zerostate module the tests may patch, imported before the baseline so a
    rebinding is seen even in a module the first test imports. The integrations pull in
    transformers and Lightning; a test that patches those runs them itself."""
    import zerostate

    for info in pkgutil.walk_packages(zerostate.__path__, "zerostate."):
        if info.name.startswith("zerostate.integrations"):
            continue
        with contextlib.suppress(Exception):
            importlib.import_module(info.name)


def _bindings() -> dict[str, int]:
    """``{"module.attr": id(value)}`` over zerostate's modules and classes and the torch
    namespaces peers are known to patch."""
    with warnings.catch_warnings():  # deprecated module attributes warn when touched
        warnings.simplefilter("ignore")
        return _bindings_now()


def _bindings_now() -> dict[str, int]:
    out: dict[str, int] = {}
    names = [m for m in list(sys.modules) if m == "zerostate" or m.startswith("zerostate.")]
    for modname in names + [m for m in _WATCHED_TORCH if m in sys.modules]:
        module = sys.modules.get(modname)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("__"):
                continue
            out[f"{modname}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == modname:
                for cattr, cvalue in list(vars(value).items()):
                    if not cattr.startswith("__"):
                        out[f"{modname}.{attr}.{cattr}"] = _ident(cvalue)
    for dotted in _WATCHED_CLASSES:
        modname, _, clsname = dotted.rpartition(".")
        cls = getattr(sys.modules[modname], clsname)
        for cattr, cvalue in list(vars(cls).items()):
            out[f"{dotted}.{cattr}"] = _ident(cvalue)
    return out


def _ident(value: Any) -> int:
    """``id(value)``, except that torch's own profiling wrapper of an optimizer class's
    ``step`` counts as the function it wraps: ``torch.optim.Optimizer.__init__`` installs
    it on the class the first time that class is instantiated, in a fresh process too."""
    if isinstance(value, types.FunctionType) and value.__dict__.get("hooked") is True:
        wrapped = value.__dict__.get("__wrapped__")
        if wrapped is not None:
            return id(wrapped)
    return id(value)


def _hook_counts() -> dict[str, int]:
    from torch.nn.modules import module

    return {name: len(getattr(module, name, {})) for name in _HOOK_DICTS}


def _loggers() -> dict[str, tuple[tuple[str, ...], int]]:
    """``{logger: (handlers, level)}`` for the root logger and zerostate's; a handler by
    its type and identity, so one removed and another added is a change too. A logger
    first created during a call (``getLogger``) starts with none and ``NOTSET``."""
    import logging

    def handlers(logger: logging.Logger) -> tuple[str, ...]:
        return tuple(f"{type(h).__name__}@{id(h):x}" for h in logger.handlers)

    names = [n for n in list(logging.Logger.manager.loggerDict) if n.startswith("zerostate")]
    out = {"<root>": (handlers(logging.root), logging.root.level)}
    for name in names:
        logger = logging.getLogger(name)
        out[name] = (handlers(logger), logger.level)
    return out


def _logger_change(name: str, before: tuple, after: tuple) -> str:
    import logging

    (h0, l0), (h1, l1) = before, after
    parts = []
    if h1 != h0:
        added = [h for h in h1 if h not in h0]
        removed = [h for h in h0 if h not in h1]
        parts += [f"handler {h} added" for h in added]
        parts += [f"handler {h} removed" for h in removed]
    if l1 != l0:
        parts.append(f"level {logging.getLevelName(l0)} -> {logging.getLevelName(l1)}")
    return f"{name} ({', '.join(parts)})"


def _live_engines() -> int:
    engine_cls = getattr(sys.modules.get("zerostate.engine"), "Engine", None)
    if engine_cls is None:
        return 0
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, engine_cls))


#: zerostate's log-once flags: ``(module, attribute, what a fresh process starts with)``.
_ONCE_FLAGS = (("zerostate.runtime.offload", "_warned_unpinned", False),)


def _drop_caches() -> None:
    """Process-wide caches that a fresh process starts without (not leaks), and the
    log-once flags, so the next call logs what a fresh process would."""
    for modname, attr, fresh in _ONCE_FLAGS:
        module = sys.modules.get(modname)
        if module is not None and hasattr(module, attr):
            setattr(module, attr, fresh)
    _drop_dtensor_caches()
    step_base = sys.modules.get("zerostate.store.step_base")
    if step_base is not None:
        with step_base._idle_lock:
            idle = [p for pools in step_base._idle_pools.values() for p in pools]
            step_base._idle_pools.clear()
        for pool in idle:
            pool.shutdown(wait=True)


def _drop_dtensor_caches() -> None:
    """DTensor caches its sharding decisions (in Python and in C++) keyed by specs whose
    ``DeviceMesh`` compares equal across process groups: a mesh of the same shape and names
    built by the next call would get the previous call's groups, destroyed since ("Could not
    resolve the process group registered under the name N"). A fresh process has no cache."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    with contextlib.suppress(AttributeError):
        torch._C._clear_DTensor_sharding_propagator_cache()
    with contextlib.suppress(AttributeError):
        _redistribute.clear_redistribute_planner_cache()
    with contextlib.suppress(AttributeError):
        _redistribute._gen_transform_infos.cache_clear()


def _drop_groups() -> None:
    """Groups a test created (a subgroup, a mesh) hold sockets and threads; a fresh
    process would not have them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._world.default_pg
    for pg in [pg for pg in list(c10d._world.pg_map) if pg is not default]:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)


class _Baseline:
    """What a clean worker looks like, taken right after start-up."""

    def __init__(self) -> None:
        import random

        import torch
        from torch.distributed import distributed_c10d as c10d

        self.threads = {t.ident for t in threading.enumerate()}
        self.hooks = _hook_counts()
        self.loggers = _loggers()
        self.bindings = _bindings()
        self.pg = c10d._world.default_pg
        self.torch_rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        np = sys.modules.get("numpy")
        self.np_rng = np.random.get_state() if np is not None else None
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()

    def restore_settings(self, sys_path: list[str]) -> None:
        import random

        import torch

        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.np_rng is not None:
            np.random.set_state(self.np_rng)
        torch.set_num_threads(1)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = sys_path

    def leaks(self, *, wait_threads: bool, full: bool) -> list[str]:
        """What differs from a clean worker, one line each (empty when clean); ``full``
        adds the checks only a call can break (engines, rebound attributes)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        found = []
        engines = _live_engines() if full else 0
        if engines:
            found.append(f"{engines} zerostate Engine object(s) still alive")
        if full:
            _drop_caches()
        deadline = time.monotonic() + (THREAD_GRACE_S if wait_threads else 0.0)
        extra = [t for t in threading.enumerate() if t.ident not in self.threads]
        for t in extra:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        extra = [t for t in threading.enumerate() if t.ident not in self.threads]
        if extra:
            found.append("threads left running: " + ", ".join(sorted(t.name for t in extra)))
        hooks = _hook_counts()
        for name, count in hooks.items():
            if count != self.hooks[name]:
                found.append(
                    f"global module hooks left: torch.nn.modules.module.{name} "
                    f"holds {count} (a fresh process: {self.hooks[name]})"
                )
        if not dist.is_initialized() or c10d._world.default_pg is not self.pg:
            found.append("the default process group was destroyed or replaced")
        else:
            _drop_groups()
        if not full:
            return found
        loggers = _loggers()
        changed = [
            _logger_change(n, self.loggers.get(n, ((), 0)), v)
            for n, v in sorted(loggers.items())
            if v != self.loggers.get(n, ((), 0))
        ]
        if changed:
            found.append("logger handlers or levels left changed: " + "; ".join(changed))
        now = _bindings()
        rebound = sorted(k for k, v in self.bindings.items() if now.get(k, v) != v)
        gone = sorted(k for k in self.bindings if k not in now)
        if rebound:
            more = " ..." if len(rebound) > 10 else ""
            found.append(
                "module attributes rebound (monkeypatch not undone): "
                + ", ".join(rebound[:10])
                + more
            )
        if gone:
            found.append("module attributes deleted: " + ", ".join(gone[:10]))
        return found


def _set_timeouts(seconds: float) -> None:
    """The default group's collective timeout and its store's, as ``init_process_group``
    with ``timeout=seconds`` sets them."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    c10d._set_pg_timeout(timeout)
    c10d._get_default_store().set_timeout(timeout)


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    sys_path: list[str],
    env: dict[str, str],
    conn,
) -> None:
    enter_worker(sys_path, env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    _import_zerostate()
    baseline = _Baseline()
    conn.send(("ready", rank, None))
    previous = "<worker start-up>"
    while True:
        msg = conn.recv()
        if msg is None:
            break
        test, call_path, call_pg_timeout_s, payload = msg
        # Between calls only threads (and what they do) can change anything.
        leaks = baseline.leaks(wait_threads=False, full=False)
        if leaks:
            conn.send(("leak", rank, (previous, leaks)))
            continue
        baseline.restore_settings(call_path)
        previous = test
        try:
            _set_timeouts(call_pg_timeout_s)
            fn, args, kwargs = pickle.loads(payload)
            conn.send(("ok", rank, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
        except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
            conn.send(("error", rank, traceback.format_exc()))
            continue  # the parent replaces this pool: the group may be out of step
        try:
            dist.barrier()  # every rank left its collectives in step
            leaks = baseline.leaks(wait_threads=True, full=True)
        except BaseException:  # noqa: BLE001
            leaks = [f"the default process group failed after the call:\n{traceback.format_exc()}"]
        conn.send(("leak", rank, (test, leaks)) if leaks else ("clean", rank, None))


# -------------------------------------------------------------------- parent-side pool
class _Pool:
    def __init__(self, world_size: int, pg_timeout_s: float) -> None:
        self.world_size = world_size
        ctx = start_context(spawn=False)
        port = free_port()
        self.conns: list[Connection] = []
        self.procs = []
        with worker_environment() as env:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                args = (rank, world_size, port, pg_timeout_s, list(sys.path), env, child)
                proc = new_process(ctx, rank, _worker_main, args)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
        self.ready = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _collect(self, deadline: float, what: str) -> dict[int, tuple[str, Any]]:
        """Every rank's ``(kind, payload)``; a rank that dies, or a deadline passed,
        raises (after the live ranks had a moment to report)."""
        got: dict[int, tuple[str, Any]] = {}
        waiting = dict(enumerate(self.conns))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(k in ("error", "leak", "dead") for k, _ in got.values()):
                    return got  # the others are stuck waiting for the failed rank
                raise TimeoutError(f"{what} did not finish in time; ranks done: {sorted(got)}")
            sentinels = {self.procs[r].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=min(remaining, 1.0))
            for obj in ready:
                if obj in sentinels:
                    continue
                rank = next(r for r, c in waiting.items() if c is obj)
                try:
                    kind, _, payload = obj.recv()
                except (EOFError, OSError):  # died without a word: a crash
                    self.procs[rank].join(timeout=5.0)
                    kind, payload = "dead", self.procs[rank].exitcode
                got[rank] = (kind, payload)
                del waiting[rank]
                if kind != "ok" and kind != "clean":  # the others may be stuck in a collective
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return got

    def call(
        self, fn: Callable, args: tuple, kwargs: dict, timeout: float, pg_timeout_s: float
    ) -> list[Any]:
        test = running_test()
        if not self.ready:  # start-up is not the call's time: it is paid once
            start_by = time.monotonic() + max(timeout, STARTUP_TIMEOUT_S)
            self._raise(self._collect(start_by, f"starting {self.world_size} pooled workers"))
            self.ready = True
        deadline = time.monotonic() + timeout
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self.conns:
            conn.send((test, list(sys.path), pg_timeout_s, payload))
        what = f"{getattr(fn, '__name__', fn)} on {self.world_size} pooled ranks ({test})"
        try:
            done = self._collect(deadline, what)  # the call's outcome, as soon as it is in
            self._raise(done)
            checked = self._collect(deadline, f"the isolation check after {what}")
            self._raise(checked)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (limit {timeout}s)") from None
        return [pickle.loads(done[r][1]) for r in range(self.world_size)]

    def _raise(self, got: dict[int, tuple[str, Any]]) -> None:
        failures = {r: p for r, (k, p) in got.items() if k == "error"}
        dead = {r: code for r, (k, code) in got.items() if k == "dead"}
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        if dead:
            raise WorkerError(f"rank(s) exited without a result: {dead}\n{text}")
        if failures:
            raise WorkerError(f"{len(failures)} of {self.world_size} ranks failed:\n{text}")
        leaks = {r: p for r, (k, p) in got.items() if k == "leak"}
        if leaks:
            lines = []
            for rank, (test, found) in sorted(leaks.items()):
                lines += [f"rank {rank}, left by {test}:"] + [f"  - {x}" for x in found]
            raise LeakError(
                "a pooled worker was left unclean; its pool is replaced:\n" + "\n".join(lines)
            )
        if len(got) < self.world_size:
            raise TimeoutError(f"ranks {sorted(got)} of {self.world_size} answered")

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        end = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()


_pools: dict[int, _Pool] = {}
_lock = threading.Lock()


def pool_for(world_size: int, pg_timeout_s: float) -> _Pool:
    """The live pool of this world size (moved to most recently used), started if needed
    (its group's first timeout: ``pg_timeout_s``; each call sets its own)."""
    key = world_size
    pool = _pools.pop(key, None)
    if pool is None:
        while _pools and sum(p.world_size for p in _pools.values()) + world_size > (
            MAX_POOLED_WORKERS
        ):
            _pools.pop(next(iter(_pools))).close()
        pool = _Pool(world_size, pg_timeout_s)
    _pools[key] = pool
    return pool


def discard(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close()


def run_pooled(
    fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float, pg_timeout_s: float
) -> list[Any]:
    """``fn`` on the pooled ranks; any failure, leak or overrun replaces the pool."""
    with _lock:
        pool = pool_for(world_size, pg_timeout_s)
        clean = False
        try:
            results = pool.call(fn, args, kwargs, timeout, pg_timeout_s)
            clean = True
            return results
        finally:
            if not clean:
                discard(world_size)


def shutdown() -> None:
    with _lock:
        while _pools:
            _pools.popitem()[1].close()
        stop_fork_servers()


atexit.register(shutdown)
