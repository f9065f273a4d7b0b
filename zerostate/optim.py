"""AdamW over the fp32 shards a rank owns.

AdamW is element-wise, so running it on any partition of the elements gives, element for
element, what ``torch.optim.AdamW`` gives on the whole tensor; the ops below follow its
multi-tensor (``foreach=True``) implementation line by line so the numbers match.

Phases of :meth:`PartitionedAdamW.step`, per parameter group (one ``torch._foreach_*``
call per phase over all of the group's shards):

1. decoupled weight decay: ``p *= 1 - lr * weight_decay``
2. moments: ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g * g``
3. bias-corrected update: ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ShardGroup:
    """The shards of one parameter group, index-aligned lists."""

    weight_decay: float
    indices: list[int]  # positions in the engine's trainable-parameter list
    params: list[torch.Tensor]  # fp32 master shards, updated in place
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]


class PartitionedAdamW:
    def __init__(
        self, groups: list[ShardGroup], *, lr: float, betas: tuple[float, float], eps: float
    ) -> None:
        self.groups = groups
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.step_count = 0

    def step(self, grads: list[torch.Tensor]) -> None:
        """``grads[i]`` is the fp32 gradient shard of trainable parameter ``i``."""
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1**self.step_count
        bias_correction2_sqrt = math.sqrt(1 - beta2**self.step_count)
        step_size = -self.lr / bias_correction1
        for group in self.groups:
            if not group.params:
                continue
            g = [grads[i] for i in group.indices]
            if group.weight_decay != 0:
                torch._foreach_mul_(group.params, 1 - self.lr * group.weight_decay)
            torch._foreach_lerp_(group.exp_avgs, g, 1 - beta1)
            torch._foreach_mul_(group.exp_avg_sqs, beta2)
            torch._foreach_addcmul_(group.exp_avg_sqs, g, g, 1 - beta2)
            denom = torch._foreach_sqrt(group.exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(group.params, group.exp_avgs, denom, step_size)


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared elements of all ``tensors`` as a 1-element fp32 tensor."""
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(nonempty)
    return torch.stack(norms).float().square().sum().reshape(1)
