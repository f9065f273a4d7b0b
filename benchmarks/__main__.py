"""``python -m benchmarks``: zerostate vs DDP, ZeroRedundancyOptimizer, DeepSpeed, FSDP2 and
torch.distributed.checkpoint, every row in one run; writes docs/benchmarks/latest.md,
latest.json and PNG plots.

    python -m benchmarks                  # everything (about 10 minutes on 2 CPU cores)
    python -m benchmarks --quick          # tiny sizes (the smoke test; ranks forked from
                                          # one process, --launcher torchrun for torchrun)
    python -m benchmarks --only save      # one row: step, save, load, s3, mesh, layout
                                          # (save includes async save, load, consolidate)

With ``--only``, the sections of this run replace the same sections of the report already
in ``--out`` and the others stay, each saying which command produced it and when.

Exit status: 0 when every contender ran and every number is finite, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import report as rep
from benchmarks.common import LAUNCHERS, REPO, set_launcher, version_of

ROWS = ("step", "save", "s3", "mesh", "layout")
ALIASES = {"async": "save", "load": "save", "consolidate": "save"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="zerostate vs DDP, ZeroRedundancyOptimizer, DeepSpeed, FSDP2 and "
                    "torch.distributed.checkpoint, every row in one run")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds per contender")
    p.add_argument("--only", help="comma-separated rows: step,save,load,async,consolidate,s3,"
                                  "mesh,layout (save, async, load and consolidate run together); "
                                  "the report keeps the other sections of the one in --out")
    p.add_argument("--contenders", help="step row: comma-separated subset, e.g. ddp,zs0")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks",
                   help="where latest.md, latest.json and the plots go")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    p.add_argument("--nproc", type=int, default=2, help="ranks per contender (default 2)")
    p.add_argument("--load-nproc", type=int, default=3,
                   help="ranks that load the checkpoints the --nproc ranks wrote (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    p.add_argument("--rounds", type=int, default=2,
                   help="step, load, s3, mesh and layout rows: run every contender (and "
                        "the load rows' cat) this many times, alternating the order, and "
                        "keep each one's best round (default 2)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="how a job starts its ranks: torchrun (the default, every measured "
                        "run) or fork, from one process that imported the libraries once "
                        "(the default of --quick: a smoke run, not a measurement)")
    p.add_argument("--update-readme", action="store_true",
                   help="also rewrite the benchmark table in README.md")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every job's output")
    args = p.parse_args(argv)
    rows = [r.strip() for r in (args.only or ",".join(ROWS)).split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS and r not in ALIASES]
    if bad:
        p.error(f"unknown row(s) {bad}; choose from {', '.join((*ROWS, *ALIASES))}")
    args.rows = [r for r in ROWS if r in {ALIASES.get(x, x) for x in rows}]
    args.contenders = ([c.strip() for c in args.contenders.split(",")]
                       if args.contenders else None)
    from benchmarks.contenders import CONTENDERS

    unknown = [c for c in args.contenders or [] if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    if min(args.nproc, args.load_nproc, args.steps, args.rounds) < 1:
        p.error("--nproc, --load-nproc, --steps and --rounds must be >= 1")
    if args.quick:
        args.rounds = 1  # the smoke run checks that contenders work, not their speed
    if args.launcher is None:
        args.launcher = "fork" if args.quick else "torchrun"
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # a scratch directory to measure
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        print("python -m benchmarks launches its own torchrun jobs; run it with plain python",
              file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    set_launcher(args.launcher)
    t0 = time.perf_counter()
    sections, failed = [], []
    for row in args.rows:
        print(f"{row} ...", flush=True)
        try:
            if row == "step":
                from benchmarks import step

                sections.append(step.run(args))
                if getattr(args, "model", None) is None:
                    sections.append(step.run_mlp(args))
            elif row == "save":
                from benchmarks import ckpt_rows

                sections += ckpt_rows.run(args)
            elif row == "s3":
                from benchmarks import s3

                sections.append(s3.run(args))
            elif row == "mesh":
                from benchmarks import mesh_rows

                sections.append(mesh_rows.run(args))
            elif row == "layout":
                from benchmarks import layout

                sections.append(layout.run(args))
        except Exception as exc:  # one broken row must not lose the others' numbers
            traceback.print_exc()
            failed.append({"key": row, "error": f"{type(exc).__name__}: {exc}"})
    report = {
        "command": " ".join(["python -m benchmarks",
                             *(argv if argv is not None else sys.argv[1:])]),
        "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": time.perf_counter() - t0,
        "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                                   f"{platform.system()}",
                        "python": platform.python_version(), "torch": version_of("torch"),
                        "deepspeed": version_of("deepspeed"), "nproc": args.nproc,
                        "quick": args.quick, "launcher": args.launcher},
        "sections": sections,
        "failed_sections": failed,
    }
    for sec in sections:
        sec["produced"] = {k: report[k] for k in ("command", "finished_utc", "wall_s")}
    if args.only:
        report = rep.merged(rep.previous(args.out), report)
    rep.write(report, args.out)
    if args.update_readme and not rep.update_readme(report, REPO / "README.md"):
        print("README.md has no benchmark markers; not updated", file=sys.stderr)
    print(rep.markdown(report))
    issues = rep.problems(report)
    for line in issues:
        print(f"PROBLEM {line}", file=sys.stderr)
    print(f"wrote {args.out / 'latest.md'} ({report['wall_s']:.0f} s)")
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
