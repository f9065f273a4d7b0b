"""A torchrun job of the memory-tier end-to-end test: stage 3 on a tiny MLP, a memory-tier
save after every step (durable every 4), optionally every rank SIGKILLs itself right after
the save of step ``--kill-after``; a resumed job loads first. Writes the final parameters
(rank 0) as a safetensors file."""

from __future__ import annotations

import argparse
import os
import signal

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
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    engine = zerostate.Engine(model, stage=3, lr=1e-2, memory_durable_every=4)
    if args.resume:
        engine.load(args.root)
        if rank == 0:
            print(engine._ckpt().tiers.last_report, flush=True)
    while engine.optimizer_steps < args.stop:
        step = engine.optimizer_steps
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4 * world, 16, generator=gen)[4 * rank : 4 * (rank + 1)]
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save(args.root, tier="memory", blocking=False)
        if engine.optimizer_steps == args.kill_after:
            engine._ckpt().wait()  # the memory step is committed on both nodes
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    state = engine.full_state_dict()
    engine.close()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
