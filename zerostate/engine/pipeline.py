"""The gradient side of the engine's step: the step's gradient shards in fp32, their
global norm with the per-parameter "some rank saw a gradient" flags in one all-reduce, and
clipping by that norm. ``Engine.step`` sequences these with the optimizer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zerostate.dist.comm import CommContext
from zerostate.optim import sum_of_squares
from zerostate.runtime import tp
from zerostate.runtime.offload import HostTier
from zerostate.runtime.runtime import GroupRuntime
from zerostate.runtime.sharded import ShardedParam
from zerostate.runtime.tp import TensorParallel

log = logging.getLogger(__name__)


def step_grads(
    runtime: GroupRuntime, host: HostTier | None, ctx: CommContext
) -> list[torch.Tensor]:
    """The step's gradient shards in fp32, before scaling: on the device, or with offload
    on the host ([Note: offload] in zerostate.runtime.offload)."""
    if host is None:
        return [g if g.dtype == torch.float32 else g.float() for g in runtime.step_grads()]
    # As the device path has them: fp16 sums multiplied back ([Note: reduce precision]).
    for group, positions in runtime.reduced_groups():
        if not host.copied(group.index):  # its reduce hook did not run
            host.copy_group(group.index, positions, group.reduced_grads())
    grads = host.wait_grads()
    if ctx.predivide != 1.0:
        torch._foreach_mul_(grads, ctx.predivide)
    return grads


def norm_and_flags(
    grads: list[torch.Tensor],
    got_grad: list[bool],
    runtime: GroupRuntime,
    trainable: list[ShardedParam],
    tensor_parallel: TensorParallel | None,
    device: torch.device,
) -> tuple[torch.Tensor, list[bool]]:
    """``(global gradient norm, which parameters to step)``, the same on every rank.

    One all-reduce gives the global squared norm and, per parameter, how many ranks saw a
    gradient (a parameter no rank saw is not stepped, as torch skips it; see [Note: uniform
    stepping] in zerostate.optim). The norm lies where the gradients do (offload: the
    host), for clipping."""
    if tensor_parallel is not None:  # tp-sharded squares over tp, tp-replicated ones once
        squares = tp.sum_of_squares(grads, trainable, tensor_parallel, sum_of_squares)
    else:
        squares = sum_of_squares(grads)
    flags = torch.tensor(got_grad, dtype=torch.float32, device=squares.device)
    folded = torch.cat([squares, flags]).to(device)
    runtime.reduce_norm_and_flags(folded)
    if tensor_parallel is not None:
        tp.all_reduce(folded, tensor_parallel)
    folded = folded.to(squares.device)  # offload: the grads to clip are on the host
    return folded[:1].sqrt(), (folded[1:] > 0).tolist()


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).reshape(())
    torch._foreach_mul_(grads, coef)


def end_window(runtime: GroupRuntime, flags: list[bool], window: int, engine: Any) -> list[bool]:
    """Drop the gradients of an unfinished accumulation window (``window`` micro-batches)
    after a load and say so on rank 0; the fresh "got a gradient" flags.

    [Note: a load ends the accumulation window]
    A load resets the micro-step count (the step's weights start a new window) and used to
    leave the gradients accumulated before it in the buffers: the next window's update then
    added gradients computed with the weights the load replaced (found with
    ``grad_accum_steps=2``: one backward, a load, two more, and the step differed from the
    same two on a freshly loaded engine, at every stage). They are dropped now, as
    ``step()`` drops them at a window's end. A load or a save inside a window is rarely
    meant, so rank 0 says what happened (:func:`warn_inside_window`)."""
    runtime.zero()
    warn_inside_window("load()", window, engine)
    return [False] * len(flags)


def warn_inside_window(call: str, window: int, engine: Any) -> None:
    """Rank 0's warning for a save or a load inside an accumulation window (else nothing)."""
    if not window or engine.rank != 0:
        return
    if call == "load()":
        what = "were dropped; the next backward() starts a new window"
    else:
        what = (
            f"are not in the step (it holds the state after optimizer step "
            f"{engine.optimizer_steps}): a run resumed from it starts a new window"
        )
    log.warning(
        "zerostate: %s inside a gradient accumulation window: the gradients of its %d "
        "micro-batch(es) of %d %s",
        call,
        window,
        engine.config.grad_accum_steps,
        what,
    )
