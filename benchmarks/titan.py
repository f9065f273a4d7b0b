"""torchtitan's own Llama3 with torchtitan's own tensor-parallel plan: zerostate stage 3 for the
data-parallel axis against FSDP2 applied the torchtitan way, one contender per job.

    torchrun --nproc-per-node 4 -m benchmarks.titan --contender zerostate --out zs.json
    torchrun --nproc-per-node 4 -m benchmarks.titan --contender fsdp2 --out fsdp2.json
    python -m benchmarks.titan --table fsdp2.json zs.json      # the markdown rows
    bash scripts/torchtitan.sh bench                           # all of it, in its own venv

torchtitan (0.3.0) cannot share the project's environment: its ``datasets<4.8`` pins an fsspec
older than the one s3fs needs. ``scripts/torchtitan.sh`` builds a separate virtual environment
with torchtitan installed without its training-loop dependencies (the model code needs
``spmd_types``, ``tyro`` and ``triton``'s import only).

The model is the ``debugmodel`` flavour (6 blocks, dim 256, 16 heads, vocabulary 2048; 6.2M
parameters) with what runs on CPU: ``ScaledDotProductAttention`` for the inner attention
(torchtitan's default FlexAttention compiles a kernel), the ``partial_dtensor`` backend (DTensor
on the tp axis only, data parallelism out of band: what ``parallelize_llama`` does for FSDP2)
and the RoPE cache sized to the sequence length as torchtitan's trainer sizes it. Every rank
builds the same model from one seed, then ``model.parallelize(parallel_dims)`` applies the
plan torchtitan declares for it (``set_llama3_sharding_config``: fused wqkv and w1/w3 colwise,
wo/w2 rowwise, the embedding and the vocabulary-parallel output sharded, sequence-parallel
norms; the RoPE cache becomes a replicated DTensor buffer).

Contenders on a (dp_shard 2 x tp 2) gloo mesh, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, no
weight decay), fp32, no clipping, the loss torchtitan computes (summed cross entropy over the
vocabulary-parallel logits, divided by the global token count):

* ``fsdp2``: torchtitan's ``apply_fsdp_to_decoder`` over ``parallel_dims.get_mesh("fsdp")``
  (every block a ``fully_shard`` unit, embeddings and norm+head units, the root; gradient
  division off, as torchtitan sets it), ``torch.optim.AdamW``;
* ``zerostate``: ``zerostate.Engine(model, mesh=init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("dp_shard", "tp")), stage=3, lr=1e-3)``, everything else at its defaults.

Per contender: the process's peak RSS (``ru_maxrss``, imports included: one contender per
job) and the model-state bytes (local shards of parameters, gradients, fp32 masters and
optimizer states: ``memory_stats()["model_states"]`` for zerostate, counted from the live
tensors for FSDP2), per rank, after the last step; the global loss of every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from typing import Any

from benchmarks.mesh import fsdp2_model_state_bytes

#: Tokens per row (divisible by tp: sequence parallelism splits it), rows per rank.
SEQ, ROWS = 64, 2
LR = 1e-3
BETAS, EPS = (0.9, 0.999), 1e-8


#: torchtitan's RoPE variants: ``complex`` (Llama3's own, a complex64 cache, llama scaling)
#: and ``cos_sin`` (its real-valued one, a float32 cache; it has no llama scaling).
ROPES = ("complex", "cos_sin")


def llama3_config(*, tp: bool, rope: str = "complex") -> Any:
    """torchtitan's Llama3 ``debugmodel`` config, with its TP plan declared when ``tp``."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = model_registry("debugmodel", attn_backend="flex").model
    for layer in config.layers:
        # The CPU-capable attention: SDPA, causal (torchtitan's FlexAttention compiles).
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # The RoPE cache as torchtitan's trainer sizes it: training.seq_len rows.
        cache = layer.attention.rope
        if rope == "cos_sin":
            layer.attention.rope = CosSinRoPE.Config(dim=cache.dim, max_seq_len=SEQ,
                                                     theta=cache.theta)  # fmt: skip
        else:
            layer.attention.rope = dataclasses.replace(cache, max_seq_len=SEQ)
    if tp:
        # What Llama3Model.Config.update_from_config does for the job's parallelism.
        set_llama3_sharding_config(config, enable_sp=True)
    return config


def parallel_dims(dp_shard: int, tp: int) -> Any:
    """torchtitan's ``ParallelDims`` for (dp_shard x tp) with the ``partial_dtensor``
    backend, its meshes built on CPU (gloo)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.models.llama3  # noqa: F401 - as a torchtitan job imports it first
    from torchtitan.distributed import utils as titan_dist

    # torchtitan picks its mesh device type once, "cuda" when no accelerator is found.
    # (build_mesh also needs the "fake" process-group backend for its size-1 axes, which
    # importing torch's FSDP registers: torchtitan's model package does.)
    titan_dims.device_type = "cpu"
    titan_dist.set_spmd_backend("partial_dtensor")
    dims = titan_dims.ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
        world_size=dist.get_world_size(), spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    return dims


def build(dims: Any | None, rope: str = "complex") -> Any:
    """The model, the same on every rank (one seed), parallelized by torchtitan's plan
    over ``dims`` (None: a plain model)."""
    import torch
    from torchtitan.distributed import utils as titan_dist

    titan_dist.set_spmd_backend("partial_dtensor")  # what torchtitan's loss reads
    torch.manual_seed(0)
    model = llama3_config(tp=dims is not None, rope=rope).build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if dims is not None:
        model.parallelize(dims)
    model.train()
    return model


def batch(step: int, dp_rank: int) -> tuple[Any, Any]:
    """Data-parallel rank ``dp_rank``'s inputs and labels at ``step`` (the tp ranks of one
    data-parallel coordinate read the same rows)."""
    import torch

    g = torch.Generator().manual_seed(10_000 + 100 * step + dp_rank)
    tokens = torch.randint(0, 2048, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def summed_loss(logits: Any, labels: Any) -> Any:
    """torchtitan's loss: summed cross entropy (vocabulary-parallel on DTensor logits)."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels)


def global_loss(local_sum: Any, dp_group: Any, dp: int) -> float:
    """The mean loss over every token of the step's global batch."""
    import torch.distributed as dist

    total = local_sum.detach().clone()
    dist.all_reduce(total, group=dp_group)
    return float(total) / (dp * ROWS * SEQ)


def peak_rss_bytes() -> int:
    """This process's high-water resident set size (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now."""
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def mesh_2x2() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))


def train_fsdp2(steps: range, rope: str = "complex") -> dict:
    """FSDP2 + TP the torchtitan way on (dp_shard 2 x tp 2)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    dims = parallel_dims(2, 2)
    model = build(dims, rope)
    dp_mesh = dims.get_mesh("fsdp")
    apply_fsdp_to_decoder(
        model, dp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
        pp_enabled=False,
    )  # fmt: skip
    # Gloo has no PREMUL_SUM: reduce with a plain sum (what torchtitan sets for its
    # symmetric-memory path; the gradient division is already off).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    dp_rank, group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    losses, with_grads = [], 0
    for step in steps:
        x, y = batch(step, dp_rank)
        local = summed_loss(model(x), y)
        (local / (2 * ROWS * SEQ)).backward()  # divided by the global token count
        opt.step()
        with_grads = fsdp2_model_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        losses.append(global_loss(local, group, 2))
    return {
        "losses": losses,
        # After the step, gradient shards still held (what zerostate keeps between steps).
        "model_state_bytes": with_grads,
        # Between steps: zero_grad(set_to_none=True) has freed the gradient shards.
        "model_state_bytes_between_steps": fsdp2_model_state_bytes(model, opt),
    }


def engine_units(engine: Any) -> list[list]:
    """The stage-3 units (gather groups) the engine made: ``[name, parameter count]``."""
    return [[g.name, len(g.params)] for g in engine._runtime.groups]


def train_zerostate(
    steps: range, *, save_to: str | None = None, save_after: int | None = None,
    report: Any = None, rope: str = "complex",
) -> dict:  # fmt: skip
    """zerostate stage 3 on (dp_shard 2 x tp 2), default settings; saves to ``save_to`` after
    step ``save_after`` when asked. ``report(key, value)`` hears of progress as it happens
    (the units first), so a later failure leaves what came before."""
    import zerostate

    report = report or (lambda key, value: None)
    mesh = mesh_2x2()
    dims = parallel_dims(2, 2)
    model = build(dims, rope)
    blocks = list(model.layers.values())
    block_bytes = [_local_bytes(b.parameters()) for b in blocks]
    root_bytes = _local_bytes(model.parameters()) - sum(block_bytes)
    engine = zerostate.Engine(model, mesh=mesh, stage=3, lr=LR)
    report("units", engine_units(engine))
    gathered: list[list[int]] = []  # [block, gathered bytes] while each block computes

    def probe(i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:  # before the block's release
            gathered.append([i, engine.memory_stats()["gathered_params"]])

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_hook(probe(i), prepend=True)
    dp_rank, group = mesh.get_local_rank("dp_shard"), mesh["dp_shard"].get_group()
    losses = []
    for step in steps:
        x, y = batch(step, dp_rank)
        local = summed_loss(engine(x), y)
        engine.backward(local / (ROWS * SEQ))  # the engine averages over the dp ranks
        engine.step()
        losses.append(global_loss(local, group, 2))
        report("losses", losses)
        if save_to is not None and step == save_after:
            engine.save(save_to)
            report("saved_after", step)
    states = engine.memory_stats()["model_states"]
    out = {"losses": losses, "units": engine_units(engine), "model_state_bytes": states,
           "model_state_bytes_between_steps": states, "gathered": gathered,
           "block_bytes": block_bytes, "root_bytes": root_bytes}  # fmt: skip
    engine.close()
    return out


def _local_bytes(params: Any) -> int:
    """Bytes of this rank's tensor-parallel shards of ``params`` (what stage 3 gathers)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return sum(t.numel() * t.element_size() for t in local)


def resume_zerostate(load_from: str, steps: range, rope: str = "complex") -> dict:
    """zerostate stage 3 on 2 ranks, no tp, the plain model: loads and trains on."""
    import torch.distributed as dist

    import zerostate

    model = build(None, rope)
    engine = zerostate.Engine(model, stage=3, lr=LR)
    engine.load(load_from)
    losses = []
    for step in steps:
        x, y = batch(step, dist.get_rank())
        local = summed_loss(engine(x), y)
        engine.backward(local / (ROWS * SEQ))
        engine.step()
        losses.append(global_loss(local, None, 2))
    engine.close()
    return {"losses": losses}


def measure(contender: str, steps: int, rope: str = "complex") -> dict:
    """One contender's numbers, every rank's, on every rank."""
    import torch
    import torch.distributed as dist
    import torchtitan.components.loss  # noqa: F401 - both jobs import the same modules
    import torchtitan.models.llama3  # noqa: F401

    import zerostate  # noqa: F401

    before = rss_bytes()  # interpreter, torch, torchtitan, zerostate, process groups
    start = time.perf_counter()
    run = train_fsdp2 if contender == "fsdp2" else train_zerostate
    result = run(range(steps), rope=rope)
    seconds = time.perf_counter() - start
    numbers = (before, peak_rss_bytes(), result["model_state_bytes"],
               result["model_state_bytes_between_steps"])  # fmt: skip
    mine = torch.tensor([float(v) for v in numbers], dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return {
        "contender": contender,
        "mesh": {"dp_shard": 2, "tp": 2},
        "rope": rope,
        "torch": torch.__version__,
        "torchtitan": torchtitan.__version__,
        "rss_before_model_bytes_per_rank": [int(r[0]) for r in rows],
        "peak_rss_bytes_per_rank": [int(r[1]) for r in rows],
        "model_state_bytes_per_rank": [int(r[2]) for r in rows],
        "model_state_bytes_between_steps_per_rank": [int(r[3]) for r in rows],
        "units": result.get("units"),
        "losses": result["losses"],
        "seconds": seconds,
    }


def table(paths: list[str]) -> str:
    """The markdown rows of the given results (one JSON per contender)."""
    lines = [
        "| contender | peak RSS per rank, MiB (of it before the model) | model-state bytes per "
        "rank after a step (between steps) | stage-3 units | losses |",
        "|---|---|---|---|---|",
    ]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        if "error" in r:
            lines.append(f"| {r['contender']} | failed: {r['error'][:160]} | | | |")
            continue
        rss = ", ".join(
            f"{peak / 2**20:.0f} ({before / 2**20:.0f})"
            for peak, before in zip(
                r["peak_rss_bytes_per_rank"], r["rss_before_model_bytes_per_rank"], strict=True
            )
        )
        after, between = (
            r["model_state_bytes_per_rank"],
            r["model_state_bytes_between_steps_per_rank"],
        )
        states = ", ".join(
            f"{a:,}" + ("" if a == b else f" ({b:,})") for a, b in zip(after, between, strict=True)
        )
        units = r.get("units")
        units = "; ".join(f"{n or '(root)'}: {c}" for n, c in units) if units else "-"
        losses = ", ".join(f"{v:.6f}" for v in r["losses"])
        lines.append(f"| {r['contender']} | {rss} | {states} | {units} | {losses} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contender", choices=("zerostate", "fsdp2"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rope", choices=ROPES, default="complex")
    parser.add_argument("--out")
    parser.add_argument("--table", nargs="+", help="print the markdown rows of these results")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if not args.contender or not args.out:
        parser.error("--contender and --out are needed (or --table)")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = measure(args.contender, args.steps, args.rope)
    except Exception as exc:  # recorded in the row, and the job fails
        result = {"contender": args.contender, "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    ok = "error" not in result
    if ok:
        dist.barrier()
        dist.destroy_process_group()
    else:
        print(result["trace"], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
