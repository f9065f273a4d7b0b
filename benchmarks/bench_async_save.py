"""How long does an async save block training, compared with a blocking save of the same state?

    python benchmarks/bench_async_save.py [--nproc 2] [--n-embd 1024] [--n-layer 8] [--dir D]

Launches ``torchrun`` itself. In one run, on the same engine state and the same disk, it
times (1) ``engine.save(blocking=True)`` and (2) ``engine.save(blocking=False)``: the time
the call itself blocks, plus any time the next ``engine.step()`` waits for the snapshot to
finish reading the state (the "stall"), then the background write's total time. It prints
the ratio (async blocked + stall) / blocking; the target is <= 0.10.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zerostate
    from zerostate.models import GPT2, GPT2Config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=8)
    engine = zerostate.Engine(GPT2(cfg), stage=2, lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def train_step() -> float:
        idx = torch.randint(0, 256, (2, 64), generator=gen)
        t0 = time.perf_counter()
        engine.backward(engine(idx, idx))
        engine.step()
        return time.perf_counter() - t0

    for _ in range(2):
        train_step()
    state_bytes = sum(v.local.numel() * v.local.element_size() for v in engine.state_views()
                      if not v.name.startswith("buffers/"))
    root = Path(args.dir)
    dist.barrier()
    t0 = time.perf_counter()
    engine.save(str(root / "sync"), step=2)
    sync_s = time.perf_counter() - t0
    dist.barrier()
    plain_step = train_step()
    dist.barrier()
    ck = engine._checkpointer
    stall0 = ck.stall_s
    t0 = time.perf_counter()
    handle = engine.save(str(root / "async"), step=3, blocking=False)
    blocked_s = time.perf_counter() - t0
    step_times = []
    while not handle.done():
        step_times.append(train_step())
    stall_s = ck.stall_s - stall0
    handle.wait()
    total_async_s = time.perf_counter() - t0
    out = {
        "rank": rank, "world_size": world, "state_bytes_this_rank": state_bytes,
        "sync_save_s": sync_s, "async_blocked_s": blocked_s, "async_stall_s": stall_s,
        "async_total_s": total_async_s, "steps_during_async": len(step_times),
        "plain_step_s": plain_step,
        "step_s_during_async": (sum(step_times) / len(step_times)) if step_times else None,
    }
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--dir", help="where to write (default: a temp dir, removed afterwards)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    tmp = args.dir or tempfile.mkdtemp(prefix="zs-async-", dir=os.environ.get("TMPDIR", "/tmp"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--worker",
           "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer), "--dir", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    results = [json.loads(ln.split("RESULT ", 1)[1]) for ln in proc.stdout.splitlines()
               if "RESULT " in ln]
    if proc.returncode != 0 or len(results) != args.nproc:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
        return 1
    sync_s = max(r["sync_save_s"] for r in results)
    blocked = max(r["async_blocked_s"] for r in results)
    stall = max(r["async_stall_s"] for r in results)
    total_gb = sum(r["state_bytes_this_rank"] for r in results) / 1e9
    print(f"state saved: {total_gb:.2f} GB over {len(results)} ranks")
    print(f"blocking save                          : {sync_s:8.3f} s")
    print(f"async save: call blocked               : {blocked:8.3f} s  "
          f"(ratio {blocked / sync_s:.3f})")
    print(f"async save: call + next-step stall     : {blocked + stall:8.3f} s  "
          f"(ratio {(blocked + stall) / sync_s:.3f}, target <= 0.10)")
    total = max(r["async_total_s"] for r in results)
    steps = max(r["steps_during_async"] for r in results)
    print(f"async save: background total           : {total:8.3f} s "
          f"({steps} training steps ran meanwhile)")
    if args.json:
        args.json.write_text(json.dumps({"ranks": results, "ratio_blocked": blocked / sync_s,
                                         "ratio_blocked_plus_stall": (blocked + stall) / sync_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
