"""Muon on partitioned master shards, with exactly ``torch.optim.Muon``'s update.

Muon's step for a matrix ``W`` with gradient ``G`` and momentum buffer ``B``:

1. ``B = lerp(B, G, 1 - momentum)``; ``U = lerp(G, B, momentum)`` (nesterov) or ``U = B``
   - element-wise, so it runs on this rank's shard of ``G`` and ``B``;
2. ``O = newton_schulz(U)`` - needs the whole matrix: the shards of ``U`` are all-gathered
   (one collective for all of a step's matrices, through :mod:`zerostate.dist.collectives`) and
   every rank computes the same ``O`` with torch's own iteration;
3. ``W = W * (1 - lr * weight_decay) - adjusted_lr * O`` - element-wise again, applied to
   the rank's own slice of ``O``.

The momentum buffer stays partitioned like the parameter (1/N per rank); the gathered
update is a transient of one matrix's size. At stage 0 every shard is the whole tensor
and the gather is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from zerostate.errors import ConfigError
from zerostate.runtime.sharded import ShardedParam


class PartitionedMuon(Optimizer):
    """``torch.optim.Muon`` over master shards; ``members`` are the ShardedParams whose
    ``master`` tensors make up the groups, ``gather(sps, shards)`` returns their full flat
    tensors (collective: every rank calls it with the same parameters)."""

    def __init__(
        self,
        groups: list[dict],
        defaults: dict,
        *,
        members: list[ShardedParam],
        gather: Callable[[list[ShardedParam], list[torch.Tensor]], list[torch.Tensor]],
    ) -> None:
        self._members = {id(sp.master): sp for sp in members}
        for sp in members:
            if len(sp.shape) != 2:
                raise ConfigError(
                    f"Muon only updates 2-D parameters; {sp.name} has shape {sp.shape}. Put "
                    "it in another optimizer (optimizer=[muon, adamw])"
                )
        self._gather = gather
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("the engine's optimizer step takes no closure")
        work = []  # (group, shard, param, update shard)
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                work.append((group, p, self._members[id(p)], update))
        if not work:
            return
        fulls = self._gather([w[2] for w in work], [w[3] for w in work])
        for (group, p, sp, _), full in zip(work, fulls, strict=True):
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr
            ortho = _zeropower_via_newtonschulz(
                full.view(sp.shape), group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size(sp.shape))
            start = _local_start(sp, p)
            p.mul_(1 - lr * group["weight_decay"])
            # With offload the shard is on the host and the gathered matrix on the device.
            local = ortho.reshape(-1)[start : start + p.numel()].to(p.device)
            p.add_(local, alpha=-adjusted_lr)


def _local_start(sp: ShardedParam, shard: torch.Tensor) -> int:
    # The master covers the whole tensor at stage 0 and the owned range otherwise.
    return 0 if shard.numel() == sp.numel else sp.start
