"""ZeRO inside a device mesh against FSDP2 + TP built the torchtitan way, on one node.

    torchrun --nproc-per-node 8 -m benchmarks.mesh --out mesh.json          # tp 2 x dp_shard 4
    torchrun --nproc-per-node 4 -m benchmarks.mesh --device cpu --tp 2 --preset tiny \\
        --precision fp32 --out mesh.json                                   # the CPU smoke run

Every rank builds the same transformers Llama from a config (no hub), applies torch's
``parallelize_module`` over ``mesh["tp"]`` (q/k/v/gate/up colwise, o/down rowwise, as
torchtitan's Llama plan does for the blocks) and trains a few steps on random tokens, each
``dp_shard`` coordinate its own batch. Contenders, one after the other in this job:

* ``fsdp2_tp``: ``fully_shard`` of every layer and of the root over ``mesh["dp_shard"]``,
  ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``, ``torch.optim.AdamW``;
* ``fsdp2_tp_ac``: the same with every layer in torch's ``checkpoint_wrapper`` (torchtitan's
  full activation checkpointing);
* ``zerostate``: ``Engine(model, mesh=mesh, stage=S, precision=...)`` (reduce in fp32);
* ``zerostate_pa``: the same with ``activation_checkpointing="partitioned"`` (ZeRO-R Pa);
* ``zerostate_stage3``: ``stage=3``, FSDP2's partitioning.

Per contender: median step time over the timed steps (the slowest rank's), peak memory
(the fullest rank's): ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS
(``ru_maxrss``: interpreter and imports included) on CPU; model-state bytes per rank (the
local shards of parameters, gradients, fp32 masters and optimizer states: zerostate's
``memory_stats()["model_states"]``, counted from the live tensors for FSDP2) and the last
loss. Peak RSS is a process's high-water mark, so it means something only with one contender
per job: ``python -m benchmarks --only mesh`` (:func:`run`) starts a torchrun job per
contender. Rank 0 writes the JSON; a contender that fails is recorded with its error and the
next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from typing import Any

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab, micro-batch, sequence
    "tiny": dict(hidden=48, inter=100, layers=2, heads=4, kv=2, vocab=256, mb=2, seq=16),
    # ~4M parameters: timing is the model's work, not per-step overhead, and every
    # contender still finishes in well under a minute on 2 CPU cores (the report's row).
    "cpu": dict(hidden=256, inter=688, layers=4, heads=8, kv=4, vocab=2048, mb=4, seq=64),
    "1b": dict(hidden=2048, inter=5632, layers=16, heads=16, kv=8, vocab=32000, mb=4, seq=2048),
}
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")
COLWISE += ("mlp.up_proj",)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
CONTENDERS = ("fsdp2_tp", "fsdp2_tp_ac", "zerostate", "zerostate_pa", "zerostate_stage3")


def build(preset: dict, device: Any, tp_mesh: Any | None) -> Any:
    """The Llama of ``preset``, its blocks parallelized over ``tp_mesh`` (None: not at all)."""
    import torch
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=preset["vocab"], hidden_size=preset["hidden"],
        intermediate_size=preset["inter"], num_hidden_layers=preset["layers"],
        num_attention_heads=preset["heads"], num_key_value_heads=preset["kv"],
        max_position_embeddings=preset["seq"], use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if tp_mesh is None:
        return model
    plan = {}
    for i in range(len(model.model.layers)):
        plan.update({f"model.layers.{i}.{n}": ColwiseParallel() for n in COLWISE})
        plan.update({f"model.layers.{i}.{n}": RowwiseParallel() for n in ROWWISE})
    return parallelize_module(model, tp_mesh, plan)


def batches(preset: dict, dp_rank: int, steps: int, device: Any) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    shape = (preset["mb"], preset["seq"])
    return [torch.randint(0, preset["vocab"], shape, generator=g).to(device) for _ in range(steps)]


def run_fsdp2(model: Any, mesh: Any, dtype: Any, ac: bool) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: Any) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step, model, lambda: fsdp2_model_state_bytes(model, opt)


def fsdp2_model_state_bytes(model: Any, opt: Any) -> int:
    """This rank's bytes of parameters, gradients and optimizer states, as the local
    tensors of their DTensors (what zerostate's ``memory_stats()`` counts for itself)."""
    import torch

    def local(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += local(p) + local(p.grad)
        total += sum(local(v) for v in opt.state.get(p, {}).values())
    return total


def run_zerostate(model: Any, mesh: Any, precision: str, stage: int, ac: str | None):
    import zerostate

    engine = zerostate.Engine(
        model, mesh=mesh, stage=stage, precision=precision, lr=1e-4,
        activation_checkpointing=ac,
    )  # fmt: skip

    def step(x: Any) -> float:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, engine, lambda: engine.memory_stats()["model_states"]


def measure(name: str, args: argparse.Namespace, mesh: Any, device: Any) -> dict:
    import torch
    import torch.distributed as dist

    preset = PRESETS[args.preset]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    dp_rank = int(mesh.get_local_rank("dp_shard"))
    data = batches(preset, dp_rank, args.warmup + args.steps, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(preset, device, mesh["tp"])
    if name.startswith("fsdp2"):
        step, owner, states = run_fsdp2(model, mesh, dtype, ac=name.endswith("_ac"))
    else:
        ac = "partitioned" if name.endswith("_pa") else None
        stage = 3 if name.endswith("_stage3") else args.stage
        step, owner, states = run_zerostate(model, mesh, args.precision, stage, ac)
    times, loss = [], None
    for i, x in enumerate(data):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step(x)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    mine = [statistics.median(times), float(peak), float(peak_rss_bytes()), float(states())]
    per_rank = torch.zeros(dist.get_world_size(), len(mine), dtype=torch.float64, device=device)
    per_rank[dist.get_rank()] = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(per_rank)  # every rank's row, on every rank
    if hasattr(owner, "close"):
        owner.close()
    del model, owner, step, states
    worst = per_rank.max(dim=0).values  # the slowest / fullest rank
    return {
        "step_s": float(worst[0]),
        "peak_device_bytes": int(worst[1]) if cuda else None,
        "peak_rss_bytes": int(worst[2]),
        "peak_rss_bytes_per_rank": [int(v) for v in per_rank[:, 2].tolist()],
        "model_state_bytes": int(worst[3]),
        "model_state_bytes_per_rank": [int(v) for v in per_rank[:, 3].tolist()],
        "step_s_per_rank": [float(v) for v in per_rank[:, 0].tolist()],
        "last_loss": float(loss),
    }


def peak_rss_bytes() -> int:
    """This process's high-water resident set size (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--preset", default="1b", choices=tuple(PRESETS))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    shape = (world // args.tp, args.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp_shard", "tp"))
    result: dict[str, Any] = {
        "mesh": {"dp_shard": shape[0], "tp": shape[1]},
        "preset": args.preset,
        "precision": args.precision,
        "stage": args.stage,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": {},
    }
    for name in args.contenders.split(","):
        try:
            result["rows"][name] = measure(name, args, mesh, device)
        except Exception as exc:  # recorded; the next contender runs
            result["rows"][name] = {"error": repr(exc), "trace": traceback.format_exc()[-2000:]}
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            print(name, json.dumps(result["rows"][name])[:300], flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
