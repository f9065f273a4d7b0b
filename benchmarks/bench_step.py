"""Training-step time of zerostate against its peers, side by side, in one run.

Every contender trains the same GPT-2 (``zerostate.models.GPT2``) on the same seeded
random tokens, in fp32, with AdamW (lr 1e-3, default betas, weight decay 0.01). Each
contender runs in its own ``torchrun`` job (gloo on CPU, NCCL on GPU), one after the
other, so peak memory and import side effects of one do not leak into the next.

    python benchmarks/bench_step.py                      # all contenders, 2 ranks
    python benchmarks/bench_step.py --only ddp,zs0 --steps 10 --json out.json
    python benchmarks/bench_step.py --model tiny --steps 2 --only ddp,fsdp2

Exit status: 0 when every peer ran (a failing zerostate contender is reported in the
table and does not change it), 1 when a peer failed, 2 for bad arguments.
See benchmarks/README.md for what each contender is and the caveats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import deepspeed_config, run_worker

REPO = Path(__file__).resolve().parent.parent

LR = 1e-3
WEIGHT_DECAY = 0.01
SEED = 1234
DATA_POOL = 2  # fixed batches per rank, cycled

# name -> (stage whose partitioning it does, description). Order is the run order.
PEERS: dict[str, tuple[int, str]] = {
    "ddp": (0, "DDP + torch.optim.AdamW"),
    "zero1opt": (1, "DDP + torch ZeroRedundancyOptimizer(AdamW)"),
    "ds1": (1, "DeepSpeed ZeRO-1"),
    "ds2": (2, "DeepSpeed ZeRO-2"),
    "fsdp2_noreshard": (2, "FSDP2 fully_shard(reshard_after_forward=False) + AdamW"),
    "ds3": (3, "DeepSpeed ZeRO-3"),
    "fsdp2": (3, "FSDP2 fully_shard + AdamW"),
}
ZEROSTATE: dict[str, tuple[int, str]] = {
    f"zs{s}": (s, f"zerostate.Engine(stage={s})") for s in range(4)
}
CONTENDERS: dict[str, tuple[int, str]] = {**PEERS, **ZEROSTATE}

# Model presets: GPT-2 config plus per-rank micro-batch and sequence length.
MODELS: dict[str, dict[str, int]] = {
    # ~3.3M parameters; one 2-rank step is on the order of 100 ms on a couple of CPU cores.
    "small": dict(
        vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=4, micro_batch=8, seq_len=64
    ),
    # ~0.1M parameters; a whole run takes seconds (smoke tests).
    "tiny": dict(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, micro_batch=4, seq_len=32
    ),
}


# --------------------------------------------------------------------------------------
# Worker side: one contender, one rank, inside torchrun.
# --------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """What the timing loop needs from a contender: one full training step."""

    step: object  # callable (idx, targets) -> loss tensor
    model: object  # the wrapped model, kept alive for the run


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # fall back to /proc on Linux
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _build_model(preset: dict[str, int], device):
    import torch

    from zerostate.models import GPT2, GPT2Config

    cfg = GPT2Config(**{k: v for k, v in preset.items() if k not in ("micro_batch", "seq_len")})
    torch.manual_seed(SEED)  # identical initial weights on every rank and for every contender
    return GPT2(cfg).to(device)


def _adamw(params, **kw):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **kw)


def _make_torch_trainer(model, optimizer) -> Trainer:
    def step(idx, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        return loss

    return Trainer(step=step, model=model)


def _setup_ddp(model, device, zero_optimizer: bool) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if zero_optimizer:
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
        )
    else:
        opt = _adamw(ddp.parameters())
    return _make_torch_trainer(ddp, opt)


def _setup_fsdp2(model, reshard_after_forward: bool) -> Trainer:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return _make_torch_trainer(model, _adamw(model.parameters()))


def _setup_deepspeed(model, stage: int, micro_batch: int, world: int) -> Trainer:
    import deepspeed

    config = deepspeed_config(
        stage=stage, micro_batch=micro_batch, world=world, lr=LR, weight_decay=WEIGHT_DECAY
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return Trainer(step=step, model=engine)


def _setup_zerostate(model, stage: int) -> Trainer:
    import zerostate

    engine = zerostate.Engine(
        model, stage=stage, lr=LR, weight_decay=WEIGHT_DECAY, precision="fp32"
    )

    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return Trainer(step=step, model=engine)


def _setup(name: str, model, device, preset: dict[str, int], world: int) -> Trainer:
    if name == "ddp":
        return _setup_ddp(model, device, zero_optimizer=False)
    if name == "zero1opt":
        return _setup_ddp(model, device, zero_optimizer=True)
    if name == "fsdp2":
        return _setup_fsdp2(model, reshard_after_forward=True)
    if name == "fsdp2_noreshard":
        return _setup_fsdp2(model, reshard_after_forward=False)
    if name in ("ds1", "ds2", "ds3"):
        return _setup_deepspeed(model, int(name[2]), preset["micro_batch"], world)
    if name in ZEROSTATE:
        return _setup_zerostate(model, int(name[2]))
    raise ValueError(f"unknown contender {name!r}")


def _worker(args: argparse.Namespace, rank: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=args.pg_timeout)

    if args.worker.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    else:
        kw = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend, timeout=timeout, **kw)

    preset = MODELS[args.model]
    rss_before_model = _rss_bytes()
    model = _build_model(preset, device)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = _setup(args.worker, model, device, preset, world)

    # Same seeded tokens for every contender, different per rank. Each rank cycles over a
    # few fixed batches, so a model that trains memorises them and its loss must fall.
    g = torch.Generator().manual_seed(SEED + 1000 * rank)
    total = args.warmup + args.steps
    shape = (DATA_POOL, preset["micro_batch"], preset["seq_len"] + 1)
    tokens = torch.randint(0, preset["vocab_size"], shape, generator=g).to(device)

    times: list[float] = []
    losses: list[float] = []
    for i in range(total):
        idx, targets = tokens[i % DATA_POOL, :, :-1], tokens[i % DATA_POOL, :, 1:]
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = trainer.step(idx, targets)
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))  # outside the timed region
        if i >= args.warmup:
            times.append(dt)

    # A step is as slow as its slowest rank: per step, take the max over ranks.
    local = {
        "times": times,
        "losses": losses,
        "peak_rss": _peak_rss_bytes(),
        "rss_before_model": rss_before_model,
        "peak_cuda": torch.cuda.max_memory_allocated(device) if use_cuda else None,
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        per_step = [max(r["times"][i] for r in gathered) for i in range(len(times))]
        mean_loss = lambda j: sum(r["losses"][j] for r in gathered) / world
        result = {
            "name": args.worker,
            "ok": True,
            "n_params": n_params,
            "world_size": world,
            "backend": backend,
            "step_time_median_s": statistics.median(per_step),
            "step_time_min_s": min(per_step),
            "step_times_s": per_step,
            "loss_first": mean_loss(0),
            "loss_last": mean_loss(-1),
            "peak_rss_mb": [r["peak_rss"] / 2**20 for r in gathered],
            "rss_before_model_mb": [r["rss_before_model"] / 2**20 for r in gathered],
            "peak_cuda_mb": ([r["peak_cuda"] / 2**20 for r in gathered] if use_cuda else None),
        }
        Path(args.result_file).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Launcher side: one torchrun job per contender, then the table.
# --------------------------------------------------------------------------------------


def _error_summary(result_file: Path, stderr: str, rc: int | None) -> str:
    """The most useful short line: the first rank's exception, else the stderr tail."""
    errs = sorted(result_file.parent.glob(result_file.name + ".rank*.err"))
    for path in errs:
        lines = [ln for ln in path.read_text().strip().splitlines() if ln.strip()]
        if lines:
            return f"{path.name.split('.')[-2]}: {lines[-1].strip()}"
    what = "timed out" if rc is None else f"exit status {rc}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    markers = ("Error", "Exception", "terminate called", "Signal ", "Killed")
    hits = [ln for ln in lines if any(m in ln for m in markers) and "ChildFailedError" not in ln]
    tail = hits or lines
    return f"{what}: {tail[-1] if tail else '(no output)'}"


def run_contender(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    result_file = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--result-file",
        str(result_file),
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--pg-timeout",
        str(args.timeout),
    ]
    if args.cpu:
        cmd.append("--cpu")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if name.startswith("ds") and (args.cpu or not _cuda_available()):
        # DeepSpeed otherwise probes for accelerators (and may pick a CUDA build of torch).
        env.setdefault("DS_ACCELERATOR", "cpu")
    stage, desc = CONTENDERS[name]
    base = {
        "name": name,
        "stage": stage,
        "description": desc,
        "kind": "peer" if name in PEERS else "zerostate",
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and all its ranks
        out, _ = proc.communicate()
        rc = None
    wall = time.perf_counter() - t0
    if args.verbose:
        print(out, file=sys.stderr)
    if rc == 0 and result_file.exists():
        return {**base, **json.loads(result_file.read_text()), "wall_s": wall}
    return {
        **base,
        "ok": False,
        "wall_s": wall,
        "error": _error_summary(result_file, out or "", rc),
    }


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def summarize(results: list[dict]) -> list[dict]:
    """Per stage: the fastest peer and zerostate's step time as a ratio of it."""
    groups = []
    for stage in range(4):
        rows = [r for r in results if r["stage"] == stage]
        if not rows:
            continue
        peers = [r for r in rows if r["kind"] == "peer" and r["ok"]]
        fastest = min(peers, key=lambda r: r["step_time_median_s"]) if peers else None
        zs = next((r for r in rows if r["kind"] == "zerostate"), None)
        ratio = None
        if fastest and zs and zs["ok"]:
            ratio = zs["step_time_median_s"] / fastest["step_time_median_s"]
        groups.append(
            {
                "stage": stage,
                "contenders": [r["name"] for r in rows],
                "fastest_peer": fastest["name"] if fastest else None,
                "zerostate": zs["name"] if zs else None,
                "ratio_zerostate_over_fastest_peer": ratio,
            }
        )
    return groups


def format_table(results: list[dict], groups: list[dict]) -> str:
    by_name = {r["name"]: r for r in results}
    head = (
        f"{'stage':<6}{'contender':<17}{'median ms':>10}{'vs fastest':>11}"
        f"{'peak RSS MB/rank':>18}{'loss first->last':>19}  description"
    )
    lines = [head, "-" * len(head)]
    for g in groups:
        fastest = by_name[g["fastest_peer"]] if g["fastest_peer"] else None
        for name in g["contenders"]:
            r = by_name[name]
            if not r["ok"]:
                lines.append(f"{g['stage']:<6}{name:<17}{'FAILED':>10}  {r['error']}")
                continue
            ms = r["step_time_median_s"] * 1e3
            rel = (
                f"{r['step_time_median_s'] / fastest['step_time_median_s']:.2f}x"
                if fastest
                else "-"
            )
            rss = "/".join(f"{m:.0f}" for m in r["peak_rss_mb"])
            loss = f"{r['loss_first']:.3f}->{r['loss_last']:.3f}"
            lines.append(
                f"{g['stage']:<6}{name:<17}{ms:>10.1f}{rel:>11}{rss:>18}{loss:>19}"
                f"  {r['description']}"
            )
        ratio = g["ratio_zerostate_over_fastest_peer"]
        verdict = (
            "n/a"
            if ratio is None
            else f"{ratio:.2f} ({'meets' if ratio <= 1.0 else 'misses'} target <= 1.00)"
        )
        lines.append(
            f"      stage {g['stage']}: {g['zerostate'] or '-'} / fastest peer "
            f"({g['fastest_peer'] or '-'}) = {verdict}"
        )
        lines.append("")
    return "\n".join(lines).rstrip()


def _parse_only(value: str | None) -> list[str]:
    if not value:
        return list(CONTENDERS)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    return [n for n in CONTENDERS if n in names]  # canonical order


def launcher_main(args: argparse.Namespace) -> int:
    try:
        names = _parse_only(args.only)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    preset = MODELS[args.model]
    print(
        f"model={args.model} {preset} nproc={args.nproc} steps={args.steps} "
        f"warmup={args.warmup} threads/rank={args.threads}",
        file=sys.stderr,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        for name in names:
            print(f"  running {name} ...", file=sys.stderr, flush=True)
            r = run_contender(name, args, Path(tmp))
            status = (
                f"{r['step_time_median_s'] * 1e3:.1f} ms" if r["ok"] else f"FAILED: {r['error']}"
            )
            print(f"  {name}: {status}", file=sys.stderr, flush=True)
            results.append(r)
    groups = summarize(results)
    print(format_table(results, groups))
    if args.json:
        report = {
            "config": {
                "model": args.model,
                **preset,
                "nproc": args.nproc,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads_per_rank": args.threads,
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                "precision": "fp32",
                "seed": SEED,
                "data_pool": DATA_POOL,
                "torch": _version("torch"),
                "deepspeed": _version("deepspeed"),
            },
            "results": results,
            "groups": groups,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failed_peers = [r["name"] for r in results if r["kind"] == "peer" and not r["ok"]]
    if failed_peers:
        print(f"peer(s) failed: {', '.join(failed_peers)}", file=sys.stderr)
        return 1
    return 0


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per contender (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--model", choices=list(MODELS), default="small")
    p.add_argument("--json", metavar="OUT", help="also write the full results as JSON")
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)"
    )
    p.add_argument("--cpu", action="store_true", help="run on CPU/gloo even if CUDA is present")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a contender is killed (default 600)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="echo each contender's torchrun output to stderr",
    )
    # internal: set by the launcher for the torchrun workers
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--pg-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.nproc < 1 or args.threads < 1:
        p.error("--steps, --nproc and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(_worker, args)  # does not return
    if "LOCAL_RANK" in os.environ:
        print(
            "bench_step.py launches its own torchrun jobs; run it with plain `python`.",
            file=sys.stderr,
        )
        return 2
    return launcher_main(args)


if __name__ == "__main__":
    sys.exit(main())
