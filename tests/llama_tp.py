"""The transformers Llama the tensor-parallel tests train, and torch's tensor-parallel plan for
it (q/k/v/gate/up colwise, o/down rowwise, as torchtitan's Llama plan has for the blocks)."""

from __future__ import annotations

import torch

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")
COLWISE += ("mlp.up_proj",)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def llama(*, vocab: int, hidden: int, inter: int, heads: int, kv: int, layers: int = 2, **extra):
    """A Llama from a config (no hub), seeded, eager attention; ``extra`` config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32, **extra,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def parallelize(model, tp_mesh):
    """torch's ``parallelize_module`` of every block over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(len(model.model.layers)):
        plan.update({f"model.layers.{i}.{n}": ColwiseParallel() for n in COLWISE})
        plan.update({f"model.layers.{i}.{n}": RowwiseParallel() for n in ROWWISE})
    return parallelize_module(model, tp_mesh, plan)


def shard_2d(model, mesh):
    """torchtitan's 2-D layout on a ``("dp", "tp")`` mesh: :func:`parallelize` over ``tp``,
    then ``fully_shard`` per block and on the whole model over ``dp``."""
    from torch.distributed.fsdp import fully_shard

    parallelize(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
