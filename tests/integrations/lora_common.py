"""A tiny Llama with peft LoRA adapters on q/v, its data, and a training loop through the
engine that saves every step (shared by the LoRA store tests and examples/lora.py's test)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerostate

VOCAB, SEQ, BATCH = 96, 16, 8


def make_base(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def make_lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    base = make_base(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    with torch.no_grad():  # B starts at zero; a non-zero start makes step 1 move A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def data(step: int, rank: int, world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per = BATCH // world_size
    return ids[rank * per : (rank + 1) * per]


def train(engine, rank: int, world_size: int, steps, *, root: str | None = None):
    """Train ``steps`` (a range of step numbers); save to ``root`` after each if given.
    Returns the global mean loss of each step."""
    losses = []
    for step in steps:
        ids = data(step, rank, world_size)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        if root is not None:
            engine.save(root)
    return losses


def trainable_state_nbytes(model) -> int:
    """fp32 weights + AdamW's two fp32 moments of the trainable parameters."""
    return sum(3 * 4 * p.numel() for p in model.parameters() if p.requires_grad)


def make_engine(model, **kwargs):
    return zerostate.Engine(model, **{"stage": 2, "lr": 1e-2, **kwargs})
