"""Ranks forked from one process that imported the libraries once: the ``--quick`` launcher.

[Note: forked ranks]
A ``torchrun`` job pays a launcher interpreter and, per rank, an interpreter that imports
torch, transformers and DeepSpeed before its first step: about 5 CPU s per rank on this
2-core machine, so the quick run's jobs (tiny models, a second of work each) spent most of
their time starting. With ``--launcher fork`` (the default of ``--quick``) the launcher
keeps one *zygote*, ``python -m benchmarks.forked``, which imports those libraries once and
starts no thread; each job's ranks are ``fork()``ed from it and given what ``torchrun``
gives a rank: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts the store),
``TORCHELASTIC_RUN_ID``, the module run as ``__main__`` with its ``sys.argv``, and its exit
status. A rank that fails ends the others after a grace period, as torchrun does; a job
that overruns its time ends the zygote and every rank (the next job starts a new one).

What a fork does not give, and why the measured runs keep ``torchrun``: peak RSS is a
process's high-water mark, so a forked rank's includes the zygote's imports at the moment
of the fork (close to what a new interpreter imports, but not the same), and no elastic
agent watches it. Numbers from ``--quick`` are smoke, not measurements, either way.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: Imported by the zygote before any fork: what the contenders' ranks import.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "zerostate",
    "zerostate.engine",
    "deepspeed",
)
GRACE_S = 5.0  # how long the other ranks of a failed job get to report before they end


# ------------------------------------------------------------------ the zygote's side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


_channel: int | None = None  # the zygote's answers go here, not to fd 1


def _rank(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """A forked rank's whole life; never returns."""
    import runpy

    code = 1
    try:
        if _channel is not None:
            os.close(_channel)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # a new process seeds ``random`` from the OS; a fork inherits it
        sys.argv = [module, *argv]
        code = exit_status(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    finally:
        os._exit(code)


def exit_status(main: Callable[[], object]) -> int:
    """Run ``main`` the way the interpreter runs ``__main__``, and return the exit status it
    would end with: ``SystemExit``'s code, or 1 after an uncaught exception, whose traceback
    is printed. Output is flushed (the caller ends with ``os._exit``)."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def torchrun_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """``env`` plus what ``torchrun --nproc_per_node=nproc`` on one node gives rank
    ``rank``; rank 0 hosts the store on 127.0.0.1:``port``."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"forked-{os.getpid()}-{port}")


def _run_job(req: dict) -> list[int | None]:
    """Fork ``req['nproc']`` ranks of ``req['module']``; their exit codes (negative: a
    signal), once every rank has ended."""
    nproc, port = req["nproc"], _free_port()
    pids = []
    for rank in range(nproc):
        env = torchrun_env(req["env"], rank, nproc, port)
        pid = os.fork()
        if pid == 0:
            _rank(req["module"], req["argv"], env, req["log"])
        pids.append(pid)
    codes: dict[int, int | None] = {}
    kill_at = None
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for p in pids:
                    if p not in codes:
                        os.kill(p, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.02)
            continue
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and kill_at is None:
                kill_at = time.monotonic() + GRACE_S  # the others may still report theirs
    return [codes[p] for p in pids]


def serve(preload: list[str]) -> None:
    """The zygote: import ``preload`` (``deepspeed``: the contenders' way, without its
    compiled op), say ``ready`` (or why not), then run one job per line of stdin. Answers
    go to the original stdout; what the imports print goes to stderr."""
    global _channel
    _channel = os.dup(1)
    os.dup2(2, 1)
    with os.fdopen(_channel, "w", closefd=False) as out:

        def answer(obj: dict) -> None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

        try:
            for name in preload:
                if name == "deepspeed":
                    from benchmarks.deepspeed_import import import_deepspeed

                    import_deepspeed()
                else:
                    __import__(name)
        except Exception as exc:  # noqa: BLE001 - reported to the launcher, which says it
            answer({"error": f"preloading: {type(exc).__name__}: {exc}"})
            return
        if _threads() != 1:  # forking a process with threads copies only the calling one
            answer({"error": f"{_threads()} threads after the imports; forking is unsafe"})
            return
        answer({"ready": True})
        for line in sys.stdin:
            answer({"codes": _run_job(json.loads(line))})


# ------------------------------------------------------------------ the launcher's side
class Zygote:
    """The launcher's handle on the zygote, started on first use."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload
        self.proc: subprocess.Popen | None = None

    def _start(self, env: dict[str, str], deadline: float) -> tuple[int | None, str] | None:
        """Start the zygote; None once it is ready, else the job's (status, output)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.forked",
                                      *self.preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        answer = self._answer(deadline)
        if answer is not None and answer.get("ready"):
            return None
        self.stop()
        why = "did not start in time" if answer is None else answer.get("error")
        return (None if answer is None else 1), f"benchmarks.forked: the zygote {why}"

    def _answer(self, deadline: float) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                return json.loads(line) if line else {"error": "the zygote exited"}

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and every rank
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def run(self, module: str, argv: list[str], *, nproc: int, env: dict[str, str],
            timeout: float) -> tuple[int | None, str]:
        """``torchrun --nproc_per_node=nproc -m module *argv`` with forked ranks: the exit
        status (0 when every rank ended with 0, None on a timeout) and the ranks' output."""
        deadline = time.monotonic() + timeout
        if self.proc is None or self.proc.poll() is not None:
            failed = self._start(env, deadline)
            if failed is not None:
                return failed
        assert self.proc is not None and self.proc.stdin is not None
        fd, log = tempfile.mkstemp(prefix="zs-bench-forked-", suffix=".log")
        os.close(fd)
        try:
            self.proc.stdin.write(json.dumps({"module": module, "argv": argv, "nproc": nproc,
                                              "env": env, "log": log}) + "\n")
            self.proc.stdin.flush()
            answer = self._answer(deadline)
            if answer is None or "codes" not in answer:
                self.stop()  # overran (or died): end it and every rank; the next job starts anew
                rc = None if answer is None else 1
            else:
                codes = answer["codes"]
                rc = 0 if all(c == 0 for c in codes) else next(c for c in codes if c != 0)
            return rc, Path(log).read_text(errors="replace")
        finally:
            os.unlink(log)


_zygote = Zygote()
atexit.register(_zygote.stop)


def run_forked(module: str, argv: list[str], *, nproc: int, env: dict[str, str],
               timeout: float) -> tuple[int | None, str]:
    """:meth:`Zygote.run` on the launcher's one zygote ([Note: forked ranks])."""
    return _zygote.run(module, argv, nproc=nproc, env=env, timeout=timeout)


if __name__ == "__main__":
    serve(sys.argv[1:])
