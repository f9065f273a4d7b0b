"""Phase times of one contender's training step on rank 0: forward, backward and
``step()`` (zerostate) or ``optimizer.step()`` (torch), median over steps. Where a step's
time goes, beside the step row's totals; run under torchrun::

    torchrun --nproc-per-node 2 -m benchmarks.phases --contender zs0 --model small

``ZEROSTATE_SHM=0`` in the environment keeps zerostate's collectives on gloo
([Note: shared-memory transport] in zerostate/dist/shm.py), for a before/after."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.common import MLP, gloo_job
    from benchmarks.contenders import CONTENDERS, Ctx, batches, build_model, make

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = sorted(n for n in CONTENDERS if n.startswith("zs") or n in ("ddp", "zero1opt"))
    parser.add_argument("--contender", choices=names, required=True)
    parser.add_argument("--model", choices=["small", "mlp"], default="small")
    args, rank, world = gloo_job(parser, argv, steps=12)
    ctx = Ctx(rank=rank, world=world, device=torch.device("cpu"), cuda=False)
    model = build_model(args.model, ctx.device, MLP if args.model == "mlp" else None)
    micro = 16 if args.model == "mlp" else 8
    trainer = make(args.contender, model, ctx, micro_batch=micro)
    data = batches(args.model, rank, micro, 64, 2, ctx.device, MLP if args.model == "mlp" else None)
    engine = trainer.obj if args.contender.startswith("zs") else None
    module, opt = trainer.obj, trainer.optimizer
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": []}
    for i in range(args.warmup + args.steps):
        batch = data[i % 2]
        dist.barrier()
        t0 = time.perf_counter()
        if engine is None:
            opt.zero_grad(set_to_none=True)
            loss = module(batch[:, :-1], batch[:, 1:])
        else:
            loss = engine(batch[:, :-1], batch[:, 1:])
        t1 = time.perf_counter()
        if engine is None:
            loss.backward()
        else:
            engine.backward(loss)
        t2 = time.perf_counter()
        (opt if engine is None else engine).step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                phases[key].append(dt * 1e3)
    out = {k: round(statistics.median(v), 2) for k, v in phases.items()}
    out.update(
        contender=args.contender,
        model=args.model,
        ranks=world,
        shm=os.environ.get("ZEROSTATE_SHM", "1"),
    )
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
