"""Interleaved A/B of the shared-memory transport ([Note: shared-memory transport] in
zerostate/dist/shm.py): in one torchrun job, three trainers of the same model take turns
step by step, so the machine's load falls on all three alike: zerostate over a group whose
large collectives go through shared memory, zerostate over a group kept on gloo, and DDP
(+ torch AdamW, or ZeroRedundancyOptimizer at stage 1) over a third group::

    torchrun --nproc-per-node 2 -m benchmarks.shm_ab --stage 0 --model small

Prints, on rank 0, the median over steps of the slowest rank's step time of each, and the
ratios (same steps)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.distributed as dist

    import zerostate
    from benchmarks.common import LR, MLP, WEIGHT_DECAY, gloo_job
    from benchmarks.contenders import batches, build_model
    from zerostate.dist import collectives, shm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=0)
    parser.add_argument(
        "--model",
        choices=["small", "mlp", "llama"],
        default="small",
        help="llama: a transformers Llama from a config of odd shapes, engine defaults",
    )
    args, rank, world = gloo_job(parser, argv, steps=20)
    on_gloo = dist.new_group(backend="gloo")
    peer_group = dist.new_group(backend="gloo")
    # The transport of a group is decided at its first large collective, from the switch.
    os.environ[shm.ENV] = "0"
    collectives.all_reduce(torch.zeros(shm.MIN_ELEMENTS), group=on_gloo, stats=None)
    os.environ[shm.ENV] = "1"
    mlp = MLP if args.model == "mlp" else None
    micro = 16 if args.model == "mlp" else 8
    data = batches("small" if args.model == "llama" else args.model, rank, micro, 64, 2,
                   torch.device("cpu"), mlp)  # fmt: skip

    def model():
        if args.model == "llama":
            return _llama()
        return build_model(args.model, torch.device("cpu"), mlp)

    def engine_step(group):
        settings = {} if args.model == "llama" else dict(
            lr=LR, weight_decay=WEIGHT_DECAY, no_decay=lambda name, p: False
        )  # fmt: skip
        engine = zerostate.Engine(model(), stage=args.stage, group=group, **settings)

        def step(x, y):
            engine.backward(engine(x, y))
            engine.step()

        return step

    trainers = {
        "zerostate, shared memory": engine_step(None),
        "zerostate, gloo": engine_step(on_gloo),
    }
    peer = "ddp" if args.stage == 0 else "zero1opt"
    if args.stage <= 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model(), process_group=peer_group)
        if peer == "ddp":
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            opt = ZeroRedundancyOptimizer(
                ddp.parameters(),
                optimizer_class=torch.optim.AdamW,
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                process_group=peer_group,
            )

        def peer_step(x, y):
            opt.zero_grad(set_to_none=True)
            ddp(x, y).backward()
            opt.step()

        trainers[peer] = peer_step
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(args.warmup + args.steps):
        batch = data[i % 2]
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            trainers[name](batch[:, :-1], batch[:, 1:])
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
            if i >= args.warmup:
                times[name].append(float(dt) * 1e3)
    out = {name: round(statistics.median(ts), 2) for name, ts in times.items()}
    base = out["zerostate, shared memory"]
    out["shared / gloo"] = round(base / out["zerostate, gloo"], 3)
    if peer in out:
        out[f"shared / {peer}"] = round(base / out[peer], 3)
        out[f"gloo / {peer}"] = round(out["zerostate, gloo"] / out[peer], 3)
    out.update(stage=args.stage, model=args.model, ranks=world, steps=args.steps)
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    return out


def _llama():
    """A transformers Llama from a config the step row was not tuned on: odd widths,
    grouped-query attention, an untied odd vocabulary; ``forward(x, y)`` gives the loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=1003, hidden_size=200, intermediate_size=536,
                         num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    lm = LlamaForCausalLM(config)

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, x, y):
            logits = self.lm(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    return Loss()


if __name__ == "__main__":
    main()
