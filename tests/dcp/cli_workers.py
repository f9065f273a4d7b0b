"""Rank functions for the CLI and ``engine.load`` tests of steps written through
``zerostate.dcp``: an FSDP2 run (``tests.dcp.workers``' model and optimizer) saved through
our ``StorageWriter`` and continued for a few steps on batches any world size can split, and
a ``zerostate.Engine`` continuing it from the step."""

from __future__ import annotations

from typing import Any

import torch

from tests.dcp import workers

NEXT_STEPS = 2
GLOBAL_ROWS = 8


def global_batch(step: int) -> torch.Tensor:
    """The batch of step ``step`` of the whole job; each of N ranks takes 1/N of its rows."""
    return torch.randn(GLOBAL_ROWS, 8, generator=torch.Generator().manual_seed(900 + step))


def _mine(step: int, rank: int, world_size: int) -> torch.Tensor:
    per = GLOBAL_ROWS // world_size
    return global_batch(step)[rank * per : (rank + 1) * per]


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole state ``get_state_dict`` gathers: ``model/<fqn>``, ``optim/<key>/<fqn>``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    out: dict[str, Any] = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, states in optim_sd["state"].items():
        for key, value in states.items():
            out[f"optim/{key}/{fqn}"] = value.detach().clone()
    return out


def save_fsdp2_and_continue(rank: int, world_size: int, root: str) -> dict:
    """FSDP2 (Shard(0), uneven) with AdamW: train, save ``get_state_dict``'s state through
    ``zerostate.dcp.StorageWriter``, then take ``NEXT_STEPS`` more steps. Rank 0 returns
    the full state as saved and the full weights after each later step."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = workers.build("shard0")
    workers.train(model, opt, rank, workers.TRAIN_STEPS)
    writer = StorageWriter(root)
    dcp.save(workers.state_of(model, opt), storage_writer=writer)
    saved = full_state(model, opt)
    after = []
    for step in range(workers.TRAIN_STEPS, workers.TRAIN_STEPS + NEXT_STEPS):
        model(_mine(step, rank, world_size)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after.append({k.removeprefix("model/"): v for k, v in full_state(model, opt).items()
                      if k.startswith("model/")})  # fmt: skip
    return {"step": writer.step, "saved": saved, "after": after} if rank == 0 else {}


def engine_continue(rank: int, world_size: int, root: str, stage: int) -> dict:
    """``zerostate.Engine.load`` of the FSDP2 step at ``world_size`` ranks, then the FSDP2
    run's next steps on the same global batches; rank 0 returns the full weights after each
    and the optimizer step count."""
    import zerostate

    torch.set_num_threads(1)
    torch.manual_seed(5)
    model = workers.Net()  # other values: the load must replace every one
    engine = zerostate.Engine(model, stage=stage, **workers.ADAMW)
    engine.load(root)
    after = []
    for step in range(workers.TRAIN_STEPS, workers.TRAIN_STEPS + NEXT_STEPS):
        engine.backward(engine(_mine(step, rank, world_size)).square().mean())
        engine.step()
        after.append({k: v.detach().clone() for k, v in engine.full_state_dict().items()})
    return {"after": after, "steps": engine.optimizer_steps} if rank == 0 else {}
