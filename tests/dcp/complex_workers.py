"""Rank functions for the complex-tensor DCP tests: a model whose state holds complex
tensors as the users' models do (a persistent RoPE table, as torchtitan's Llama registered
``freqs_cis`` before 0.3; a complex parameter, whose AdamW moments are complex too), sharded
by FSDP2, saved and loaded through torch's checkpoint API with zerostate's storage and with
DCP's own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
#: The complex128 table's global shape: sharded by columns on save, by rows on load.
TABLE = (5, 6)


class Coil(nn.Module):
    """A complex parameter (7 rows: uneven over 2 and 3 ranks). FSDP2 shards each module's
    parameters as one group of one dtype, so it gets a module of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.z = nn.Parameter(torch.polar(torch.rand(7, 3) + 0.5, torch.rand(7, 3) * 6))

    def forward(self, phase: torch.Tensor) -> torch.Tensor:
        return (self.z * phase).abs().mean()


class RopeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.coil = Coil()
        angles = torch.arange(15, dtype=torch.float64).view(5, 3) / 7
        self.register_buffer("freqs_cis", torch.polar(torch.ones(5, 3), angles.float()))
        self.register_buffer("phase", torch.polar(torch.ones(3, dtype=torch.float64), angles[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rot = self.freqs_cis[1] * self.phase.to(torch.complex64)
        return self.a(x).square().mean() + self.coil(rot.expand(7, 3))


def table(version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(40 + version)
    real = torch.randn(*TABLE, 2, dtype=torch.float64, generator=g)
    return torch.view_as_complex(real)


def build(sharded: bool, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = RopeNet()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.coil)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 100 + step))
        model(x).backward()
        opt.step()
        opt.zero_grad()


def _full(x: Any) -> Any:
    """A state as plain CPU values: DTensors gathered, containers walked."""
    if isinstance(x, dict):
        return {k: _full(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_full(v) for v in x]
    if hasattr(x, "full_tensor"):
        return x.full_tensor().detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def _state(model: nn.Module, opt: torch.optim.Optimizer, tab: torch.Tensor) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "table": tab, "epoch": 3}


def _table_dtensor(version: int, dim: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(table(version), mesh, [Shard(dim)])


def save(rank: int, world_size: int, ours: str, theirs: str, async_root: str) -> dict:
    """FSDP2 at ``world_size`` ranks, 2 AdamW steps; the state (and a complex128 table
    sharded by columns) saved with ``dcp.save`` through our writer and DCP's, and with
    ``dcp.async_save`` through ours (the state changed as soon as it returns); the saved
    state, gathered."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = build(True, 0)
    train(model, opt, 2, 0)
    state = _state(model, opt, _table_dtensor(0, 1))
    saved = _full(state)
    dcp.save(state, storage_writer=StorageWriter(ours))
    dcp.save(state, checkpoint_id=theirs)
    future = dcp.async_save(state, storage_writer=StorageWriter(async_root))
    with torch.no_grad():  # the caller may change the state once async_save returns
        for p in model.parameters():
            p.zero_()
        state["table"].to_local().zero_()
    future.result()
    return saved


def load(rank: int, world_size: int, root: str, theirs: bool) -> dict:
    """A fresh FSDP2 model at ``world_size`` ranks (another seed, one step so that its
    optimizer has state to fill), the table sharded by rows; loaded through our reader
    (``theirs``: DCP's ``FileSystemReader``); the loaded state, gathered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from zerostate.dcp import StorageReader

    torch.set_num_threads(1)
    model, opt = build(True, 7)
    train(model, opt, 1, 7)
    state = _state(model, opt, _table_dtensor(1, 0))
    state["epoch"] = 0
    reader = dcp.FileSystemReader(root) if theirs else StorageReader(root)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(state)


def session_save(rank: int, world_size: int, root: str) -> dict:
    """``zerostate.save`` of a replicated (DDP-style) model, its AdamW and a complex table
    at ``world_size`` ranks; the saved state as ``zerostate.load`` fills it."""
    import zerostate

    torch.set_num_threads(1)
    model, opt = build(False, 3)
    train(model, opt, 2, 3)
    zerostate.save({"model": model, "optim": opt, "table": table(2)}, root, step=5)
    return {"model": _full(model.state_dict()), "optim": _full(opt.state_dict()["state"])}
