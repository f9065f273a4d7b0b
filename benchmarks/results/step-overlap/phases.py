"""Per-phase step times (forward, backward, step) of several contenders built in one process
group and stepped in turn, so outside load falls on each alike; slowest rank, median.

    torchrun --nproc_per_node 2 benchmarks/results/step-overlap/phases.py \\
        --model mlp --contenders ddp,zs0,zero1opt,ds1,zs1 --steps 10

(from the repository root, ``PYTHONPATH=.``; ``--model small`` is the step row's GPT-2)."""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.contenders import Ctx, batches, build_model, make
from benchmarks.deepspeed_import import import_deepspeed

torch.set_num_threads(1)


def phases(trainer, name: str, batch: torch.Tensor) -> list[float]:
    x, y = batch[:, :-1], batch[:, 1:]
    ts = [time.perf_counter()]
    if name.startswith(("zs", "ds")):
        loss = trainer.obj(x, y)
        ts.append(time.perf_counter())
        trainer.obj.backward(loss)
        ts.append(time.perf_counter())
        trainer.obj.step()
    else:
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer.obj(x, y)
        ts.append(time.perf_counter())
        loss.backward()
        ts.append(time.perf_counter())
        trainer.optimizer.step()
    ts.append(time.perf_counter())
    return [ts[i + 1] - ts[i] for i in range(3)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--contenders", default="ddp,zs0")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    names = a.contenders.split(",")
    if any(n.startswith("ds") for n in names):
        import_deepspeed().init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    ctx = Ctx(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), False)
    mb, seq = (16, 1) if a.model == "mlp" else (8, 64)
    trainers = {n: make(n, build_model(a.model, ctx.device), ctx, micro_batch=mb) for n in names}
    data = batches(a.model, ctx.rank, mb, seq, 2, ctx.device)
    res: dict[str, list] = {n: [] for n in names}
    for i in range(3 + a.steps):
        for n in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            r = phases(trainers[n], n, data[i % 2])
            if i >= 3:
                res[n].append([*r, sum(r)])
    t = torch.tensor([res[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if ctx.rank == 0:
        for k, n in enumerate(names):
            med = [statistics.median(t[k, :, j].tolist()) * 1e3 for j in range(4)]
            print(f"{n:9s} fwd {med[0]:6.1f} bwd {med[1]:6.1f} step {med[2]:6.1f} "
                  f"total {med[3]:6.1f} ms")
    sys.stdout.flush()
    os._exit(0)  # gloo teardown after finished work sometimes aborts (benchmarks/worker.py)


if __name__ == "__main__":
    main()
