"""Sync save throughput of StepWriter vs ``dd conv=fsync`` on the same disk, in one run.

    python benchmarks/bench_save.py --gb 1 --ranks 2 --dir /tmp/zs-bench

``--ranks`` processes each write their owned shards of ``--tensors`` fp32 tensors
(``--gb`` in total) with fsync, and rank 0 commits; the clock runs from a common start
barrier until the commit record is durable. ``dd if=/dev/zero bs=4M conv=fsync`` then
writes the same number of bytes to the same directory. Runs alternate (dd, zerostate, ...)
``--repeat`` times after one warm-up round of each (first writes into untouched memory of
a VM are slow for dd and zerostate alike), and the best of each is compared
(target: ratio >= 0.8). The rank processes live across rounds, as in training.
Everything written is deleted at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import time

MIB = 1 << 20


def _rank_main(rank: int, args: argparse.Namespace, root: str, barrier, queue) -> None:
    import torch

    from zerostate.partition import plan_layouts
    from zerostate.store import StepWriter, TensorSpec

    torch.set_num_threads(1)
    numel = int(args.gb * (1 << 30)) // 4 // args.tensors
    layouts = plan_layouts([numel] * args.tensors, args.ranks)
    specs = [
        TensorSpec(f"model/layer.{i}.weight", (numel,), torch.float32, layout)
        for i, layout in enumerate(layouts)
    ]
    shards = {}
    for spec in specs:
        start, stop = spec.layout.owned_range(rank)
        if stop > start:
            # Non-zero, touched memory: the pages exist before the clock starts.
            shards[spec.name] = torch.full((stop - start,), float(rank + 1))
    # Long-lived ranks save step after step, as in training; step 0 is the warm-up.
    for step in range(args.repeat + 1):
        writer = StepWriter(
            root,
            step,
            rank=rank,
            world_size=args.ranks,
            specs=specs,
            num_threads=args.threads,
            timeout_s=600,
        )
        barrier.wait()
        start = time.perf_counter()
        writer.write(shards)
        writer.commit(wait=True)
        queue.put((rank, step, start, time.perf_counter()))
        barrier.wait()  # the parent measured dd and deleted the step meanwhile


def _step_bytes(step_dir: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(step_dir) for f in files
    )


def run_dd(path: str, nbytes: int) -> float:
    count = -(-nbytes // (4 * MIB))
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds * nbytes / (count * 4 * MIB)  # same byte count as the checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description="zerostate sync save vs dd conv=fsync")
    parser.add_argument("--gb", type=float, default=1.0, help="total state size in GiB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", required=True, help="directory on the disk to measure")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--threads", type=int, default=8, help="I/O threads per rank")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    root = os.path.join(args.dir, "zerostate-bench-ckpt")
    dd_path = os.path.join(args.dir, "zerostate-bench-dd.bin")
    best_zs = best_dd = float("inf")
    nbytes = 0
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.ranks + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args, root, barrier, queue), daemon=True)
        for r in range(args.ranks)
    ]
    try:
        for p in procs:
            p.start()
        for step in range(args.repeat + 1):
            barrier.wait(timeout=900)
            results = [queue.get(timeout=900) for _ in procs]
            zs_s = max(r[3] for r in results) - min(r[2] for r in results)
            step_dir = os.path.join(root, f"step-{step:08d}")
            nbytes = _step_bytes(step_dir)
            shutil.rmtree(step_dir)
            dd_s = run_dd(dd_path, nbytes)
            barrier.wait(timeout=900)
            label = "warm-up" if step == 0 else f"run {step}"
            print(
                f"{label:8s} zerostate {nbytes / zs_s / MIB:8.1f} MiB/s ({zs_s:.2f} s)   "
                f"dd conv=fsync {nbytes / dd_s / MIB:8.1f} MiB/s ({dd_s:.2f} s)",
                flush=True,
            )
            if step:
                best_zs, best_dd = min(best_zs, zs_s), min(best_dd, dd_s)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit(f"rank process exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(dd_path):
            os.remove(dd_path)
    zs_rate, dd_rate = nbytes / best_zs / MIB, nbytes / best_dd / MIB
    print(
        f"bytes written per save: {nbytes / MIB:.1f} MiB, {args.ranks} ranks, "
        f"{args.tensors} tensors, {args.threads} threads/rank"
    )
    print(
        f"best zerostate: {zs_rate:.1f} MiB/s   best dd: {dd_rate:.1f} MiB/s   "
        f"ratio: {zs_rate / dd_rate:.2f} (target >= 0.80)"
    )


if __name__ == "__main__":
    main()
