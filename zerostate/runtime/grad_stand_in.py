"""What a trainable parameter's ``.grad`` is between ``engine.backward()`` and ``engine.step()``.

[Note: gradient stand-ins]
DDP and FSDP2 leave each parameter's averaged gradient in ``.grad`` after backward, and
scripts clip it there, ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``,
before the optimizer steps. The engine keeps the step's gradient elsewhere: stage 0 sums
it over the ranks into its own buffer (``.grad`` is a view of that buffer only when the
reduce dtype is the working dtype, and it is not yet averaged), stages 1-3 keep only this
rank's shard of it, and ``step()`` averages, unscales and clips (``grad_clip=``) what it
holds. torch's call on ``.grad`` would therefore return 0 or a norm of the wrong tensor and
change nothing the step uses: a silent no-op.

So after the backward that ends an accumulation window, every trainable parameter's
``.grad`` is a :class:`GradStandIn`: a tensor of the parameter's shape, dtype and device
with no storage, whose every operation raises :class:`GradientAccessError` naming
``grad_clip=`` (and the Lightning and Hugging Face settings that map to it). ``p.grad is
None`` and its shape still answer as before. The next ``step()`` puts back what was there
(:meth:`ParamGroup.uncover_grads`), as does the next backward or ``close()``.

Why not make ``.grad`` the real reduced gradient, as FSDP2 does: at stages 1-3 no rank holds
a full gradient, and building one would cost an all-gather of every gradient and the memory
the partitioning saves; at stage 0 it would need the average and (fp16) the unscaling moved
into backward. Only stage 0 could have it cheaply, and then a script that clips correctly
at stage 0 would silently stop clipping at stage 2. One answer at every stage: the call
raises, and ``grad_clip=`` clips the global fp32 gradient at every stage, with offload too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from zerostate.errors import GradientAccessError

_FIX = (
    "To clip by norm pass grad_clip=max_norm to zerostate.Engine (Lightning: "
    "Trainer(gradient_clip_val=...); Hugging Face: TrainingArguments(max_grad_norm=...)); it "
    "clips the global gradient at every stage. After each step(), engine.last_grad_norm is "
    "the global gradient norm before clipping"
)


def where_grads_are(stage: int) -> str:
    """Why ``.grad`` is not the step's gradient at ``stage`` (for the error message)."""
    if stage == 0:
        return (
            "at stage 0 the engine sums the gradients over the ranks into its own buffer "
            "during backward, and averages, unscales and clips them in step()"
        )
    return (
        f"at stage {stage} each rank keeps only its shard of the reduced gradient (no rank "
        "holds a full one), and step() averages, unscales and clips the shards"
    )


class GradStandIn(torch.Tensor):
    """Storage-less ``.grad`` of one parameter whose every use raises; see
    [Note: gradient stand-ins]."""

    _param_name: str
    _reason: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, reason: str) -> GradStandIn:
        stand_in = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )
        stand_in._param_name = name
        stand_in._reason = reason
        return stand_in

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        stand_in = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, GradStandIn))
        raise GradientAccessError(stand_in.message(f"{func} on it"))

    def message(self, what: str) -> str:
        return (
            f"{self._param_name}.grad was used between engine.backward() and engine.step() "
            f"({what}), but it does not hold the step's gradient: {self._reason}. "
            "torch.nn.utils.clip_grad_norm_ on the model's parameters would clip nothing. "
            f"{_FIX}"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"GradStandIn({self._param_name}, shape={tuple(self.shape)}, dtype={self.dtype}): "
            "no gradient between engine.backward() and engine.step(); see grad_clip="
        )
