"""DCP checkpoints in safetensors item format, written by torch's own writers on gloo
ranks: ``FileSystemWriter(serialization_format=SAFETENSORS)`` (``.metadata`` plus
``__<rank>_0.distcp`` files whose tensor items are one safetensors blob per file) and
``HuggingFaceStorageWriter`` (``*.safetensors`` files, the sharding in each header's
``DCP_SHARDING_INFO``), from an FSDP2 model and from a bare model state dict."""

from __future__ import annotations

import torch

from tests.foreign import peers


def _fsdp2_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = peers.build_model()
    for module in (model.body, model.out):
        fully_shard(module)
    fully_shard(model)
    return model


def write(rank: int, world_size: int, out: str, writer: str, what: str) -> dict:
    """Train ``peers.TRAIN_STEPS`` AdamW steps, save with ``writer`` ("distcp" or "hf"):
    ``what`` is "fsdp2" (``{"model": ..., "optimizer": ...}`` with the distcp writer, the
    model's sharded state dict with the hf one) or "bare" (a plain model state dict).
    Rank 0 returns the full tensors that were saved and, for the distcp FSDP2 case (the one
    that holds the optimizer), the weights after each of ``peers.NEXT_STEPS`` more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp2_model() if what == "fsdp2" else peers.build_model()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=peers.LR, betas=peers.BETAS, eps=peers.EPS, weight_decay=peers.WEIGHT_DECAY,
    )  # fmt: skip
    for step in range(peers.TRAIN_STEPS):
        loss = model(
            *(peers.global_batch(world_size, step) if what == "bare" else peers.batch(rank, step))
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    # safetensors refuses shared storage: the tied head is saved once, as emb.weight.
    model_sd = {k: v for k, v in model_sd.items() if k != "head.weight"}
    if writer == "distcp":
        storage = dcp.FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS)
        state = {"model": model_sd, "optimizer": optim_sd} if what == "fsdp2" else model_sd
    else:
        storage = dcp.HuggingFaceStorageWriter(out, save_distributed=what == "fsdp2")
        state = model_sd
    dcp.save(state, storage_writer=storage)
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model_sd.items()
    }
    after = []
    if what == "fsdp2" and writer == "distcp":
        # FSDP2 continues itself, uninterrupted: what zerostate must reproduce from the
        # checkpoint (torch's DCP reader does not read safetensors items, so this run is
        # the peer's own continuation).
        for step in range(peers.TRAIN_STEPS, peers.TRAIN_STEPS + peers.NEXT_STEPS):
            model(*peers.batch(rank, step)).backward()
            opt.step()
            opt.zero_grad()
            after.append(
                {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
            )
    return {"model": full, "after": after} if rank == 0 else {}


def generate(out, world_size: int, writer: str, what: str) -> dict:
    from tests.helpers_dist import run_distributed

    return run_distributed(write, world_size, str(out), writer, what, timeout=600)[0]


#: (name, writer, what, world size)
CASES = [
    ("distcp-fsdp2-2", "distcp", "fsdp2", 2),
    ("distcp-bare-1", "distcp", "bare", 1),
    ("hf-fsdp2-2", "hf", "fsdp2", 2),
    ("hf-bare-1", "hf", "bare", 1),
]


class SafetensorsCheckpoints:
    """Writes each case on first use; keeps the tensors its writer was given."""

    def __init__(self, root) -> None:
        self.root = root
        self._made: dict[str, tuple] = {}

    def get(self, name: str) -> tuple:
        """``(path, {"model": full tensors saved, "after": [weights after each next
        step]}, world size)``."""
        _, writer, what, world = next(c for c in CASES if c[0] == name)
        if name not in self._made:
            out = self.root / name
            self._made[name] = (out, generate(out, world, writer, what), world)
        return self._made[name]


def zerostate_load(rank: int, world_size: int, ckpt: str, stage: int) -> dict:
    """``engine.load(ckpt)`` into a model whose values all differ; rank 0 returns the
    full weights and the optimizer step count."""
    import zerostate

    model = peers.build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    engine = zerostate.Engine(model, stage=stage, lr=0.5)
    engine.load(ckpt)
    full = {k: v.detach().float().clone() for k, v in engine.full_state_dict().items()}
    return {"model": full, "steps": engine.optimizer_steps} if rank == 0 else {}
