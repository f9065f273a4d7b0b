"""ZeRO-Offload benchmarks: the host optimizer step, and (on a GPU) what offload buys.

    python -m benchmarks.offload host [--numel 58.7e6] [--threads 2] [--reps 5]
    python -m benchmarks.offload step [--width 512] [--threads 2] [--rounds 8]  # 1 process
    python -m benchmarks.offload gpu  [--out result.json]      # benchmarks/gpu.sh runs it

``host``: one rank's fp32 shard of ``numel`` elements, one flat tensor (as the engine's
host tier keeps it), AdamW steps timed at the same thread count with DeepSpeedCPUAdam
(``deepspeed.ops.adam``, compiled on first use with g++/ninja), ``torch.optim.AdamW``
fused (what the engine steps with under offload), foreach and single-tensor. Every kernel
starts from the same values; the report gives the median of ``reps`` steps after one
warm-up step, and each kernel's ratio to DeepSpeedCPUAdam.

``step``: one process on the CPU (gloo), the median step time of a GPT-2 of ``width`` at
stage 2 with ``offload="optimizer"`` against DeepSpeed ZeRO-2 with ``offload_optimizer:
{device: cpu}`` (its DeepSpeedCPUAdam) on the same model and batch, fp32; and the same pair
without offload, to tell offload's cost from the rest. The four step in turn, in an order
reversed every round, for ``rounds`` rounds (one run measuring each alone saw the ratio move
from 1.3 to 2.8 with the load of the machine).

``gpu``: on one CUDA device, the largest GPT-2 width that trains a step at stage 2 with and
without ``offload="optimizer"`` (doubling, then stopping at the first OOM), and the step
time of an offloaded stage-2 engine against DeepSpeed ZeRO-2 with
``offload_optimizer: {device: cpu}`` on the same model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch


def _time(step, reps: int) -> float:
    step()  # warm-up: lazy state, kernel build, page faults
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_step(numel: int, threads: int, reps: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    results: dict[str, Any] = {"numel": numel, "threads": threads, "reps": reps, "seconds": {}}

    def torch_kernel(**kind: Any):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad
        opt = torch.optim.AdamW([p], **hyper, **kind)
        return opt.step, p

    finals = {}
    for name, kind in (
        ("torch_fused", {"fused": True}),
        ("torch_foreach", {"foreach": True}),
        ("torch_single", {"foreach": False}),
    ):
        step, p = torch_kernel(**kind)
        results["seconds"][name] = _time(step, reps)
        finals[name] = p.detach()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(start.clone())
        p.grad = grad
        opt = DeepSpeedCPUAdam([p], **hyper, adamw_mode=True)
        results["seconds"]["deepspeed_cpu_adam"] = _time(opt.step, reps)
        finals["deepspeed_cpu_adam"] = p.detach()
    except Exception as exc:  # a missing compiler: report it, keep the torch rows
        results["deepspeed_error"] = repr(exc)[:500]
    ref = results["seconds"].get("deepspeed_cpu_adam")
    if ref:
        results["ratio_to_deepspeed"] = {k: v / ref for k, v in results["seconds"].items()}
    # Same number of steps from the same start: how far each kernel is from single-tensor.
    base = finals["torch_single"]
    results["max_abs_diff_to_single"] = {
        k: float((v - base).abs().max()) for k, v in finals.items()
    }
    return results


def _gpt2(width: int, layers: int = 4):
    from zerostate.models.gpt2 import GPT2, GPT2Config

    return GPT2(GPT2Config(vocab_size=8192, n_positions=256, n_embd=width, n_layer=layers,
                           n_head=max(1, width // 64)))  # fmt: skip


def _engine_step_time(width: int, offload: str | None, steps: int = 4) -> float:
    import zerostate

    with torch.device("cuda"):
        model = _gpt2(width)
    engine = zerostate.Engine(model, stage=2, precision="bf16", offload=offload)
    x = torch.randint(0, 8192, (4, 256), device="cuda")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    engine = model = None  # free the first run before the second is built
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def _largest(offload: str | None, limit_s: float) -> dict:
    import os

    host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    width, best, t_end = 1024, None, time.monotonic() + limit_s
    while time.monotonic() < t_end:
        numel = 12 * 4 * width * width  # 4 blocks; embeddings are small next to them
        if offload is not None and 16 * numel > 0.6 * host_ram:
            best = {**(best or {}), "stopped_by": "host memory"}  # the OOM killer, not OOM
            break
        try:
            best = {"width": width, "step_s": _engine_step_time(width, offload, steps=2)}
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        width *= 2
    return {"largest": best}


def _deepspeed_step_time(width: int, steps: int = 4) -> float:
    import deepspeed
    import torch.distributed as dist

    model = _gpt2(width)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if not dist.is_initialized():
        deepspeed.init_distributed()
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters())  # fmt: skip
    x = torch.randint(0, 8192, (4, 256), device=engine.device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _phases(fwd, bwd, step) -> tuple[float, float, float, float]:
    """Wall seconds of forward, backward and step, then the process's CPU seconds of all
    three (less moved by other jobs on a shared machine than wall time)."""
    c0, t0 = time.process_time(), time.perf_counter()
    loss = fwd()
    t1 = time.perf_counter()
    bwd(loss)
    t2 = time.perf_counter()
    step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0


def _cpu_contenders(width: int, threads: int, x: torch.Tensor) -> dict[str, tuple]:
    """(forward, backward, step) of each contender, every one over the same model."""
    import deepspeed

    import zerostate

    out = {}
    for offload in ("optimizer", None):
        torch.manual_seed(0)
        engine = zerostate.Engine(_gpt2(width), stage=2, offload=offload,
                                  offload_threads=threads if offload else None)  # fmt: skip
        name = "zerostate_offload" if offload else "zerostate"
        out[name] = ((lambda e=engine: e(x, x)), engine.backward, engine.step)
        torch.manual_seed(0)
        model = _gpt2(width)
        zero: dict[str, Any] = {"stage": 2}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}  # its DeepSpeedCPUAdam
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 10**9,
        }
        ds, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters())  # fmt: skip
        out["deepspeed_offload" if offload else "deepspeed"] = (
            (lambda e=ds: e(x, x)), ds.backward, ds.step)  # fmt: skip
    return out


def cpu_step(width: int, threads: int, rounds: int = 8) -> dict[str, Any]:
    """Every contender steps once per round, in an order reversed every round (ABBA), so a
    change in the machine's load reaches all of them alike; medians over the rounds after a
    warm-up round, per phase (forward, backward, step) and in all, and of the CPU time."""
    import os

    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    x = torch.randint(0, 8192, (4, 128))
    torch.manual_seed(0)
    numel = sum(p.numel() for p in _gpt2(width).parameters())
    contenders = _cpu_contenders(width, threads, x)
    names = list(contenders)
    times: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else reversed(names):
            phases = _phases(*contenders[name])
            if r:
                times[name].append(phases)
    out: dict[str, Any] = {"numel": numel, "threads": threads, "width": width, "rounds": rounds}
    for name in names:
        rows = times[name]
        out[f"{name}_s"] = statistics.median(sum(t[:3]) for t in rows)
        out[f"{name}_cpu_s"] = statistics.median(t[3] for t in rows)
        out[f"{name}_phases_s"] = {
            phase: statistics.median(t[i] for t in rows)
            for i, phase in enumerate(("forward", "backward", "step"))
        }
    out["ratio_zerostate_to_deepspeed_offload"] = (
        out["zerostate_offload_s"] / out["deepspeed_offload_s"]
    )
    out["ratio_zerostate_to_deepspeed"] = out["zerostate_s"] / out["deepspeed_s"]
    out["cpu_ratio_zerostate_to_deepspeed_offload"] = (
        out["zerostate_offload_cpu_s"] / out["deepspeed_offload_cpu_s"]
    )
    out["cpu_ratio_zerostate_to_deepspeed"] = out["zerostate_cpu_s"] / out["deepspeed_cpu_s"]
    return out


def gpu(limit_s: float = 240.0) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # deepspeed.initialize asserts LOCAL_RANK even when the process group exists already
    # (without it the DeepSpeed row of the H200 run failed; benchmarks/README.md "GPU").
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    out: dict[str, Any] = {}
    out["without_offload"] = _largest(None, limit_s / 3)
    out["with_offload"] = _largest("optimizer", limit_s / 3)
    width = 2048
    out["step_s"] = {"width": width, "zerostate_offload": _engine_step_time(width, "optimizer")}
    try:
        out["step_s"]["deepspeed_offload"] = _deepspeed_step_time(width)
    except Exception as exc:
        out["step_s"]["deepspeed_error"] = repr(exc)[:500]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload")
    p.add_argument("what", choices=("host", "step", "gpu"))
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--numel", type=float, default=58.7e6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8, help="step: rounds of the four contenders")
    p.add_argument("--out", help="write the result as JSON here too")
    args = p.parse_args(argv)
    if args.what == "host":
        result = host_step(int(args.numel), args.threads, args.reps)
    elif args.what == "step":
        result = cpu_step(args.width, args.threads, args.rounds)
    else:
        result = gpu()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
