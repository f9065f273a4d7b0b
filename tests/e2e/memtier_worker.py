"""A torchrun job of the memory-tier end-to-end test: stage 3 on a tiny MLP, a memory-tier
save after every step (durable every 4), optionally every rank SIGKILLs itself right after
the save of step ``--kill-after`` (and its durable copy, if one is in flight), or one rank
SIGKILLs itself in the middle of the step after the save of step ``--die-mid-step`` unless
the job resumed (torchrun ``--max-restarts`` restarts every worker, which loads first).
``--resume``: load first, where the root or the memory tier holds a step. Writes the final
parameters (rank 0) as a safetensors file."""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import zerostate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--stop", type=int, required=True)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--die-mid-step", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=3)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    # A peer that died leaves the others in a collective until this timeout at worst.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    engine = zerostate.Engine(model, stage=3, lr=1e-2, memory_durable_every=4)
    resumed = False
    if args.resume:  # every start of the job, as a restarted worker's: nothing saved yet is
        try:  # a fresh start (torchrun's agents number their restarts differently)
            engine.load(args.root)
            resumed = True
        except zerostate.CheckpointNotFoundError:
            pass
        if rank == 0:
            steps, report = engine.optimizer_steps, engine._ckpt().tiers.last_report
            print(f"resumed={resumed} at step {steps}: {report}", flush=True)
    while engine.optimizer_steps < args.stop:
        step = engine.optimizer_steps
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4 * world, 16, generator=gen)[4 * rank : 4 * (rank + 1)]
        loss = engine(x).square().mean()
        if step == args.die_mid_step and not resumed and rank == args.die_rank:
            engine._ckpt().wait()  # the memory step is committed on both nodes
            os.kill(os.getpid(), signal.SIGKILL)  # between the forward and the backward
        engine.backward(loss)
        engine.step()
        engine.save(args.root, tier="memory", blocking=False)
        if engine.optimizer_steps == args.kill_after:
            engine._ckpt().wait()  # the memory step is committed on both nodes
            engine._ckpt().tiers.wait()  # and the durable copy in flight, if any
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    state = engine.full_state_dict()
    engine.close()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
