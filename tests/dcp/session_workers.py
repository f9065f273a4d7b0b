"""Workers of tests/dcp/test_api_session.py (module level: the pool pickles them by name)."""

from __future__ import annotations

from typing import Any

import torch

from tests.dcp.workers import ddp_parts, ddp_state
from tests.dcp.workers import ddp_trained as _trained


def async_save(rank: int, world_size: int, root: str) -> dict:
    """``zerostate.save(blocking=False)``: the handle, then the state changed at once (the
    step keeps the values as of the call), then ``wait()``."""
    import zerostate
    from zerostate.checkpoint import SaveHandle
    from zerostate.store import open_checkpoint

    torch.set_num_threads(1)
    model, ddp, opt, sched = _trained(rank)
    saved = ddp_state(model, opt, sched)
    handle = zerostate.save({"model": ddp, "optim": opt, "sched": sched}, root, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next training step, while the save may still be writing
    out = {"is_handle": isinstance(handle, SaveHandle), "step": handle.step}
    out["blocked_s"] = handle.blocked_s
    handle.wait()
    out["done"] = handle.done()
    with open_checkpoint(root).step() as st:
        out["committed"] = st.step
    return {**out, **saved}


def one_rank_fails_planning(rank: int, world_size: int, root: str) -> dict:
    """Rank 1's state holds a value a checkpoint cannot store without pickle: every rank
    raises, nobody hangs, nothing is committed."""
    import zerostate

    torch.set_num_threads(1)
    model, ddp, opt, sched = _trained(rank)
    state: dict[str, Any] = {"model": ddp, "optim": opt, "sched": sched}
    if rank == 1:
        state["extra"] = {"handle": object()}
    else:
        state["extra"] = {"handle": 3}
    try:
        zerostate.save(state, root)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def save_at_step(rank: int, world_size: int, root: str, step: int, allow: bool) -> dict:
    """``zerostate.save`` of ``step``; what it returned or raised."""
    import zerostate

    torch.set_num_threads(1)
    _, ddp, opt, sched = _trained(rank)
    try:
        got = zerostate.save(
            {"model": ddp, "optim": opt, "sched": sched}, root, step, allow_older_step=allow
        )
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "step": got}


def load_then_save_older(rank: int, world_size: int, root: str, step: int) -> dict:
    """A run that resumed from ``root`` (``zerostate.load``) may save an older step there."""
    import zerostate

    torch.set_num_threads(1)
    _, ddp, opt, sched = _trained(rank)
    state = {"model": ddp, "optim": opt, "sched": sched}
    loaded = zerostate.load(state, root)
    return {"loaded": loaded, "saved": zerostate.save(state, root, step)}


def memory_tier_saves(rank: int, world_size: int, tmp: str, root: str) -> dict:
    """Two memory-tier saves, each rank its own node; the second is copied to ``root``."""
    import os

    import zerostate
    from zerostate.store import open_checkpoint

    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["ZEROSTATE_MEMORY_DIR"] = os.path.join(tmp, f"shm-node{rank}")
    try:
        model, ddp, opt, sched = _trained(rank)
        state = {"model": ddp, "optim": opt, "sched": sched}
        out: dict[str, Any] = {"steps": []}
        for _ in range(2):
            # Blocking: committed in memory, and (second save) copied to the root.
            out["steps"].append(zerostate.save(state, root, tier="memory", memory_durable_every=2))
            if len(out["steps"]) == 1:
                out["durable_after_first"] = os.path.exists(root) and open_checkpoint(root).steps()
        out["saved"] = ddp_state(model, opt, sched)
        return out
    finally:
        for name in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "ZEROSTATE_MEMORY_DIR"):
            os.environ.pop(name, None)


def memory_tier_loads(rank: int, world_size: int, tmp: str, root: str) -> dict:
    """A durable save, then two non-blocking memory-tier saves (no durable copy); fresh
    states load: from memory, from the replicas once node 1's memory is gone, and from the
    durable root once both nodes' memory is gone. Each load's one line from rank 0."""
    import logging
    import os
    import shutil

    import torch.distributed as dist

    import zerostate

    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    memory = os.path.join(tmp, f"shm-node{rank}")
    os.environ["ZEROSTATE_MEMORY_DIR"] = memory
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines(level=logging.INFO)
    logger = logging.getLogger("zerostate.checkpoint.tier_load")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model, ddp, opt, sched = _trained(rank)
        state = {"model": ddp, "optim": opt, "sched": sched}
        out: dict[str, Any] = {"saved0": zerostate.save(state, root)}
        out["saved0_state"] = ddp_state(model, opt, sched)
        steps = []
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # a new state each save
            saved = ddp_state(model, opt, sched)
            handle = zerostate.save(
                state, root, tier="memory", blocking=False, memory_durable_every=None
            )
            steps.append(handle.step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # training goes on while the save is in flight
            handle.wait()
        out["memory_steps"], out["memory_state"] = steps, saved

        def load(tag: str) -> None:
            fresh, fopt, fsched = ddp_parts(1, 0.5)
            fddp = torch.nn.parallel.DistributedDataParallel(fresh)
            lines.clear()
            out[tag] = zerostate.load({"model": fddp, "optim": fopt, "sched": fsched}, root)
            out[f"{tag}_state"] = ddp_state(fresh, fopt, fsched)
            out[f"{tag}_line"] = " | ".join(lines)

        load("own")
        dist.barrier()
        if rank == 1:  # node 1 replaced: its memory is gone
            shutil.rmtree(memory)
        dist.barrier()
        load("replicas")
        dist.barrier()
        shutil.rmtree(memory)  # both nodes' memory gone
        dist.barrier()
        load("fallback")
        return out
    finally:
        logger.removeHandler(handler)
        for name in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "ZEROSTATE_MEMORY_DIR"):
            os.environ.pop(name, None)


def fsdp2_api_save(rank: int, world_size: int, root: str) -> dict:
    """An FSDP2 model (uneven ``Shard(0)``) and its AdamW through ``zerostate.save``,
    non-blocking, the next step taken while the save is in flight; the full state as of
    the call (rank 0)."""
    import zerostate
    from tests.dcp.workers import TRAIN_STEPS, _full, build, train

    torch.set_num_threads(1)
    model, opt = build("shard0")
    train(model, opt, rank, TRAIN_STEPS)
    full = _full(model, opt)
    handle = zerostate.save({"model": model, "optim": opt}, root, blocking=False)
    train(model, opt, rank + 3, 1)  # changes every parameter and moment
    handle.wait()
    return {"step": handle.step, "full": full if rank == 0 else {}}


def fsdp2_api_load(rank: int, world_size: int, root: str, layout: str) -> dict:
    """A fresh model of ``layout`` with other values, ``zerostate.load``; the full state."""
    import zerostate
    from tests.dcp.workers import _full, build, train

    torch.set_num_threads(1)
    model, opt = build(layout)
    train(model, opt, rank + 7, 1)  # other values everywhere: the load must replace them
    step = zerostate.load({"model": model, "optim": opt}, root)
    full = _full(model, opt)
    return {"step": step, "full": full if rank == 0 else {}}
