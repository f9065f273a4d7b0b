"""Run a function on N gloo ranks (CPU) and collect what each returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a
gloo process group on 127.0.0.1 in each, calls ``fn(rank, world_size, *args)`` and returns
the results in rank order. A worker's exception is re-raised in the caller as
:class:`WorkerError` carrying every failing rank's traceback; a launch that does not finish
within ``timeout`` seconds is killed and raises ``TimeoutError``, so tests never hang.

``fn`` must be importable (a module-level function); results must be picklable (tensors
are fine: they are pickled by value, not shared).

The ranks are new processes forked from fork servers that imported torch and zerostate
once ([Note: forked workers] in tests/fork_server.py); the pool's own tests use pooled
workers (tests/dist_pool.py, [Note: pool isolation]) kept alive across tests. A test
marked ``fresh_processes``, or a call with ``pooled=False``, gets spawned interpreters:
what only a fresh interpreter shows (interpreter exit, process-group teardown, crashes,
environment read at import, forking) needs them. Ports come from tests/ports.py
([Note: free ports]).
"""

from __future__ import annotations

import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import fork_server
from fork_server import WorkerError
from ports import free_port

__all__ = ["WorkerError", "free_port", "run_distributed", "run_script"]

DEFAULT_TIMEOUT_S = 240.0


def run_script(template: str, *, timeout: float = 120, **fields: Any):
    """Run ``template`` (dedented, ``str.format``-ed with ``fields`` plus ``tests``,
    ``engine_tests`` and a free ``port``) in a fresh Python process; the finished
    ``subprocess.CompletedProcess`` with text output. For what only a whole process shows:
    interpreter exit, finalisers, process-group teardown."""
    import subprocess
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = textwrap.dedent(template).format(
        tests=str(tests), engine_tests=str(tests / "engine"), port=free_port(), **fields
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )


def _worker(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    kwargs: dict,
    results: Any,
    sys_path: list[str],
    env: dict[str, str],
    pg_timeout_s: float,
) -> None:
    fork_server.enter_worker(sys_path, env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=pg_timeout_s)
        # A client of the caller's store ([Note: the store outlives the ranks]).
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        # gloo's init returns on a rank once its own connections are up; a rank whose
        # function ends at once (rank 0 of a test that outlives it) could then exit while
        # another rank is still connecting, which fails that rank's init with "Connection
        # closed by peer" (seen twice in 1557 tests, in two fresh-process tests).
        dist.barrier()
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    pooled: bool | None = None,
    spawn: bool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for rank in range(world_size)]`` on gloo.
    ``pooled=None`` pools unless the running test is marked ``fresh_processes``;
    ``pooled=False`` gives new processes, spawned interpreters unless ``spawn=False`` asks
    for processes forked from the fork servers ([Note: forked workers]): new processes
    that need no new interpreter (a peer that changes process-wide state, say)."""
    pg_timeout_s = max(30.0, timeout / 2)
    if pooled or (pooled is None and fork_server.pooling_allowed()):
        import dist_pool  # the pool's own tests only ([Note: pool isolation])

        return dist_pool.run_pooled(fn, world_size, args, kwargs, timeout, pg_timeout_s)
    if spawn is None:
        spawn = pooled is False  # asked for by name: a new interpreter
    return _run_fresh(fn, world_size, args, kwargs, timeout, pg_timeout_s, spawn)


def _run_fresh(
    fn: Callable,
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout: float,
    pg_timeout_s: float,
    spawn: bool,
) -> list[Any]:
    import torch.distributed as dist

    ctx = fork_server.start_context(spawn=spawn)
    results = ctx.Queue()
    port = free_port()
    # [Note: the store outlives the ranks]
    # The ranks' key-value store lives here, in the caller, as torchrun's agent hosts it
    # for its workers. With rank 0 hosting it (tcp:// init), rank 0's exit took it away
    # from ranks still at work: the ranks of a group without rank 0 (a shard group of an
    # HSDP 2 x 2 mesh) make their arrival check for close() in it, and may do so after
    # rank 0's group is done and gone. The HSDP round-trip test failed that way once
    # ("lost the process group's key-value store ... (Broken pipe)").
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    with fork_server.worker_environment() as env:
        procs = _start(ctx, fn, world_size, port, args, kwargs, results, env, pg_timeout_s)
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish within {timeout}s; "
                    f"ranks done: {sorted(got)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead and all(p.exitcode not in (0, None) for p in (procs[r] for r in dead)):
                    # A rank died without reporting (e.g. a crash); give the queue a moment.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise WorkerError(f"rank(s) exited without a result: {codes}") from None
                else:
                    continue
            got[rank] = (ok, payload)
            if not ok:
                # One rank failed: the others may be blocked in a collective; stop waiting
                # for them once they had a short grace period to report their own errors.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        del store  # every rank is gone: the server closes
    failures = {r: payload for r, (ok, payload) in got.items() if not ok}
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise WorkerError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _start(
    ctx: Any,
    fn: Callable,
    world_size: int,
    port: int,
    args: tuple,
    kwargs: dict,
    results: Any,
    env: dict[str, str],
    pg_timeout_s: float,
) -> list[Any]:
    procs = []
    for rank in range(world_size):
        worker_args = (fn, rank, world_size, port, args, kwargs, results, list(sys.path))
        proc = fork_server.new_process(ctx, rank, _worker, (*worker_args, env, pg_timeout_s))
        proc.start()
        procs.append(proc)
    return procs
