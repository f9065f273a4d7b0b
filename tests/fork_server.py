"""Processes for the ranks of a multi-rank test: forked from fork servers that imported
torch and zerostate once ([Note: forked workers]), or spawned interpreters; and what the
launchers know of the running test.

:func:`helpers_dist.run_distributed` starts each call's ranks here, and the pool of
``tests/dist_pool.py`` its long-lived workers ([Note: pool isolation]).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import pkgutil
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any


class WorkerError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


# ---------------------------------------------------------------------------- the test
# The test that is running (set by tests/conftest.py), named in leak and timeout errors.
_current = {"test": "<no test>", "pooled": True, "spawn": False}


@contextlib.contextmanager
def test_context(name: str, *, pooled: bool, spawn: bool = False) -> Iterator[None]:
    """``pooled``: the test may use pooled workers; ``spawn``: its fresh processes must be
    spawned, not forked from the fork server ([Note: forked workers])."""
    old = dict(_current)
    _current.update(test=name, pooled=pooled, spawn=spawn)
    try:
        yield
    finally:
        _current.update(old)


def running_test() -> str:
    return str(_current["test"])


def pooling_allowed() -> bool:
    return bool(_current["pooled"]) and os.environ.get("ZEROSTATE_TEST_FRESH") != "1"


# ------------------------------------------------------------------ starting processes
# [Note: forked workers]: a spawned rank imports torch and zerostate before its first line
# of work (4.4 CPU s measured on this machine; a 4-rank call pays 4 times that on 2 cores).
# Workers are forked instead, from fork servers (multiprocessing's forkserver machinery)
# that imported those once (torch, torch.distributed, every zerostate module but the
# integrations, and the transformers models the tests build) and start no threads,
# process groups or engines: a forked worker is a new process with a clean copy of that
# import state. Rank r forks from server r, each
# a spawned interpreter of its own, so the ranks of one call differ in Python's hash
# seed as spawned ranks do (an iteration order that differs across ranks still shows);
# torch's and numpy's RNGs are reseeded from the OS in each worker, as a new process
# seeds them, and the worker's environment is the caller's (passed along and applied
# first), with one OpenMP thread. What a fork cannot give is a new interpreter: import-
# time reads of the environment, interpreter start-up and exit. Tests marked
# ``fresh_processes`` and calls with ``pooled=False`` are spawned, as is everything
# under ZEROSTATE_TEST_SPAWN=1.
_servers: dict[tuple[int, tuple[str, ...]], forkserver.ForkServer] = {}


def _preload_names() -> list[str]:
    import zerostate

    names = ["torch", "torch.distributed", "zerostate"]
    for info in pkgutil.walk_packages(zerostate.__path__, "zerostate."):
        if not info.name.startswith("zerostate.integrations"):
            names.append(info.name)
    # The transformers models the multi-rank tests build (2.7 CPU s per rank otherwise,
    # paid again by every rank of every call); skipped quietly where it is not installed.
    return names + TRANSFORMERS_PRELOAD


#: Imported by the fork servers after zerostate ([Note: forked workers]).
TRANSFORMERS_PRELOAD = [
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]


def _server(index: int, preload: tuple[str, ...] = ()) -> forkserver.ForkServer:
    """Fork server ``index`` of those that also imported ``preload`` (a framework, for
    tests/forked_launch.py), started on first use."""
    key = (index, preload)
    server = _servers.get(key)
    if server is None:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(_preload_names() + list(preload))
        _servers[key] = server
    return server


class _ServerPopen(popen_forkserver.Popen):
    """Python 3.11's ``popen_forkserver.Popen._launch``, asking the process's own fork
    server rather than the module-wide one."""

    def _launch(self, process_obj: Any) -> None:
        server = _server(process_obj.fork_server, process_obj.preload)
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _ServerProcess(mp_context.ForkServerProcess):
    fork_server = 0
    preload: tuple[str, ...] = ()

    @staticmethod
    def _Popen(process_obj: Any) -> _ServerPopen:
        return _ServerPopen(process_obj)


def start_context(*, spawn: bool) -> Any:
    """The multiprocessing context for a call's queues and pipes: ``spawn`` or
    ``forkserver``; :func:`new_process` makes its processes."""
    if spawn or _current["spawn"] or os.environ.get("ZEROSTATE_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def new_process(ctx: Any, rank: int, target: Callable, args: tuple) -> Any:
    """An unstarted daemon process for ``rank``: spawned, or forked from fork server
    ``rank`` ([Note: forked workers]). Start it inside :func:`worker_environment`."""
    if ctx.get_start_method() == "spawn":
        return ctx.Process(target=target, args=args, daemon=True)
    return forked_process(rank, target, args)


def forked_process(rank: int, target: Callable, args: tuple, preload: tuple[str, ...] = ()) -> Any:
    """An unstarted daemon process forked from fork server ``rank`` of those that also
    imported ``preload`` ([Note: forked workers]); :func:`stop_fork_servers` ends them all."""
    proc = _ServerProcess(target=target, args=args, daemon=True)
    proc.fork_server, proc.preload = rank, tuple(preload)
    return proc


def stop_fork_servers() -> None:
    """Ask each fork server to exit (closing its "alive" pipe), wait briefly, then kill:
    a worker's stray descendant must not hold the session open."""
    while _servers:
        server = _servers.popitem()[1]
        pid, alive = server._forkserver_pid, server._forkserver_alive_fd
        if pid is None:
            continue
        with contextlib.suppress(OSError):
            os.close(alive)
        end = time.monotonic() + 10.0
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                if time.monotonic() > end:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)


@contextlib.contextmanager
def worker_environment() -> Iterator[dict[str, str]]:
    """The environment a worker starts with (the caller's, ``OMP_NUM_THREADS=1``); the
    fork server, when first started inside, inherits it too."""
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield dict(os.environ)
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads


def enter_worker(sys_path: list[str], env: dict[str, str]) -> None:
    """First thing in a worker: the caller's ``sys.path`` and environment, and, in a
    forked one, RNGs of its own (Python's ``random`` reseeds itself after a fork)."""
    sys.path[:] = sys_path
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


atexit.register(stop_fork_servers)
