"""``zerostate consolidate`` against DeepSpeed's ``zero_to_fp32.py`` on the same model.

One run does everything, in a temporary directory that is deleted at the end:

1. Trains the same GPT-2 (``zerostate.models.GPT2``, identical seeded initial weights, the
   same seeded tokens per rank, fp32, AdamW lr 1e-3 / weight decay 0.01) for ONE optimizer
   step twice, each under ``torchrun --nproc_per_node=N`` on CPU/gloo:
   DeepSpeed ZeRO (stage 2, or 3 with ``--ds-stage 3``) then ``engine.save_checkpoint``,
   and ``zerostate.Engine(stage=2)`` then ``engine.save``. Both checkpoints hold fp32
   master weights and both Adam moments, partitioned over the ranks.
2. Consolidates each to safetensors in a child process, measuring wall time and peak RSS
   (GNU ``/usr/bin/time``; psutil polling of the child tree if it is missing):
   ``python <ds ckpt>/zero_to_fp32.py <ds ckpt> <out dir> --safe_serialization`` and
   ``zerostate consolidate <zs ckpt> <out>.safetensors``. The page cache is dropped before
   each timed run when this process may do so (root); otherwise each tool runs once
   untimed to warm the cache and once timed.
3. Checks that both outputs hold the same model: the same tensor names (DeepSpeed also
   writes tied aliases such as ``lm_head.weight``; zerostate writes a tied tensor once,
   under its canonical name) and shapes, and values that agree within fp32 rounding: both
   runs took the same single step from the same weights on the same data.

    python benchmarks/bench_consolidate_vs_deepspeed.py                # ~1 GB of fp32 weights
    python benchmarks/bench_consolidate_vs_deepspeed.py --small        # about a minute
    python benchmarks/bench_consolidate_vs_deepspeed.py --ds-stage 3 --json out.json

Exit status: 0 when both tools ran and the outputs match, 1 otherwise, 2 for bad arguments.
See benchmarks/README.md ("Consolidation vs DeepSpeed zero_to_fp32") for the caveats.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import deepspeed_config, drop_caches, run_worker

REPO = Path(__file__).resolve().parent.parent
MB = 10**6

LR = 1e-3
WEIGHT_DECAY = 0.01
SEED = 1234

# GPT-2 shapes. default: ~254M parameters (~1.02 GB fp32), vocab 50257 as GPT-2's;
# small: ~17M parameters (~68 MB), for a run of about a minute.
SIZES: dict[str, dict[str, int]] = {
    "default": dict(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=16, n_head=16),
    "small": dict(vocab_size=8192, n_positions=128, n_embd=512, n_layer=4, n_head=8),
}

# Values of the two outputs must agree within this (absolute; fp32 weights of order 0.02-1).
# Both are one AdamW step of size ~lr from the same weights on the same data, with the same
# hyper-parameters (weight decay on every parameter in both), so they can differ only by
# the rounding of the gradient reduction; in practice they are bit-identical.
ATOL = 1e-6
# An element whose gradient is at the level of rounding noise (|g| ~ 1e-9) may get an Adam
# update of a different sign in the two runs (Adam's first step is ~lr * sign(g)). Allow
# such elements, but only a tiny fraction of them, and never by more than 2.1 x lr.
MAX_FRACTION_BEYOND_ATOL = 1e-4
MAX_ABS_DIFF = 2.1 * LR * (1 + WEIGHT_DECAY)


# --------------------------------------------------------------------------------------
# Worker side: one rank inside torchrun, trains one step and saves a checkpoint.
# --------------------------------------------------------------------------------------


def _model_config(args: argparse.Namespace) -> dict[str, int]:
    return dict(
        vocab_size=args.vocab_size,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
    )


def _build_model(cfg: dict[str, int]):
    import torch

    from zerostate.models import GPT2, GPT2Config

    torch.manual_seed(SEED)  # identical initial weights on every rank and for both tools
    return GPT2(GPT2Config(**cfg))


def _tokens(args: argparse.Namespace, rank: int):
    import torch

    g = torch.Generator().manual_seed(SEED + 1000 * rank)  # per rank, same for both tools
    toks = torch.randint(0, args.vocab_size, (1, args.seq_len + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def _worker(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    timeout = _dt.timedelta(seconds=args.timeout)
    if args.worker == "ds":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    world = dist.get_world_size()

    cfg = _model_config(args)
    t0 = time.perf_counter()
    model = _build_model(cfg)
    build_s = time.perf_counter() - t0
    params = dict(model.named_parameters())  # unique parameters, first name wins
    n_params = sum(p.numel() for p in params.values())
    # Before the engine is built: DeepSpeed ZeRO-3 empties the module's parameters in place.
    largest_name, largest_t = max(
        model.state_dict().items(), key=lambda kv: kv[1].numel() * kv[1].element_size()
    )
    largest = largest_t.numel() * largest_t.element_size()
    canonical = {id(p): n for n, p in params.items()}
    tied = {
        n: canonical[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if canonical[id(p)] != n
    }
    idx, targets = _tokens(args, rank)

    t0 = time.perf_counter()
    if args.worker == "ds":
        import deepspeed

        config = deepspeed_config(
            stage=args.ds_stage, micro_batch=1, world=world, lr=LR, weight_decay=WEIGHT_DECAY
        )
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        save = lambda: engine.save_checkpoint(args.ckpt)
        stage = args.ds_stage
    else:
        import zerostate

        # DeepSpeed's AdamW decays every parameter; zerostate by default exempts 1-D ones
        # (biases, LayerNorm). Decay everything here too, so both take the same step.
        engine = zerostate.Engine(
            model,
            stage=2,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            precision="fp32",
            no_decay=lambda name, p: False,
        )
        save = lambda: engine.save(args.ckpt)
        stage = 2
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    loss = engine(idx, targets)
    engine.backward(loss)
    engine.step()
    step_s = time.perf_counter() - t0

    dist.barrier()
    t0 = time.perf_counter()
    save()
    dist.barrier()
    save_s = time.perf_counter() - t0

    gathered: list = [None] * world
    dist.all_gather_object(gathered, float(loss.detach()))
    if rank == 0:
        result = {
            "tool": args.worker,
            "stage": stage,
            "world_size": world,
            "n_params": n_params,
            "largest_tensor_bytes": largest,
            "largest_tensor": largest_name,
            "tied": tied,
            "loss_per_rank": gathered,
            "build_s": build_s,
            "setup_s": setup_s,
            "step_s": step_s,
            "save_s": save_s,
        }
        Path(args.result_file).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Launcher side.
# --------------------------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text: str, n: int = 15) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def train_and_save(tool: str, args: argparse.Namespace, work: Path) -> dict:
    """One torchrun job: one step, one checkpoint under ``work/<tool>-ckpt``."""
    ckpt = work / f"{tool}-ckpt"
    result_file = work / f"{tool}-train.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        tool,
        "--ckpt",
        str(ckpt),
        "--result-file",
        str(result_file),
        "--ds-stage",
        str(args.ds_stage),
        "--seq-len",
        str(args.seq_len),
        "--threads",
        str(args.threads),
        "--timeout",
        str(args.timeout),
    ]
    for key, value in _model_config(args).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
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
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise BenchError(f"{tool} training job timed out after {args.timeout} s") from None
    except BaseException:
        _kill_group(proc)
        raise
    wall = time.perf_counter() - t0
    if args.verbose:
        print(out, file=sys.stderr)
    if proc.returncode != 0 or not result_file.exists():
        errs = sorted(work.glob(result_file.name + ".rank*.err"))
        detail = errs[0].read_text() if errs else out
        raise BenchError(f"{tool} training job failed ({proc.returncode}):\n{_tail(detail)}")
    result = json.loads(result_file.read_text())
    result.update(job_wall_s=wall, ckpt=str(ckpt), ckpt_bytes=_tree_bytes(ckpt))
    return result


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


GNU_TIME = "/usr/bin/time"


def _has_gnu_time() -> bool:
    if not os.access(GNU_TIME, os.X_OK):
        return False
    probe = subprocess.run([GNU_TIME, "-v", "true"], capture_output=True, text=True)
    return "Maximum resident set size" in probe.stderr


def run_measured(cmd: list[str], env: dict, timeout: float, report: Path, use_time: bool) -> dict:
    """Run ``cmd``; wall seconds and peak RSS (bytes) of the command's process tree."""
    if use_time:
        cmd = [GNU_TIME, "-v", "-o", str(report), *cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    polled = 0
    try:
        if use_time:
            out, err = proc.communicate(timeout=timeout)
        else:
            import psutil

            watched = psutil.Process(proc.pid)
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                try:
                    tree = [watched, *watched.children(recursive=True)]
                    polled = max(polled, sum(p.memory_info().rss for p in tree))
                except psutil.Error:
                    pass
                time.sleep(0.005)
            out, err = proc.communicate()
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise BenchError(f"timed out after {timeout} s: {' '.join(cmd)}") from None
    except BaseException:
        _kill_group(proc)
        raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise BenchError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{_tail(out + err)}")
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", report.read_text())
        if not m:
            raise BenchError(f"no peak RSS in {report}")
        peak, how = int(m.group(1)) * 1024, "/usr/bin/time -v (kernel max RSS)"
    else:
        peak, how = polled, "psutil, child tree polled every 5 ms"
    return {"wall_s": wall, "peak_rss_bytes": peak, "rss_method": how}


def consolidate_both(args: argparse.Namespace, work: Path, ds: dict, zs: dict) -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"  # zero_to_fp32.py imports deepspeed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    zs_cli = Path(sys.executable).with_name("zerostate")
    zs_cmd = [str(zs_cli)] if zs_cli.exists() else [sys.executable, "-m", "zerostate_cli.main"]

    ds_ckpt = Path(ds["ckpt"])
    ds_script = ds_ckpt / "zero_to_fp32.py"
    if not ds_script.exists():
        raise BenchError(f"DeepSpeed did not copy zero_to_fp32.py into {ds_ckpt}")
    ds_out, zs_out = work / "ds-out", work / "zs-out" / "model.safetensors"
    ds_cmd = [sys.executable, str(ds_script), str(ds_ckpt), str(ds_out)]
    tools = {
        "deepspeed": {
            "cmd": ds_cmd + (["--safe_serialization"] if args.ds_format != "bin" else []),
            "out": ds_out,
        },
        "zerostate": {
            "cmd": [*zs_cmd, "consolidate", zs["ckpt"], str(zs_out), "-q"],
            "out": zs_out,
        },
    }
    use_time = _has_gnu_time()
    results: dict = {}
    if args.ds_format == "auto":
        # zero_to_fp32.py --safe_serialization hands safetensors' save_file a state dict in
        # which tied parameters share storage, which save_file refuses. Try it once
        # (untimed); on that failure time its default pickle output (torch.save keeps
        # shared storage once) instead.
        try:
            run_measured(tools["deepspeed"]["cmd"], env, args.timeout, work / "t.txt", use_time)
        except BenchError as exc:
            if "share memory" not in str(exc):
                raise
            results["deepspeed_safetensors_error"] = _tail(str(exc), 3)
            print(
                "zero_to_fp32.py --safe_serialization failed on tied weights; "
                "timing its default pytorch_model.bin output instead",
                file=sys.stderr,
            )
            tools["deepspeed"]["cmd"] = ds_cmd
        _remove(ds_out)
    cache = args.cache
    if cache == "cold" and not drop_caches():
        print("cannot drop the page cache (not root): warm runs instead", file=sys.stderr)
        cache = "warm"
    if cache == "warm":  # one untimed run each, so the checkpoints and imports are cached
        for tool in tools.values():
            tool["out"].parent.mkdir(parents=True, exist_ok=True)
            run_measured(tool["cmd"], env, args.timeout, work / "t.txt", use_time)
            _remove(tool["out"])
    runs: dict[str, list[dict]] = {name: [] for name in tools}
    for i in range(args.repeat):
        # Alternate the order, so that drift on a shared machine does not favour one tool.
        for name in list(tools) if i % 2 == 0 else list(tools)[::-1]:
            tool = tools[name]
            _remove(tool["out"])
            tool["out"].parent.mkdir(parents=True, exist_ok=True)
            if cache == "cold":
                drop_caches()
            print(
                f"consolidating with {name} ({cache} cache, run {i + 1}/{args.repeat}) ...",
                file=sys.stderr,
                flush=True,
            )
            runs[name].append(
                run_measured(tool["cmd"], env, args.timeout, work / f"{name}-time.txt", use_time)
            )
    for name, tool in tools.items():
        out = tool["out"]
        files = sorted(p for p in (out.rglob("*") if out.is_dir() else [out]) if p.is_file())
        walls = [r["wall_s"] for r in runs[name]]
        peaks = [r["peak_rss_bytes"] for r in runs[name]]
        results[name] = {
            "wall_s": statistics.median(walls),
            "wall_s_runs": walls,
            "peak_rss_bytes": max(peaks),
            "peak_rss_bytes_runs": peaks,
            "rss_method": runs[name][0]["rss_method"],
            "command": " ".join(tool["cmd"]),
            "output_files": [str(p.relative_to(work)) for p in files],
            "output_bytes": sum(p.stat().st_size for p in files),
            "output_format": "safetensors"
            if all(p.suffix == ".safetensors" for p in files if p.suffix != ".json")
            else "torch.save (pickle)",
        }
    results["cache"] = (
        "cold: page cache dropped before each timed run"
        if cache == "cold"
        else "warm: each tool ran once untimed first"
    )
    results["repeat"] = args.repeat
    return results


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class _Pickled:
    """``safe_open``'s two methods over a memory-mapped ``torch.save`` file."""

    def __init__(self, path: Path) -> None:
        import torch

        self._sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def keys(self) -> list[str]:
        return list(self._sd)

    def get_tensor(self, name: str):
        return self._sd[name]


def compare_outputs(args: argparse.Namespace, work: Path, ds: dict, cons: dict) -> dict:
    """Same names (modulo tied aliases), shapes, dtypes, and values within fp32 rounding."""
    import torch
    from safetensors import safe_open

    torch.manual_seed(SEED)
    with torch.no_grad():  # the shared starting point
        init = {k: v.detach() for k, v in _build_model(_model_config(args)).state_dict().items()}
    ds_files = [work / p for p in cons["deepspeed"]["output_files"] if not p.endswith(".json")]
    zs_file = work / cons["zerostate"]["output_files"][0]
    ds_where: dict = {}
    for path in ds_files:
        h = _Pickled(path) if path.suffix == ".bin" else safe_open(str(path), framework="pt")
        ds_where.update((k, h) for k in h.keys())
    zs_h = safe_open(str(zs_file), framework="pt")
    zs_names, ds_names = set(zs_h.keys()), set(ds_where)
    tied: dict[str, str] = ds["tied"]
    problems: list[str] = []

    # DeepSpeed writes tied aliases too; zerostate writes each tied tensor once.
    for alias, canonical in tied.items():
        if alias in ds_names:
            if not torch.equal(
                ds_where[alias].get_tensor(alias), ds_where[canonical].get_tensor(canonical)
            ):
                problems.append(f"deepspeed: tied alias {alias} differs from {canonical}")
            ds_names.discard(alias)
    if zs_names != ds_names:
        problems.append(
            f"names differ: only zerostate {sorted(zs_names - ds_names)[:5]}, "
            f"only deepspeed {sorted(ds_names - zs_names)[:5]}"
        )
    expected = set(init) - set(tied)
    if zs_names != expected:
        problems.append(
            f"zerostate names differ from the model's state_dict: {sorted(zs_names ^ expected)[:5]}"
        )

    max_diff = max_step = 0.0
    beyond = total = 0
    worst = ""
    for name in sorted(zs_names & ds_names):
        a, b = zs_h.get_tensor(name).detach(), ds_where[name].get_tensor(name).detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(
                f"{name}: zerostate {a.dtype}{tuple(a.shape)} "
                f"vs deepspeed {b.dtype}{tuple(b.shape)}"
            )
            continue
        if a.is_floating_point():
            d = (a.double() - b.double()).abs()
            md = float(d.max()) if d.numel() else 0.0
            beyond += int((d > ATOL).sum())
            total += d.numel()
            if md > max_diff:
                max_diff, worst = md, name
            if name in init:
                max_step = max(max_step, float((b.double() - init[name].double()).abs().max()))
        elif not torch.equal(a, b):
            problems.append(f"{name}: integer tensors differ")
        del a, b
    fraction = beyond / max(total, 1)
    if max_diff > MAX_ABS_DIFF:
        problems.append(
            f"max |zerostate - deepspeed| = {max_diff:.3g} ({worst}) > {MAX_ABS_DIFF:.3g}"
        )
    if fraction > MAX_FRACTION_BEYOND_ATOL:
        problems.append(f"{fraction:.3g} of elements differ by more than {ATOL:g}")
    if max_step == 0.0:
        problems.append("deepspeed output equals the initial weights: no step was taken")
    return {
        "ok": not problems,
        "problems": problems,
        "tensors_compared": len(zs_names & ds_names),
        "tied_aliases_in_deepspeed_only": sorted(a for a in tied if a in ds_where),
        "max_abs_diff": max_diff,
        "max_abs_diff_tensor": worst,
        "elements_beyond_atol": beyond,
        "elements": total,
        "atol": ATOL,
        "max_abs_step_from_init": max_step,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def format_report(res: dict) -> str:
    ds, zs = res["train"]["deepspeed"], res["train"]["zerostate"]
    c = res["consolidate"]
    largest = ds["largest_tensor_bytes"]
    bound = 3 * largest + 300 * MB
    lines = [
        f"model: GPT-2 {res['config']['model']}, {ds['n_params'] / 1e6:,.1f} M parameters, "
        f"{ds['n_params'] * 4 / MB:,.0f} MB fp32; largest tensor {ds['largest_tensor']} "
        f"{largest / MB:,.0f} MB",
        f"checkpoints ({ds['world_size']} ranks, one step): DeepSpeed ZeRO-{ds['stage']} "
        f"{ds['ckpt_bytes'] / MB:,.0f} MB, zerostate stage {zs['stage']} "
        f"{zs['ckpt_bytes'] / MB:,.0f} MB; mean loss of the step {_mean(ds['loss_per_rank']):.6f}"
        f" / {_mean(zs['loss_per_rank']):.6f}",
        f"consolidation: {c['repeat']} timed run(s) per tool, interleaved: median wall time, "
        f"largest peak RSS; {c['cache']}; peak RSS by {c['zerostate']['rss_method']}",
        "",
        f"{'tool':<30}{'wall s':>9}{'peak RSS MB':>13}{'output MB':>11}  format",
    ]
    lines.append("-" * len(lines[-1]))
    for key, label in (
        ("deepspeed", "DeepSpeed zero_to_fp32.py"),
        ("zerostate", "zerostate consolidate"),
    ):
        r = c[key]
        lines.append(
            f"{label:<30}{r['wall_s']:>9.2f}{r['peak_rss_bytes'] / MB:>13,.0f}"
            f"{r['output_bytes'] / MB:>11,.0f}  {r['output_format']}"
        )
    t_ratio = c["zerostate"]["wall_s"] / c["deepspeed"]["wall_s"]
    m_ratio = c["zerostate"]["peak_rss_bytes"] / c["deepspeed"]["peak_rss_bytes"]
    peak = c["zerostate"]["peak_rss_bytes"]
    lines += [
        f"{'zerostate / DeepSpeed':<30}{t_ratio:>8.2f}x{m_ratio:>12.2f}x",
        "",
        f"time: {'meets' if t_ratio < 1 else 'misses'} target (faster than zero_to_fp32)",
        f"memory: zerostate peak {peak / MB:,.0f} MB vs bound 3 x largest + 300 MB = "
        f"{bound / MB:,.0f} MB: {'within' if peak <= bound else 'EXCEEDS'} bound "
        f"(model fp32 = {ds['n_params'] * 4 / MB:,.0f} MB)",
    ]
    if "deepspeed_safetensors_error" in c:
        lines.append(
            "note: zero_to_fp32.py --safe_serialization failed (tied weights share memory, "
            "which safetensors refuses); DeepSpeed timed with its default pickle output"
        )
    cmp_ = res["compare"]
    if cmp_["ok"]:
        lines.append(
            f"outputs: same {cmp_['tensors_compared']} tensors (DeepSpeed also writes tied "
            f"{', '.join(cmp_['tied_aliases_in_deepspeed_only']) or '-'}); max |diff| "
            f"{cmp_['max_abs_diff']:.2g}, {cmp_['elements_beyond_atol']} of "
            f"{cmp_['elements']:,} elements beyond {cmp_['atol']:g}; step from init "
            f"{cmp_['max_abs_step_from_init']:.2g}"
        )
    else:
        lines.append("outputs DIFFER: " + "; ".join(cmp_["problems"]))
    return "\n".join(lines)


def launcher_main(args: argparse.Namespace) -> int:
    if args.small:
        for key, value in SIZES["small"].items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for key, value in SIZES["default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.n_embd % args.n_head or args.seq_len > args.n_positions or args.repeat < 1:
        print(
            "need n_embd divisible by n_head, --seq-len <= n_positions, --repeat >= 1",
            file=sys.stderr,
        )
        return 2

    work = Path(tempfile.mkdtemp(prefix="zs-bench-cons-vs-ds-", dir=args.dir))
    res: dict = {
        "date": _dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "config": {
            "model": "small" if args.small else "default",
            "gpt2": _model_config(args),
            "seq_len": args.seq_len,
            "nproc": args.nproc,
            "ds_stage": args.ds_stage,
            "zerostate_stage": 2,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
        },
    }
    try:
        print(f"working in {work}", file=sys.stderr)
        res["train"] = {}
        for tool, key in (("ds", "deepspeed"), ("zs", "zerostate")):
            print(f"training one step + saving with {key} ...", file=sys.stderr, flush=True)
            res["train"][key] = train_and_save(tool, args, work)
        res["consolidate"] = consolidate_both(
            args, work, res["train"]["deepspeed"], res["train"]["zerostate"]
        )
        res["compare"] = compare_outputs(args, work, res["train"]["deepspeed"], res["consolidate"])
        c = res["consolidate"]
        largest = res["train"]["deepspeed"]["largest_tensor_bytes"]
        res["summary"] = {
            "time_ratio_zerostate_over_deepspeed": c["zerostate"]["wall_s"]
            / c["deepspeed"]["wall_s"],
            "peak_rss_ratio_zerostate_over_deepspeed": c["zerostate"]["peak_rss_bytes"]
            / c["deepspeed"]["peak_rss_bytes"],
            "largest_tensor_bytes": largest,
            "bound_bytes": 3 * largest + 300 * MB,
            "zerostate_within_bound": c["zerostate"]["peak_rss_bytes"] <= 3 * largest + 300 * MB,
        }
        print(format_report(res))
        ok = res["compare"]["ok"]
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        res["error"] = str(exc)
        ok = False
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="~17M-parameter model, about a minute")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--n-positions", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per rank in the step")
    p.add_argument("--ds-stage", type=int, choices=(2, 3), default=2, help="DeepSpeed ZeRO stage")
    p.add_argument(
        "--ds-format",
        choices=("auto", "safetensors", "bin"),
        default="auto",
        help="zero_to_fp32.py output: auto tries --safe_serialization and falls back to its "
        "pickle output when that fails (it does on tied weights)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed consolidations per tool, interleaved; the table shows the median wall "
        "time and the largest peak RSS",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per training job")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    p.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: drop the page cache before each timed consolidation (needs root, else "
        "falls back to warm); warm: run each once untimed first",
    )
    p.add_argument("--dir", default=None, help="parent of the temporary directory (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--timeout", type=int, default=900, help="seconds per child job")
    p.add_argument("--json", metavar="OUT", default=None, help="write all results as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the torchrun output")
    # worker-only
    p.add_argument("--worker", choices=("ds", "zs"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(_worker, args)
        return 0
    return launcher_main(args)


if __name__ == "__main__":
    sys.exit(main())
