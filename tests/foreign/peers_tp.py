"""Tensor-parallel checkpoints written by the peers themselves on gloo ranks: DeepSpeed
AutoTP (``"tensor_parallel": {"autotp_size": T}``, ZeRO 1-2) training a small Hugging Face
Llama, and Megatron-Core's ``dist_checkpointing`` (``torch_dist``) saving a sharded state
dict; with the full tensors the peer held, gathered by the writer itself, and for DeepSpeed
the weights after each of the steps it takes after the save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.foreign.peers import import_deepspeed

LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
TRAIN_STEPS, NEXT_STEPS = 2, 2
MICRO_BATCH, SEQ, VOCAB = 2, 8, 64


def build_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(dp_rank: int, step: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s token ids at ``step`` (labels are the ids)."""
    g = torch.Generator().manual_seed(7000 + 97 * step + dp_rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)


def global_batch(dp: int, step: int) -> torch.Tensor:
    return torch.cat([batch(r, step) for r in range(dp)])


def _gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights DeepSpeed's module holds: each AutoTP layer's shards all-gathered
    over its tensor-parallel group and joined on the dimension its class splits (output
    features for ``LinearLayer``, input features for ``LinearAllreduce``)."""
    import torch.distributed as dist

    out = {}
    for mod_name, mod in module.named_modules():
        group = getattr(mod, "mp_group", None)
        dim = {"LinearLayer": 0, "LinearAllreduce": 1}.get(type(mod).__name__)
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if dim is None or group is None or p_name != "weight":
                out[name] = p.detach().float().clone()
                continue
            parts = [torch.empty_like(p.data) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, p.data.contiguous(), group=group)
            out[name] = torch.cat(parts, dim).float()
    return out


def write_deepspeed_tp(rank: int, world_size: int, out: str, stage: int, tp: int) -> dict:
    """Train ``TRAIN_STEPS`` fp32 AdamW steps at tensor-parallel degree ``tp`` (data-parallel
    ``world_size // tp``), save to ``out``, then take ``NEXT_STEPS`` more; rank 0 returns the
    gathered weights at the save (``saved``) and after each next step (``after``)."""
    deepspeed = import_deepspeed(rank, world_size)

    dp = world_size // tp
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "torch_adam": True,
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
            },
        },  # fmt: skip
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    model = build_llama()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    # AutoTP groups consecutive ranks: ranks [k * tp, (k + 1) * tp) are data-parallel rank k.
    dp_rank = rank // tp

    def train(step: int) -> None:
        ids = batch(dp_rank, step)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    for step in range(TRAIN_STEPS):
        train(step)
    engine.save_checkpoint(out)
    saved = _gathered(engine.module)
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        train(step)
        after.append(_gathered(engine.module))
    return {"saved": saved, "after": after, "dp": dp} if rank == 0 else {}


def zerostate_continue_tp(rank: int, world_size: int, ckpt: str, dp: int, stage: int) -> dict:
    """``engine.load`` of the AutoTP checkpoint at ``world_size`` ranks (no tensor
    parallelism), then the peer's next steps on the same global batches; rank 0 returns
    the full weights as loaded and after each step."""
    import zerostate

    model = build_llama()
    with torch.no_grad():  # the load must replace every value
        for p in model.parameters():
            p.add_(1.0)
    engine = zerostate.Engine(model, stage=stage, lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)
    engine.load(ckpt)
    loaded = {k: v.detach().float().clone() for k, v in engine.full_state_dict().items()}
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        ids = global_batch(dp, step)
        n = ids.shape[0] // world_size
        mine = ids[rank * n : (rank + 1) * n]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
        after.append({k: v.detach().float().clone() for k, v in engine.full_state_dict().items()})
    return {"loaded": loaded, "after": after} if rank == 0 else {}


def megatron_full() -> dict[str, torch.Tensor]:
    """What the Megatron writer saves: a (8, 6) tensor split on dim 0, a (4, 10) split on
    dim 1 and a replicated (3,)."""
    return {
        "decoder.linear_qkv.weight": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7,
        "decoder.linear_proj.weight": torch.arange(40, dtype=torch.float32).reshape(4, 10) / 3,
        "decoder.norm.weight": torch.linspace(0.5, 1.5, 3),
    }


def write_megatron(rank: int, world_size: int, out: str) -> dict:
    """``megatron.core.dist_checkpointing.save`` of :func:`megatron_full` at tensor-parallel
    degree ``world_size`` (column-, row-parallel and replicated tensors). Megatron's writer
    forks writer processes, which daemonic pool workers may not: :func:`generate_tp` runs
    this module under ``torchrun``."""
    torch.set_num_threads(1)
    # CPU-only torch: Megatron's torch_dist writer synchronises CUDA before writing and
    # puts its failure flag on the current CUDA device; neither has a CPU path.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    full = megatron_full()
    qkv, proj = "decoder.linear_qkv.weight", "decoder.linear_proj.weight"
    norm = "decoder.norm.weight"
    sharded = {
        qkv: ShardedTensor.from_rank_offsets(
            qkv, full[qkv].chunk(world_size, 0)[rank].clone(), (0, rank, world_size)
        ),
        proj: ShardedTensor.from_rank_offsets(
            proj, full[proj].chunk(world_size, 1)[rank].clone(), (1, rank, world_size)
        ),
        norm: ShardedTensor.from_rank_offsets(norm, full[norm].clone(), replica_id=rank),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, out)
    return {}


def generate_tp(kind: str, out: Path, world_size: int, **kw: Any) -> dict:
    from tests.helpers_dist import run_distributed

    if kind == "megatron":
        _torchrun_megatron(out, world_size)
        return {}
    # DeepSpeed changes process-wide state (accelerator, environment): new processes,
    # forked ([Note: forked workers]).
    return run_distributed(
        write_deepspeed_tp, world_size, str(out), **kw, pooled=False, spawn=False, timeout=600
    )[0]


def _torchrun_megatron(out: Path, world_size: int) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
           "--standalone", "-m", "tests.foreign.peers_tp", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"Megatron writer failed ({done.returncode}): {done.stderr[-3000:]}")


if __name__ == "__main__":
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_megatron(dist.get_rank(), dist.get_world_size(), sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
