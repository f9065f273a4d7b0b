"""Resharding load throughput: a checkpoint written by N ranks, read back by M ranks.

    python benchmarks/bench_load.py [--gb 1] [--write-ranks 4] [--read-ranks 3] [--dir D]

Builds a checkpoint of ``--gb`` GiB of fp32 tensors as ``--write-ranks`` ranks would write
it, then ``--read-ranks`` reader processes each read only their owned ranges under the new
world size (``read_range``, checksums verified), all at once. In the same run, ``cat`` reads
the same chunk files to /dev/null with the same number of parallel processes. The page
cache is dropped before each timed read when this runs as root (else both read warm, and
it says so). Prints both throughputs and the ratio; everything written is deleted.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import drop_caches

MIB = 1 << 20


def _reader(root: str, rank: int, world: int, preallocate: bool, start, done) -> None:
    import torch

    from zerostate.partition import plan_layouts
    from zerostate.store import open_checkpoint

    torch.set_num_threads(1)
    st = open_checkpoint(root).step()
    names = list(st.tensors)
    layouts = plan_layouts([st.tensors[n].numel for n in names], world)
    ranges = [layout.owned_range(rank) for layout in layouts]
    # Like engine.load: the destination tensors already exist (and have been touched).
    outs = [torch.zeros(hi - lo) for lo, hi in ranges] if preallocate else None
    start.wait()
    nbytes = 0
    for i, (name, (lo, hi)) in enumerate(zip(names, ranges, strict=True)):
        if hi > lo:
            out = st.read_range(name, lo, hi, out=outs[i] if outs else None)
            nbytes += out.numel() * 4
    done.put(nbytes)


def _zerostate_read(root: str, world: int, preallocate: bool) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    start, done = ctx.Barrier(world + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_reader, args=(root, r, world, preallocate, start, done))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    total = sum(done.get() for _ in procs)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"reader exited with {p.exitcode}")
    return elapsed, total


def _cat_read(files: list[str], world: int) -> float:
    groups = [files[i::world] for i in range(world)]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(["cat", *g], stdout=subprocess.DEVNULL) for g in groups if g
    ]
    for p in procs:
        if p.wait():
            raise SystemExit("cat failed")
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--write-ranks", type=int, default=4)
    parser.add_argument("--read-ranks", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    import torch

    from zerostate.store import save_tensors

    base = tempfile.mkdtemp(prefix="zs-bench-load-", dir=args.dir)
    root = os.path.join(base, "ckpt")
    try:
        numel = int(args.gb * (1 << 30) / 4 / args.tensors)
        gen = torch.Generator().manual_seed(0)
        tensors = {f"model/t{i}": torch.randn(numel, generator=gen) for i in range(args.tensors)}
        save_tensors(root, 1, tensors, world_size=args.write_ranks)
        del tensors
        files = sorted(str(p) for p in Path(root).rglob("*") if p.is_file() and "/c/" in str(p))
        cold = drop_caches()
        cat_s = _cat_read(files, args.read_ranks)
        drop_caches()
        fresh_s, nbytes = _zerostate_read(root, args.read_ranks, preallocate=False)
        drop_caches()
        into_s, _ = _zerostate_read(root, args.read_ranks, preallocate=True)
        on_disk = sum(os.path.getsize(f) for f in files)
        cache = "cold (page cache dropped)" if cold else "warm (not root: cache not dropped)"
        cat_rate = on_disk / cat_s
        print(f"checkpoint: {on_disk / MIB:.0f} MiB written by {args.write_ranks} ranks, "
              f"read by {args.read_ranks} ranks, {cache}")
        print(f"cat of the chunk files            : {cat_rate / MIB:8.0f} MiB/s ({cat_s:.2f} s)")
        for label, secs in (("into existing tensors (as load)", into_s),
                            ("into new tensors              ", fresh_s)):
            rate = nbytes / secs
            print(f"zerostate {label}: {rate / MIB:8.0f} MiB/s ({secs:.2f} s, checksums "
                  f"verified), ratio {rate / cat_rate:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
