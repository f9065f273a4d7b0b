"""Worker for end-to-end checkpoint tests, run under ``torchrun``.

Each invocation runs a list of jobs (``--job`` repeated, JSON objects) in one process group,
so one launch serves several scenarios. A job trains the reference GPT-2 from step
``start`` to ``stop`` under a given stage, optionally loading a checkpoint first and saving
one at the end, and rank 0 writes per-step losses and the final full state dict
(safetensors, never pickle) under ``--out``.

Each rank prints one line per phase to stderr; the harness shows stderr only when a run
does not succeed, and then the last line of each rank says how far it got.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zerostate
from zerostate.models import GPT2, GPT2Config

CFG = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
SEQ = 16
LR = 1e-3
# GPT-2's attention key bias has an analytically zero gradient, so what it gets is rounding
# noise that Adam scales to full-size steps; with eps=1e-8 even two summation orders of the
# single-process reference disagree by ~1e-4 on it. eps=1e-6 keeps that noise floor near
# 1e-6, so the 1e-5 comparisons below test the engine, not float summation order.
EPS = 1e-6
WEIGHT_DECAY = 0.1
_T0 = time.monotonic()


def phase(what: str) -> None:
    rank = os.environ.get("RANK", "?")
    # One write per line (print writes the newline separately): ranks share the pipe.
    sys.stderr.write(f"[ckpt_worker rank {rank} +{time.monotonic() - _T0:.1f}s] {what}\n")
    sys.stderr.flush()


def make_model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config(**CFG))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def local_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def make_engine(stage: int, precision: str = "fp32") -> zerostate.Engine:
    return zerostate.Engine(
        make_model(),
        stage=stage,
        lr=LR,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        precision=precision,
    )


def run_job(job: dict, out: Path) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    name = job["name"]
    engine = make_engine(job["stage"], job.get("precision", "fp32"))
    phase(f"{name}: engine built (stage {job['stage']})")
    opts = job.get("storage_options")
    start = 0
    if job.get("load"):
        state = engine.load(job["load"], storage_options=opts)
        start = int(state["next_step"])
        assert start == job["start"], (start, job["start"])
        phase(f"{name}: loaded, next step {start}")
    losses = []
    for step in range(start, job["stop"]):
        idx, tgt = local_batch(step, rank, world_size)
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world_size)
    phase(f"{name}: trained to step {job['stop']}")
    handles = []
    for save in job.get("saves", []):
        h = engine.save(
            save["path"],
            step=job["stop"],
            blocking=save.get("blocking", True),
            client_state={"next_step": job["stop"]},
            storage_options=opts,
        )
        handles.append((save, h))
        phase(f"{name}: save to {save['path']} issued")
        if save.get("kill_rank") == rank:
            os.kill(os.getpid(), signal.SIGKILL)
    # Keep training while any async save is in flight: its snapshot must not move.
    for step in range(job["stop"], job["stop"] + job.get("train_after_save", 0)):
        idx, tgt = local_batch(step, rank, world_size)
        engine.backward(engine(idx, tgt))
        engine.step()
    for save, h in handles:
        t0 = time.perf_counter()
        h.wait()
        save["wait_s"] = time.perf_counter() - t0
        save["blocked_s"] = h.blocked_s
    engine.close()  # nothing in flight any more; a failed save would raise here
    phase(f"{name}: saves done, engine closed")
    full = engine.full_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(
            json.dumps({"losses": losses, "world_size": world_size, "saves": job.get("saves", [])})
        )
    dist.barrier()
    phase(f"{name}: done")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", action="append", default=[], help="JSON job description")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    phase("starting")
    dist.init_process_group("gloo")
    phase("process group up")
    args.out.mkdir(parents=True, exist_ok=True)
    for raw in args.job:
        run_job(json.loads(raw), args.out)
    dist.destroy_process_group()
    phase("process group destroyed; exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
