"""Helpers shared by the store tests (imported by file name; pytest puts this dir on path)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from zerostate.store import TensorSpec, owned_shards, plan_specs, save_tensors

__all__ = [
    "doc_snippet_read_tensor",
    "make_specs",
    "make_tensors",
    "owned_shards",
    "raw_bytes",
    "tensor_sha256",
    "write_step",
]

# Odd sizes on purpose: uneven splits, a tensor smaller than the world size, a scalar, an
# empty tensor, and the optimizer/buffer naming the engine uses.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model/h.0.attn.weight": ((17, 257), torch.float32),
    "model/h.0.attn.bias": ((5,), torch.float32),
    "model/wte": ((1000,), torch.float32),
    "model/ln.weight": ((3, 7), torch.float32),
    "model/tiny": ((2,), torch.float32),
    "optim/exp_avg/h.0.attn.weight": ((17, 257), torch.float32),
    "optim/exp_avg_sq/h.0.attn.weight": ((17, 257), torch.float32),
    "optim/exp_avg/tiny": ((2,), torch.float32),
    "buffers/mask": ((3, 7), torch.bfloat16),
    "buffers/steps": ((), torch.int64),
    "buffers/empty": ((0, 4), torch.float16),
    "rng/rank-00001/cpu": ((13,), torch.uint8),
    "flags": ((9,), torch.bool),
}


def make_tensors(seed: int = 0, shapes=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in (shapes or SHAPES).items():
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randint(0, 200, shape, generator=gen).to(dtype)
        out[name] = t
    return out


def make_specs(tensors: dict[str, torch.Tensor], world_size: int, min_shard_numel: int = 8):
    return plan_specs(tensors, world_size, min_shard_numel)


def write_step(
    root, step, tensors, *, world_size=3, min_shard_numel=8, attrs=None, storage_options=None
) -> list[TensorSpec]:
    """Write a whole step as ``world_size`` ranks in one process (rank 0 commits last)."""
    return save_tensors(
        root,
        step,
        tensors,
        world_size=world_size,
        min_shard_numel=min_shard_numel,
        attrs=attrs,
        storage_options=storage_options,
    )


def tensor_sha256(t: torch.Tensor) -> str:
    flat = t.reshape(-1).contiguous()
    return hashlib.sha256(
        flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    ).hexdigest()


def doc_snippet_read_tensor():
    """``read_tensor`` from docs/format.md's plain-zarr snippet, executed as written, so
    the documentation and the tests cannot drift apart."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    section = doc.split("### Rebuilding a tensor with plain zarr", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/format.md", "exec"), namespace)
    return namespace["read_tensor"]


def raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.reshape(-1).contiguous()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
