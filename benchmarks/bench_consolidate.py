"""Peak memory and throughput of ``zerostate consolidate`` on a multi-GB checkpoint.

Builds a checkpoint (fp32 master weights + both Adam moments, written by a few simulated
ranks in this process) in a temporary directory on local disk, runs
``zerostate consolidate`` on it as a child process, samples the child's RSS with psutil
(and reads the kernel's high-water mark via ``getrusage(RUSAGE_CHILDREN)``), checks a few
tensors of the output, and deletes everything.

The claim under test ([Note: streaming consolidation] in zerostate/store/consolidate.py):
peak host memory is bounded by a small multiple of the largest tensor, not by the model.
The bound printed here is ``3 x largest tensor + 300 MB`` (300 MB covers the interpreter
with torch imported).

    python benchmarks/bench_consolidate.py [--gb 2.2] [--ranks 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from zerostate.partition import plan_layouts
from zerostate.store import StepWriter, TensorSpec, open_checkpoint

MB = 10**6


def model_shapes(target_bytes: float) -> dict[str, tuple[int, ...]]:
    """A transformer-like set of fp32 parameters whose checkpoint (x3 states) is ~target."""
    hidden = 2048
    vocab = 20_480  # the largest tensor: 20480 x 2048 x 4 B = 168 MB
    shapes: dict[str, tuple[int, ...]] = {}
    per_layer = 4 * hidden * hidden + 2 * hidden * 4 * hidden + 4 * hidden
    model_bytes = target_bytes / 3  # fp32 weights + two fp32 moments
    shapes["wte.weight"] = (vocab, hidden)
    num_layers = max(1, round((model_bytes / 4 - vocab * hidden) / per_layer))
    for i in range(num_layers):
        p = f"h.{i}."
        shapes[p + "attn.qkv.weight"] = (3 * hidden, hidden)
        shapes[p + "attn.proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.fc.weight"] = (4 * hidden, hidden)
        shapes[p + "mlp.proj.weight"] = (hidden, 4 * hidden)
        shapes[p + "ln_1.weight"] = (hidden,)
        shapes[p + "ln_1.bias"] = (hidden,)
        shapes[p + "ln_2.weight"] = (hidden,)
        shapes[p + "ln_2.bias"] = (hidden,)
    shapes["ln_f.weight"] = (hidden,)
    return shapes


def fill(name: str, numel: int, start: int, stop: int) -> torch.Tensor:
    """Deterministic contents for elements [start, stop) of ``name``, without the rest."""
    seed = sum(name.encode()) * 1_000_003 % (2**31)
    base = torch.arange(start, stop, dtype=torch.float64)
    return torch.sin(base * 1e-3 + seed).to(torch.float32)


def build(root: Path, target_bytes: float, world_size: int) -> tuple[int, int, float]:
    shapes = model_shapes(target_bytes)
    names = []
    for param in shapes:
        names += [f"model/{param}", f"optim/exp_avg/{param}", f"optim/exp_avg_sq/{param}"]
    numels = [_numel(shapes[_param(n)]) for n in names]
    layouts = plan_layouts(numels, world_size)
    specs = [
        TensorSpec(n, shapes[_param(n)], torch.float32, layout)
        for n, layout in zip(names, layouts, strict=True)
    ]
    attrs = {"engine": {"stage": 3, "precision": "bf16", "world_size": world_size}}
    t0 = time.perf_counter()
    for rank in [*range(1, world_size), 0]:
        writer = StepWriter(
            str(root), 100, rank=rank, world_size=world_size, specs=specs, attrs=attrs
        )
        for spec in specs:
            start, stop = spec.layout.owned_range(rank)
            if stop > start:
                writer.write({spec.name: fill(spec.name, spec.layout.numel, start, stop)})
        writer.commit(wait=False)  # rank 0, last, waits for all
    total = sum(numels) * 4
    largest = max(numels) * 4
    return total, largest, time.perf_counter() - t0


def _param(name: str) -> str:
    return name.split("/", 1)[1] if name.startswith("model/") else name.split("/", 2)[2]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run_consolidate(root: Path, out: Path) -> tuple[float, int, int | None]:
    """Run the command; returns (wall seconds, psutil peak RSS, kernel peak RSS or None).

    The kernel's figure comes from ``/usr/bin/time``: ``getrusage(RUSAGE_CHILDREN)`` here
    would report this process's own (large, checkpoint-building) RSS, which a forked
    child inherits as its high-water mark.
    """
    import psutil

    cmd = [sys.executable, "-m", "zerostate_cli.main", "consolidate", str(root), str(out), "-q"]
    report = out.with_name("time.txt")
    gnu_time = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None  # GNU time
    if gnu_time:
        cmd = [gnu_time, "-f", "%M", "-o", str(report), *cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [watched, *watched.children(recursive=True)]
            peak = max(
                peak, sum(p.memory_info().rss for p in procs if p.pid != proc.pid or not gnu_time)
            )
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.005)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"consolidate failed ({proc.returncode}): {stderr.decode().strip()}")
    print(stdout.decode().strip())
    maxrss = int(report.read_text().split()[-1]) * 1024 if gnu_time else None  # KiB
    return wall, peak, maxrss


def check_output(root: Path, out: Path) -> None:
    from safetensors import safe_open

    st = open_checkpoint(str(root)).step()
    with safe_open(str(out), framework="pt") as f:
        keys = list(f.keys())
        for name in [keys[0], keys[len(keys) // 2], keys[-1]]:
            expected = st.read(f"model/{name}")
            got = f.get_tensor(name)
            if not torch.equal(got, expected):
                raise SystemExit(f"output tensor {name} differs from the checkpoint")
    print(f"output checked: {len(keys)} tensors, 3 compared bit for bit")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.2, help="checkpoint size (1e9 bytes)")
    parser.add_argument("--ranks", type=int, default=2, help="simulated writer ranks")
    parser.add_argument("--dir", default=None, help="where to put the temporary data")
    parser.add_argument("--keep", action="store_true", help="keep the data (default: delete)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    work = Path(tempfile.mkdtemp(prefix="zs-bench-consolidate-", dir=args.dir))
    try:
        root, out = work / "ckpt", work / "model.safetensors"
        total, largest, build_s = build(root, args.gb * 1e9, args.ranks)
        print(
            f"checkpoint: {total / MB:,.0f} MB in {build_s:.1f} s ({args.ranks} ranks), "
            f"largest tensor {largest / MB:,.0f} MB"
        )
        wall, peak, maxrss = run_consolidate(root, out)
        size = out.stat().st_size
        bound = 3 * largest + 300 * MB
        print(
            f"consolidate: {size / MB:,.0f} MB written in {wall:.1f} s "
            f"= {size / MB / wall:,.0f} MB/s (process start and torch import included)"
        )
        worst = max(peak, maxrss or 0)
        kernel = f", {maxrss / MB:,.0f} MB (kernel max RSS)" if maxrss else ""
        print(
            f"peak RSS: {peak / MB:,.0f} MB (psutil, sampled every 5 ms){kernel}; "
            f"bound 3 x largest + 300 MB = {bound / MB:,.0f} MB: "
            f"{'OK' if worst <= bound else 'EXCEEDED'}"
        )
        print(f"model (fp32) = {total / 3 / MB:,.0f} MB; peak / model = {worst / (total / 3):.2f}")
        check_output(root, out)
    finally:
        if args.keep:
            print(f"data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
