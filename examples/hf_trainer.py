"""Train a Hugging Face causal LM with ``transformers.Trainer`` semantics through zerostate.

    torchrun --nproc_per_node=2 examples/hf_trainer.py --workdir runs/hf --stage 2
    torchrun --nproc_per_node=1 examples/hf_trainer.py --workdir runs/hf --stage 2 \\
        --resume runs/hf/out/checkpoint-2       # continue on one rank
    torchrun --nproc_per_node=2 examples/hf_trainer.py --workdir runs/ref --trainer stock

The only zerostate line is the trainer class: ``ZeroStateTrainer(..., stage=2)`` takes the
same arguments as ``transformers.Trainer``. A small Llama is built from a ``LlamaConfig``
(seeded, no download) and trained on synthetic token sequences with AdamW, a linear
warm-up then cosine decay, and gradient accumulation. Checkpoints land every
``--save-steps`` in ``out/checkpoint-<step>/`` (a zerostate store root; with
``--trainer stock``, the Trainer's own files); ``--resume`` continues from one at any
world size (the global batch stays ``--global-batch``). After training, ``save_model``
writes ``final/``, which ``LlamaForCausalLM.from_pretrained`` loads. Rank 0 writes the
logged loss of every step to ``--log-json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from zerostate.integrations.transformers import ZeroStateTrainer

VOCAB, SEQ = 128, 16


def make_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class Sequences(torch.utils.data.Dataset):
    """Token sequences with structure to learn: every odd token repeats the one before."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.ids[:, 1::2] = self.ids[:, ::2]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trainer", choices=["zerostate", "stock"], default="zerostate")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("runs/hf"))
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--log-json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=str(args.workdir / "out"),
        per_device_train_batch_size=args.global_batch // world_size,
        gradient_accumulation_steps=args.accumulate, learning_rate=2e-3, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=2, max_steps=args.max_steps,
        logging_steps=1, save_strategy="steps", save_steps=args.save_steps, report_to=[],
        seed=0, use_cpu=True, disable_tqdm=True, dataloader_drop_last=True, max_grad_norm=1.0,
    )  # fmt: skip
    kwargs = {"stage": args.stage} if args.trainer == "zerostate" else {}
    cls = ZeroStateTrainer if args.trainer == "zerostate" else Trainer
    trainer = cls(model=make_model(), args=training, train_dataset=Sequences(), **kwargs)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(str(args.workdir / "final"))
    if trainer.is_world_process_zero() and args.log_json is not None:
        with open(args.log_json, "w") as f:
            for entry in trainer.state.log_history:
                if "loss" in entry:
                    f.write(json.dumps({"step": entry["step"], "loss": entry["loss"]}) + "\n")
    if dist.is_initialized():  # a clean exit: no process-group threads left at shutdown
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
