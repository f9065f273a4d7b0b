"""LoRA fine-tuning with zerostate: the frozen base is stored once, adapters every step.

    torchrun --nproc_per_node=2 examples/lora.py --workdir runs/lora --steps 8

What happens, under ``--workdir``:

1. Every rank builds the same small Llama (``LlamaConfig``, seeded: no download) and wraps
   it with peft LoRA adapters on the attention's q and v projections; only the adapters
   train (the base is frozen, ``requires_grad=False``).
2. A stage-2 engine trains it and saves into ``ckpt/`` after every step. The first step
   writes the whole model; every later step writes the adapters and their AdamW moments
   and *refers* to the frozen base of the first step (checked per rank by content: a base
   tensor that changed would be written again). ``keep_last`` retention keeps the step
   that holds the base as long as a kept step refers to it.
3. ``adapter/``: the last step exported with ``export_trainable`` (the CLI's
   ``zerostate consolidate ckpt/ adapter/ --trainable-only``), a directory
   ``PeftModel.from_pretrained(base, "adapter/")`` loads; ``model.safetensors`` is the
   whole consolidated model. Rank 0 prints the bytes each step took on storage.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import zerostate
from zerostate.store import open_checkpoint
from zerostate.store.adapter import export_trainable
from zerostate.store.consolidate import consolidate

VOCAB, SEQ, BATCH = 128, 32, 8


def make_base(seed: int = 0):
    """The base model (random weights from a seed; point this at from_pretrained instead)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def make_lora(base):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, config)


def batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """Step ``step``'s global batch depends on the step alone; each rank takes its share."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[:, 1::2] = ids[:, ::2]  # something learnable: every odd token repeats the last one
    per = BATCH // world_size
    return ids[rank * per : (rank + 1) * per]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("runs/lora"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--log-json", type=Path, default=None, help="one JSON line per step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_lora(make_base())
    ckpt = str(args.workdir / "ckpt")
    engine = zerostate.Engine(model, stage=args.stage, lr=2e-3)
    log = open(args.log_json, "a") if args.log_json and rank == 0 else None
    for step in range(args.steps):
        ids = batch(step, rank, world_size)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.save(ckpt, keep_last=args.keep_last)
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        if rank == 0:
            st = open_checkpoint(ckpt).step()
            row_bytes = sum(n for _, _, n in st.row_objects())
            record = {"step": st.step, "loss": mean.item() / world_size,
                      "row_bytes": row_bytes, "refs": len(st.refs)}  # fmt: skip
            print(json.dumps(record), flush=True)
            if log is not None:
                log.write(json.dumps(record) + "\n")
    if rank == 0:
        out = args.workdir / "adapter"
        export_trainable(ckpt, out, force=True)
        consolidate(ckpt, args.workdir / "model.safetensors", force=True)
        print(f"adapter written to {out} ({sorted(os.listdir(out))})", flush=True)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
