"""Run an example script on N ranks the way ``torchrun --nproc_per_node=N`` starts it, with
ranks forked from servers that imported the heavy libraries once.

[Note: forked launches]: a ``torchrun`` job of an example costs a launcher interpreter and,
per rank, an interpreter that imports torch and the example's framework before its first
line of work: 12 of the 14 CPU seconds of one 2-rank ``examples/hf_trainer.py`` job were
imports (measured on this machine), Lightning's ranks 7.7 s each. :func:`launch` gives each
rank what ``torchrun`` gives it (the environment variables ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``; ``sys.argv``; the script run as ``__main__``; its
exit status) in a process forked from fork server r of tests/fork_server.py's that also
imported the ``preload`` modules (started once per test process). What it does not
give: the elastic agent (restarts, rendezvous) and a new interpreter. Tests of those keep
real ``torchrun`` (tests/faults/test_torchrun_restart.py, tests/e2e/), and every example
launched here is also launched by real ``torchrun`` at least once in its own test file.
Modules whose import reads the environment must not be in ``preload`` unless the
environment the tests give them is the test process's own (``HF_HUB_OFFLINE`` is read by
huggingface_hub at import: the test process sets it before the servers start).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import fork_server
from ports import free_port

from benchmarks.forked import exit_status, torchrun_env

#: What the tests preload for each framework (one set each, so that files share servers).
LIGHTNING = ("lightning.pytorch", "zerostate.integrations.lightning")
HF_TRAINER = ("transformers.trainer", "zerostate.integrations.hf")


def _rank_main(script: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The rank's whole life: torchrun's environment, output to files, the script as
    ``__main__``, its exit status as the process's."""
    import runpy

    with open(out, "wb") as o, open(err, "wb") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    os._exit(exit_status(lambda: runpy.run_path(script, run_name="__main__")))


def launch(
    script: Path | str,
    nproc: int,
    args: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    workdir: Path,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc script *args`` with forked ranks ([Note: forked
    launches]); the outputs of all ranks, rank order, in the result. A rank that fails
    or overruns ``timeout`` ends the others, as torchrun does."""
    port = free_port()
    procs, files = [], []
    for rank in range(nproc):
        rank_env = torchrun_env(env, rank, nproc, port)
        out, err = workdir / f".rank{rank}.out", workdir / f".rank{rank}.err"
        files.append((out, err))
        proc = fork_server.forked_process(
            rank, _rank_main, (str(script), list(args), rank_env, str(out), str(err)), preload
        )
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout
    failed = False
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            failed = True
            time.sleep(0 if time.monotonic() > deadline else 2.0)  # let the others report
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=10)
    codes = [p.exitcode for p in procs]
    rc = 0 if all(c == 0 for c in codes) and not failed else 1
    stdout = "".join(o.read_text(errors="replace") for o, _ in files)
    stderr = "".join(f"--- rank {r} (exit {codes[r]}) ---\n" + e.read_text(errors="replace")
                     for r, (_, e) in enumerate(files))  # fmt: skip
    if time.monotonic() > deadline:
        stderr += f"\nforked launch: did not finish within {timeout} s\n"
    return subprocess.CompletedProcess([str(script), *args], rc, stdout, stderr)


def run_example(
    script: Path,
    nproc: int,
    argv: list[str],
    *,
    env: dict[str, str],
    workdir: Path,
    preload: tuple[str, ...],
    torchrun: bool = False,
    timeout: float = 400,
) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` ranks, under real ``torchrun`` when asked, else with forked
    ranks (:func:`launch`); fails the test with the output's tail unless every rank ends
    with status 0."""
    workdir.mkdir(parents=True, exist_ok=True)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(script), *argv]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    else:
        proc = launch(script, nproc, argv, env=env, timeout=timeout, workdir=workdir,
                      preload=preload)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc
