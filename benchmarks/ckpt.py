"""Checkpoint workers (inside torchrun): save, async save and load of the SAME training
state by zerostate, DeepSpeed and FSDP2 + torch.distributed.checkpoint (DCP).

Every contender trains one AdamW step from the same weights on the same data, so each
checkpoint holds fp32 weights and both Adam moments of the same model. After a load, the
loss on a fixed evaluation batch must equal the one measured before the save.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import drop_caches_in_job
from benchmarks.contenders import (
    Ctx,
    Trainer,
    batches,
    build_model,
    fully_shard_model,
    make_deepspeed,
    make_zerostate,
)

STAGE = 3  # every contender partitions parameters, gradients and optimizer states
DS_TAG = "global_step1"


def _trainer(params: dict, ctx: Ctx, *, load_universal: bool = False) -> Trainer:
    from benchmarks.contenders import adamw, torch_trainer

    model = build_model(params["model"], ctx.device)
    who = params["contender"]
    if who == "zs":
        return make_zerostate(model, STAGE)
    if who == "ds":
        extra = {"checkpoint": {"load_universal": True}} if load_universal else None
        return make_deepspeed(model, params.get("ds_stage", STAGE), ctx,
                              micro_batch=params["micro_batch"], extra=extra)
    if who == "dcp":
        fully_shard_model(model)
        return torch_trainer(model, model, adamw(model.parameters()), None, ctx)
    raise ValueError(f"unknown checkpoint contender {who!r}")


def _train_batches(params: dict, ctx: Ctx) -> torch.Tensor:
    return batches(params["model"], ctx.rank, params["micro_batch"], params["seq_len"], 2,
                   ctx.device)


@torch.no_grad()
def _eval_loss(trainer: Trainer, params: dict, ctx: Ctx) -> float:
    """Loss of the same batch on every rank: equal before a save and after any load."""
    batch = batches(params["model"], 10_000, params["micro_batch"], params["seq_len"], 1,
                    ctx.device)[0]
    return float(trainer.obj(batch[:, :-1], batch[:, 1:]))


def _dcp_state(trainer: Trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
    dist.barrier()


def _timed(fn: Any, ctx: Ctx) -> float:
    """Seconds from a common start to the moment the slowest rank is done."""
    _sync(ctx)
    t0 = time.perf_counter()
    fn()
    _sync(ctx)
    return time.perf_counter() - t0


def _save_fn(trainer: Trainer, who: str, path: Path) -> Any:
    if who == "zs":
        return lambda: trainer.obj.save(str(path), step=1)
    if who == "ds":
        return lambda: trainer.obj.save_checkpoint(str(path), tag=DS_TAG)
    import torch.distributed.checkpoint as dcp

    return lambda: dcp.save(_dcp_state(trainer), checkpoint_id=str(path))


def save(params: dict, ctx: Ctx) -> dict:
    """Train one step; a warm-up save, then a timed blocking save into ``<dir>/<who>``;
    for zs and dcp also an async save: time blocked in the call plus the next step's
    slow-down over a plain step."""
    import shutil

    who, root = params["contender"], Path(params["dir"])
    trainer = _trainer(params, ctx)
    tokens = _train_batches(params, ctx)

    def step(i: int) -> float:
        b = tokens[i % 2]
        _sync(ctx)
        t0 = time.perf_counter()
        trainer.step(b[:, :-1], b[:, 1:])
        if ctx.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step(0)
    out: dict[str, Any] = {"eval_loss": _eval_loss(trainer, params, ctx)}
    warm = root / f"{who}-warmup"
    # First writes into untouched page-cache memory are slow for every writer alike.
    _timed(_save_fn(trainer, who, warm), ctx)
    if ctx.rank == 0:
        shutil.rmtree(warm, ignore_errors=True)
    out["sync_s"] = _timed(_save_fn(trainer, who, root / who), ctx)
    if who == "ds" or not params.get("async", True):
        return out

    # One step's time moves by tens of percent here from one step to the next, so the
    # async figures are the medians of a few saves, each against its own plain steps.
    group = None
    if who != "zs":
        # DCP's documented recipe: a separate gloo group for the background collectives,
        # so they never interleave with training's.
        group = dist.new_group(backend="gloo")
    runs: dict[str, list[float]] = {"call": [], "stall": [], "total": [], "plain": []}
    for r in range(int(params.get("async_rounds", 1))):
        plain = statistics.median(step(i) for i in range(1, 4))
        path = root / f"{who}-async-{r}"
        _sync(ctx)
        t0 = time.perf_counter()
        if who == "zs":
            handle = trainer.obj.save(str(path), step=1, blocking=False)
            finish = handle.wait
        else:
            import torch.distributed.checkpoint as dcp

            future = dcp.async_save(_dcp_state(trainer), checkpoint_id=str(path),
                                    process_group=group)
            finish = future.result
        runs["call"].append(time.perf_counter() - t0)
        next_step = step(1)
        runs["stall"].append(max(0.0, next_step - plain))
        finish()
        _sync(ctx)
        runs["total"].append(time.perf_counter() - t0)
        runs["plain"].append(plain)
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    for key, name in (("call", "async_call_s"), ("stall", "async_stall_s"),
                      ("total", "async_total_s"), ("plain", "plain_step_s")):
        out[name] = statistics.median(runs[key])
    out["async_rounds"] = runs
    return out


def load(params: dict, ctx: Ctx) -> dict:
    """Load ``<dir>/<who>`` (written at another world size) into a fresh contender."""
    who, root = params["contender"], Path(params["dir"])
    universal = bool(params.get("universal"))
    trainer = _trainer(params, ctx, load_universal=universal)
    if who == "zs":
        fn = lambda: trainer.obj.load(str(root / who))
    elif who == "ds":
        tag = DS_TAG + "_universal" if universal else DS_TAG
        fn = lambda: trainer.obj.load_checkpoint(str(root / who), tag=tag)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        def fn() -> None:
            state = _dcp_state(trainer)  # allocates this rank's shards of every entry
            dcp.load(state, checkpoint_id=str(root / who))
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
    drop_caches_in_job()  # [Note: cold reads] in benchmarks.common
    seconds = _timed(fn, ctx)
    return {"load_s": seconds, "eval_loss": _eval_loss(trainer, params, ctx),
            "rss_mb": _rss_mb()}


def _rss_mb() -> float:
    from benchmarks.common import MIB, peak_rss_bytes

    return peak_rss_bytes() / MIB

