"""Goodput at 1k-16k GPUs, on paper: durable-only checkpoints at their best interval against
the memory tier, from measured save and load costs and a failure rate.

    python -m benchmarks.goodput                       # the table of docs/reliability.md
    python -m benchmarks.goodput --durable-gbps 100    # a slower shared store
    python -m benchmarks.goodput --help                # every input, its default and source

[Note: goodput model]
A policy saves every ``n`` training steps of ``step_s`` seconds. A save blocks training for
``c`` seconds (the caller's time inside ``save``) and its step is committed ``w`` seconds
after the save started (the background write; one save in flight, so a save period ``P =
n * step_s + c`` is never shorter than ``w``). Interruptions come every ``M`` seconds on
average: ``M(N) = mtbf_h * 3600 * ref_gpus / N`` (one per ~3 h at 16,384 GPUs, Meta's Llama 3
405B run: 419 in 54 days; linear in the GPU count). An interruption, at a uniformly random
moment of a period, loses the work since the newest committed step, on average ``P / 2 +
w``, then costs the restart ``R`` and the load ``L`` of the tier it reads. So, to first order
in ``1 / M`` (valid while ``M`` is much longer than a period and a restart)::

    lost   = P / 2 + w + R + L                                  (seconds per interruption)
    goodput = n * step_s / P  *  (1 - lost / M)

The memory tier saves into host memory with a replica on another node (``c_m``, ``w_m``,
``L_m``) and copies every ``K``-th memory step to the durable tier in the background (no
second snapshot: no blocked time; committed ``w_d`` after the memory commit). A share ``p``
of the interruptions loses both memory copies of some rank (two machines at once); those
restart from the durable tier::

    lost_m = (1 - p) * (P / 2 + w_m + R + L_m) + p * (K * P / 2 + w_m + w_d + R + L_d)

Intervals: Young/Daly's optimum ``P* = sqrt(2 * c * M)`` (for the memory tier ``sqrt(2 * c
* M / (1 - p + p * K))``, the same minimisation with its loss), rounded to whole steps, at
least one step and at least ``w``.

Costs at scale. Each rank's costs scale linearly with the bytes of state it checkpoints
(``gb_per_gpu``) from the measured ones (``measured_gb`` per rank). The memory tier's
traffic stays on each node and its replica partner, so its costs do not grow with the GPU
count; the durable tier is shared, so its write and read take at least the whole job's
bytes over its aggregate bandwidth: ``w_d = max(rank's, N * gb_per_gpu / durable_gbps)``,
``L_d`` alike. A rank's own durable commit is not measured here; it is taken equal to the
memory tier's (each writes the same bytes), so the shared bandwidth sets them apart.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GPU_COUNTS = (1024, 4096, 16384)

# [Note: measured defaults] Measured on the development machine (2 vCPUs, AMD EPYC, gloo,
# local disk ext4 on virtio, tmpfs /dev/shm, page cache warm unless said), with
#   python -m benchmarks.memory_tier --params 16e6 --rounds 3 --dir /tmp
#   python -m benchmarks.memory_tier --params 16e6 --rounds 3 --dir /tmp --mem-blocking
# 2 ranks as 2 nodes, stage 2, fp32 AdamW: each rank checkpoints 96.05 MB (12 bytes per
# parameter of 16.008e6, halved). Medians of 3 rounds on rank 0; the machine was shared with
# other jobs (loads of the two runs differ by up to 1.6x), so they are rough. The second
# run's memory save is blocking: its blocked time is the whole save (write, replica to the
# other node, commit), used as ``w_m``; everything else is the first run's.
MEASURED_GB = 0.09605
MEM_SAVE_BLOCKED_S = 0.0123  # memory-tier save in the background: blocked time
MEM_SAVE_COMMITTED_S = 1.396  # memory-tier save, blocking (2nd run): replicated, committed
MEM_LOAD_S = 0.268  # a fresh engine's load from the memory tier
DISK_SAVE_BLOCKED_S = 0.0111  # async save to local disk: blocked time
DISK_LOAD_S = 0.187  # a fresh engine's load from local disk, cold page cache
# Not measured: a rank's time to commit its share to the durable tier, at least its
# share's write. Taken equal to the memory tier's measured commit (the same bytes written
# by each rank), so that only the shared store's bandwidth sets the tiers apart.
DISK_SAVE_COMMITTED_S = MEM_SAVE_COMMITTED_S

# Assumptions (not measured here), each a flag.
MTBF_H = 3.0  # one interruption per ~3 h ...
REF_GPUS = 16384  # ... at 16,384 GPUs (Llama 3 405B: 419 interruptions in 54 days)
GB_PER_GPU = 405e9 * 12 / 16384 / 1e9  # Llama 3 405B fp32 masters + Adam moments / 16k GPUs
DURABLE_GBPS = 2000.0  # aggregate durable bandwidth (Llama 3's Tectonic: 2 TB/s sustained)
STEP_S = 10.0  # one training step
RESTART_S = 0.0  # relaunch and set-up before the load, alike for every policy
DURABLE_EVERY = 10  # the memory tier copies every 10th memory step to the durable tier
MEMORY_LOSS = 0.1  # share of interruptions losing both memory copies (the sensitivity row)


@dataclass(frozen=True, slots=True)
class Costs:
    """One tier's costs for one rank's checkpoint, in seconds."""

    blocked_s: float
    """Training time a save blocks (``c``)."""
    committed_s: float
    """From the save's start to its step being committed (``w``, at least ``c``)."""
    load_s: float
    """A restart's load (``L``)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """What a policy costs at one GPU count ([Note: goodput model])."""

    steps: int
    """Training steps between two saves (``n``)."""
    goodput: float
    lost_s: float
    """Seconds lost per interruption, on average."""


def mtbf_s(gpus: int, mtbf_h: float = MTBF_H, ref_gpus: int = REF_GPUS) -> float:
    """Mean time between interruptions of a job on ``gpus`` GPUs (linear in the count)."""
    return mtbf_h * 3600.0 * ref_gpus / gpus


def young_daly_steps(
    c: float, m: float, step_s: float, committed_s: float, weight: float = 1.0
) -> int:
    """Young/Daly's best period ``sqrt(2 c M / weight)`` as whole steps: at least one, and
    long enough that a save is committed before the next starts."""
    period = math.sqrt(2.0 * c * m / weight)
    floor = max(1, math.ceil((committed_s - c) / step_s - 1e-9))
    return max(floor, round((period - c) / step_s))


def durable_only(
    costs: Costs, m: float, step_s: float, restart_s: float, steps: int | None = None
) -> Policy:
    """Durable checkpoints every ``steps`` steps (None: Young/Daly's interval)."""
    c, w = costs.blocked_s, costs.committed_s
    n = young_daly_steps(c, m, step_s, w) if steps is None else steps
    period = n * step_s + c
    lost = period / 2 + w + restart_s + costs.load_s
    return Policy(n, n * step_s / period * (1 - lost / m), lost)


def memory_tier(
    memory: Costs,
    durable: Costs,
    m: float,
    step_s: float,
    restart_s: float,
    durable_every: int,
    loss: float,
    steps: int | None = None,
) -> Policy:
    """Memory-tier saves every ``steps`` steps (None: Young/Daly's interval), the durable
    copy every ``durable_every`` of them; ``loss``: share of interruptions losing both
    memory copies."""
    c, w = memory.blocked_s, memory.committed_s
    weight = 1 - loss + loss * durable_every
    n = young_daly_steps(c, m, step_s, w, weight) if steps is None else steps
    period = n * step_s + c
    kept = period / 2 + w + restart_s + memory.load_s
    gone = durable_every * period / 2 + w + durable.committed_s + restart_s + durable.load_s
    lost = (1 - loss) * kept + loss * gone
    return Policy(n, n * step_s / period * (1 - lost / m), lost)


def scaled(args: argparse.Namespace, gpus: int) -> tuple[Costs, Costs]:
    """The memory tier's and the durable tier's costs at ``gpus`` GPUs."""
    k = args.gb_per_gpu / args.measured_gb
    memory = Costs(args.mem_blocked * k, args.mem_committed * k, args.mem_load * k)
    through = gpus * args.gb_per_gpu / args.durable_gbps  # the whole job's bytes, shared store
    durable = Costs(
        args.disk_blocked * k,
        max(args.disk_committed * k, through),
        max(args.disk_load * k, through),
    )
    return memory, durable


def table(args: argparse.Namespace) -> str:
    rows = [
        "| GPUs | MTBF | durable only (Young/Daly) | memory tier, every step | memory tier "
        "(Young/Daly) | memory tier (Young/Daly), "
        f"{args.memory_loss:.0%} of interruptions lose both copies |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for gpus in args.gpus:
        m = mtbf_s(gpus, args.mtbf_h, args.ref_gpus)
        memory, durable = scaled(args, gpus)
        common = (m, args.step_s, args.restart_s)
        d = durable_only(durable, *common)
        every = memory_tier(memory, durable, *common, args.durable_every, 0.0, steps=1)
        best = memory_tier(memory, durable, *common, args.durable_every, 0.0)
        lossy = memory_tier(memory, durable, *common, args.durable_every, args.memory_loss)
        cells = [
            f"{p.goodput:.4%} (every {p.steps}, {p.lost_s:.0f} s lost)"
            for p in (d, every, best, lossy)
        ]
        rows.append(f"| {gpus:,} | {m / 3600:.2f} h | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def inputs(args: argparse.Namespace) -> str:
    k = args.gb_per_gpu / args.measured_gb
    return "\n".join(
        [
            f"- measured per rank at {args.measured_gb * 1e3:.2f} MB, scaled x{k:.2f} to "
            f"{args.gb_per_gpu:.3f} GB per GPU: memory-tier save blocked {args.mem_blocked} s, "
            f"committed {args.mem_committed} s, load {args.mem_load} s; durable (local disk) "
            f"async save blocked {args.disk_blocked} s, load {args.disk_load} s",
            f"- assumed: a rank's durable commit {args.disk_committed} s at the measured "
            "size (as the memory tier's), and at least the job's bytes over the durable "
            f"tier's aggregate bandwidth ({args.durable_gbps:g} GB/s) for its commit and its "
            f"load; {args.mtbf_h} h between interruptions at {args.ref_gpus:,} GPUs, linear "
            f"in the count; step {args.step_s} s; restart {args.restart_s} s before the load; "
            f"memory tier copied to the durable tier every {args.durable_every} memory saves",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--gpus", type=int, nargs="+", default=list(GPU_COUNTS), help="GPU counts (rows)")
    add("--mtbf-h", type=float, default=MTBF_H, help="hours between interruptions at --ref-gpus")
    add("--ref-gpus", type=int, default=REF_GPUS, help="GPU count of --mtbf-h")
    add("--step-s", type=float, default=STEP_S, help="seconds per training step (assumed)")
    add("--restart-s", type=float, default=RESTART_S, help="relaunch before the load (assumed)")
    add("--gb-per-gpu", type=float, default=GB_PER_GPU, help="checkpointed GB per GPU")
    add("--durable-gbps", type=float, default=DURABLE_GBPS, help="durable tier, aggregate GB/s")
    add("--durable-every", type=int, default=DURABLE_EVERY, help="memory saves per durable copy")
    add("--memory-loss", type=float, default=MEMORY_LOSS, help="share losing both memory copies")
    add("--measured-gb", type=float, default=MEASURED_GB, help="GB per rank the costs are for")
    add("--mem-blocked", type=float, default=MEM_SAVE_BLOCKED_S, help="measured, s")
    add("--mem-committed", type=float, default=MEM_SAVE_COMMITTED_S, help="measured, s")
    add("--mem-load", type=float, default=MEM_LOAD_S, help="measured, s")
    add("--disk-blocked", type=float, default=DISK_SAVE_BLOCKED_S, help="measured, s")
    add("--disk-load", type=float, default=DISK_LOAD_S, help="measured, s")
    add("--disk-committed", type=float, default=DISK_SAVE_COMMITTED_S, help="assumed, s")
    args = p.parse_args(argv)
    for name in ("mtbf_h", "step_s", "gb_per_gpu", "durable_gbps", "measured_gb"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.memory_loss <= 1 or args.durable_every < 1:
        p.error("--memory-loss must be in [0, 1] and --durable-every >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(table(args))
    print()
    print(inputs(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
