"""What every benchmark shares: launching torchrun jobs and child processes, timing, peak
memory, the page cache, ``dd``, and the identical model/data/optimizer every contender gets.

Launcher side (the ``python -m benchmarks`` process) never imports torch.distributed
state; each contender runs in its own ``torchrun`` job (:func:`torchrun`) so that peak
memory, imports and global state of one do not leak into the next.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

LR = 1e-3
WEIGHT_DECAY = 0.01
SEED = 1234

# GPT-2 presets shared by every suite: (model config, per-rank micro-batch, sequence length).
MODELS: dict[str, dict[str, int]] = {
    # ~0.1M parameters: the smoke test.
    "tiny": dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4),
    # ~3.3M parameters: step timing on two CPU cores.
    "small": dict(vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=4),
    # ~26M parameters (~315 MB of fp32 weights + Adam moments): checkpoint I/O.
    "io": dict(vocab_size=8192, n_positions=128, n_embd=512, n_layer=6, n_head=8),
    # ~200M parameters: one GPU (benchmarks/gpu.sh).
    "gpu": dict(vocab_size=32768, n_positions=1024, n_embd=1024, n_layer=12, n_head=16),
}

#: A model where communication dominates the step (step row only): ``layers`` x
#: ``Linear(width, width)`` + GELU and a mean-squared-error loss, 8.4M parameters at the
#: defaults, so 2 Psi of gradient traffic outweighs the forward and backward of a micro-batch
#: of 16 rows. GPT-2 "small" has about 40x more compute per parameter at its batch.
MLP: dict[str, int] = dict(width=1024, layers=8)


class BenchmarkError(RuntimeError):
    """A contender failed; the message says which and why."""


@dataclass
class Job:
    """Outcome of one launched job: its per-rank results (rank 0 first) or its error."""

    name: str
    ok: bool
    wall_s: float
    ranks: list[dict] = field(default_factory=list)
    error: str | None = None


def _env(threads: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if not cuda_available():
        # DeepSpeed otherwise probes for accelerators and may pick a CUDA build of torch.
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(extra or {})
    return env


def gloo_job(parser: Any, argv: list[str] | None, *, steps: int) -> tuple[Any, int, int]:
    """A torchrun benchmark script's start: ``--steps`` and ``--warmup`` added to
    ``parser``, arguments parsed, one intra-op thread, the gloo group; ``(args, rank,
    world)``."""
    import torch
    import torch.distributed as dist

    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return args, dist.get_rank(), dist.get_world_size()


def cuda_available() -> bool:
    if os.environ.get("ZS_BENCH_CPU"):
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _error_summary(result_dir: Path, output: str, rc: int | None) -> str:
    """The most useful short line: the first rank's exception, else the output's tail."""
    for path in sorted(result_dir.glob("rank*.err")):
        lines = [ln for ln in path.read_text().strip().splitlines() if ln.strip()]
        if lines:
            return f"{path.stem}: {lines[-1].strip()}"
    what = "timed out" if rc is None else f"exit status {rc}"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    markers = ("Error", "Exception", "terminate called", "Signal ", "Killed")
    hits = [ln for ln in lines if any(m in ln for m in markers) and "ChildFailedError" not in ln]
    tail = hits or lines
    return f"{what}: {tail[-1][:300] if tail else '(no output)'}"


def _communicate(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        return None, out
    except BaseException:  # interrupted (gpu.sh's time limit, Ctrl-C): leave no ranks behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise


#: How jobs start their ranks: ``torchrun`` (every measured run) or ``fork`` (``--quick``'s
#: default, [Note: forked ranks] in benchmarks/forked.py). Set by :func:`set_launcher`.
_launcher = {"kind": "torchrun"}
LAUNCHERS = ("torchrun", "fork")


def set_launcher(kind: str) -> None:
    if kind not in LAUNCHERS:
        raise ValueError(f"launcher {kind!r}: choose from {', '.join(LAUNCHERS)}")
    _launcher["kind"] = kind


def run_ranks(module: str, argv: list[str], *, nproc: int, env: dict[str, str],
              timeout: float) -> tuple[int | None, str]:
    """``torchrun --standalone --nproc_per_node=nproc -m module *argv``, or the same with
    forked ranks under ``set_launcher("fork")``: the exit status (None: timed out) and the
    output of every rank."""
    if _launcher["kind"] == "fork":
        from benchmarks.forked import run_forked

        return run_forked(module, argv, nproc=nproc, env=env, timeout=timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", module, *argv]
    return _communicate(cmd, env, timeout)


def torchrun(name: str, task: str, params: dict, *, nproc: int, timeout: float = 600.0,
             verbose: bool = False, env: dict[str, str] | None = None) -> Job:
    """Run ``benchmarks.worker`` task ``task`` on ``nproc`` ranks (a torchrun job, or forked
    ranks: :func:`set_launcher`); every rank returns a dict."""
    result_dir = Path(tempfile.mkdtemp(prefix=f"zs-bench-{name}-"))
    try:
        t0 = time.perf_counter()
        rc, out = run_ranks("benchmarks.worker", [task, json.dumps(params), str(result_dir)],
                            nproc=nproc, env=_env(params.get("threads", 1), env),
                            timeout=timeout)
        wall = time.perf_counter() - t0
        if verbose:
            print(out, file=sys.stderr)
        files = [result_dir / f"rank{r}.json" for r in range(nproc)]
        if rc == 0 and all(f.exists() for f in files):
            return Job(name, True, wall, [json.loads(f.read_text()) for f in files])
        return Job(name, False, wall, error=_error_summary(result_dir, out or "", rc))
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)


def launch(jobs: list[tuple[str, str, dict]], *, nproc: int, batch: bool, timeout: float,
           verbose: bool = False, before: Callable[[], Any] | None = None) -> dict[str, Job]:
    """Run ``(name, task, params)`` jobs on ``nproc`` ranks: one torchrun each (isolated
    peak memory and imports; ``before()`` runs ahead of each), or with ``batch`` all in
    one torchrun (one start-up)."""
    if not batch:
        out = {}
        for name, task, params in jobs:
            print(f"    {name} ...", flush=True)
            if before is not None:
                before()
            out[name] = torchrun(name, task, params, nproc=nproc, timeout=timeout,
                                 verbose=verbose)
        return out
    whole = torchrun("batch", "batch", {"jobs": [list(j) for j in jobs], "pg_timeout": 300},
                     nproc=nproc, timeout=timeout * 2, verbose=verbose)
    if not whole.ok:
        return {name: Job(name, False, whole.wall_s, error=whole.error) for name, _, _ in jobs}
    out = {}
    for name, _, _ in jobs:
        per_rank = [r[name] for r in whole.ranks]
        bad = next((r for r in per_rank if not r["ok"]), None)
        if bad is None:
            out[name] = Job(name, True, whole.wall_s, [r["result"] for r in per_rank])
        else:
            lines = [ln for ln in bad["error"].strip().splitlines() if ln.strip()]
            out[name] = Job(name, False, whole.wall_s, error=lines[-1] if lines else "failed")
    return out


def measure_child(cmd: list[str], *, timeout: float = 600.0,
                  env: dict[str, str] | None = None) -> dict:
    """Wall time and peak RSS (the largest process of the child's tree) of one command.

    The command runs under a fresh ``benchmarks.rss`` process whose only descendants are
    the command's, so its ``RUSAGE_CHILDREN`` high-water mark is the command's alone."""
    wrapper = [sys.executable, "-m", "benchmarks.rss", *cmd]
    rc, out = _communicate(wrapper, _env(1, env), timeout)
    lines = [ln for ln in (out or "").splitlines() if ln.startswith("ZS_BENCH_RSS ")]
    if rc != 0 or not lines:
        tail = "\n".join([ln for ln in (out or "").strip().splitlines()
                          if not ln.startswith("ZS_BENCH_RSS ")][-5:])
        raise BenchmarkError(f"{' '.join(cmd[:3])} ... failed (rc {rc}):\n{tail}")
    return json.loads(lines[-1].split(" ", 1)[1])


def peak_rss_bytes() -> int:
    """This process's high-water resident set size."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def drop_caches() -> bool:
    """Write back and drop the page cache; False when not permitted (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches_in_job() -> None:
    """Drop the page cache from inside a job, right before its timed read: one rank per
    host drops it between two barriers, so every rank starts reading together on a cold
    cache ([Note: cold reads]).

    [Note: cold reads]
    The load rows compare a load with ``cat`` of the same files, each on a cold page
    cache. Both must start the same time after the drop: on this VM how fast a cold read
    is depends on how long ago the cache was dropped. Measured with ``cat`` of the load
    row's 266 MB checkpoint by 3 processes, 8 alternating rounds each: 0.129 s best,
    0.144 s median right after the drop; 0.210 s and 0.220 s when it started 4 s after
    it. (This VM reports freed memory to its host, virtio-balloon free page reporting,
    which would explain it: a read a while after the drop fills pages the host has to
    supply anew.) A job used to get its drop before its
    processes started, so its load began seconds after it while ``cat`` began at once:
    that alone made a load look up to 1.5x slower than the disk. Now every load (ours and
    the peers') and every ``cat`` starts right after its drop."""
    import torch.distributed as dist

    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        drop_caches()
    dist.barrier()


def tree_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def dd_fsync_seconds(directory: str | Path, nbytes: int) -> float:
    """Seconds ``dd conv=fsync`` takes to write ``nbytes`` into ``directory`` (scaled to the
    exact byte count from whole 4 MiB blocks)."""
    path = Path(directory) / "zs-bench-dd.bin"
    count = max(1, -(-nbytes // (4 * MIB)))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}",
                    "conv=fsync"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds * nbytes / (count * 4 * MIB)


def deepspeed_config(*, stage: int, micro_batch: int, world: int, bf16: bool = False,
                     extra: dict[str, Any] | None = None) -> dict:
    """DeepSpeed ZeRO ``stage`` with plain torch AdamW (``torch_adam``: no compiled
    FusedAdam/CPUAdam op, so it runs on CPU), decaying every parameter like the others."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "optimizer": {"type": "AdamW",
                      "params": {"torch_adam": True, "lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra or {})
    return cfg


def version_of(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
