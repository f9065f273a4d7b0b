"""The class a stage-3 parameter has while it holds no values.

[Note: reading a parameter outside a gather]
Outside a gather a partitioned parameter keeps its full shape and a storage of zero bytes
([Note: partitioned parameters] in zerostate.runtime.group). Every torch operation that
reads its values read from no memory: ``torch.optim.swa_utils.AveragedModel(model)``'s
``update_parameters(model)`` after each step (an EMA, as diffusion and timm training keep)
and ``p.norm()`` or ``p.clone()`` for logging killed the process with SIGSEGV (2 gloo
ranks, no message), ``p.detach().numpy()`` returned whatever lay at that address (5.3e32)
and ``print(p)`` crashed too. FSDP2 parameters are DTensors and such reads work there, so
a user switching over meets this on the first step.

While its group is released, the parameter's class is :class:`PartitionedParameter` (its
``__class__`` is swapped, as torch's ``UninitializedParameter`` does when it materialises;
the object, its hooks, ``.grad`` and its identity in optimizers stay). That class's
``__torch_function__`` lets through what reads no values (shape, dtype, device,
``numel()``, ``requires_grad``, ``.grad``, hooks, the storage object the engine resizes, a
``.to()`` that changes nothing) and refuses the rest before torch touches the memory, with
an error naming the parameter and the calls that work: ``engine.gathered()`` around the
read, ``engine.full_state_dict()`` for the values. ``param.data`` is an alias of the same
empty storage and gets the same guard (:class:`PartitionedTensor`). Gathering swaps the
class back to ``nn.Parameter`` first, so forward, backward and the optimizer see a plain
parameter and pay nothing. Only parameters whose class is exactly ``nn.Parameter`` are
swapped (a subclass keeps its own ``__torch_function__``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from zerostate.errors import StageUsageError

_T = torch.Tensor
_F = TypeVar("_F", bound=Callable[..., Any])


def _getters(names: str) -> set[Any]:
    return {getattr(_T, n).__get__ for n in names.split() if hasattr(_T, n)}


def _setters(names: str) -> set[Any]:
    return {getattr(_T, n).__set__ for n in names.split() if hasattr(_T, n)}


def _methods(names: str) -> set[Any]:
    return {getattr(_T, n) for n in names.split() if hasattr(_T, n)}


#: What reads no values: metadata, autograd bookkeeping, hooks, the storage object.
_ALLOWED: set[Any] = (
    _getters(
        "shape dtype device requires_grad grad _grad grad_fn _grad_fn is_leaf ndim layout"
        " is_cuda is_cpu is_meta is_sparse is_quantized is_nested is_mkldnn is_xpu is_mps"
        " names _base _version output_nr itemsize nbytes _backward_hooks"
        " _post_accumulate_grad_hooks _cdata retains_grad is_sparse_csr"
    )
    | _setters("requires_grad grad _grad _backward_hooks _post_accumulate_grad_hooks")
    | _methods(
        "size dim numel nelement element_size stride storage_offset is_contiguous"
        " is_floating_point is_complex is_signed requires_grad_ register_hook"
        " register_post_accumulate_grad_hook untyped_storage data_ptr get_device __len__"
        " _is_view is_shared is_pinned retain_grad __dir__ __sizeof__ _typed_storage"
        " is_inference"
    )
    | {torch._has_compatible_shallow_copy_type}
)

#: Conversions that may change nothing (``module.to(its own device)`` from Lightning or the
#: Trainer): allowed when the same call on a one-element tensor of the parameter's dtype and
#: device returns that tensor.
_CONVERSIONS: set[Any] = _methods("to cpu cuda float double half bfloat16 type_as contiguous")


def _label(func: Callable) -> str:
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # a property: Tensor.x.__get__/__set__
        return f"{'setting' if func.__name__ == '__set__' else 'reading'} .{owner.__name__}"
    return f"{getattr(func, '__name__', repr(func))}()"


def _refuse(func: Callable, tensor: torch.Tensor) -> StageUsageError:
    name = getattr(tensor, "zerostate_name", None) or "a parameter"
    return StageUsageError(
        f"{_label(func)} on {name} outside engine.gathered(): a stage-3 engine partitions "
        "this parameter, and outside a gather it holds no values on any rank (each keeps "
        "a shard). Read or change parameters inside `with engine.gathered():` "
        "(writeback=True to keep changes; an EMA's update_parameters(model) too), or take "
        "the values from engine.full_state_dict()"
    )


def converts(fn: Callable, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``fn`` (a conversion torch's methods make: elementwise in dtype and device)
    changes a tensor of ``dtype`` on ``device``: asked of a one-element one (a new tensor
    returned, or its storage moved)."""
    probe = torch.empty(1, dtype=dtype, device=device)
    at = probe.data_ptr()
    with torch._C.DisableTorchFunctionSubclass():
        return fn(probe) is not probe or probe.data_ptr() != at


def _is_noop_conversion(func: Callable, args: tuple, kwargs: dict) -> bool:
    if "memory_format" in kwargs:
        return False
    return not converts(lambda t: func(t, *args[1:], **kwargs), args[0].dtype, args[0].device)


class PartitionedTensor(torch.Tensor):
    """A tensor over a released parameter's empty storage (``param.data`` outside a
    gather); see [Note: reading a parameter outside a gather]."""

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tensor = next((a for a in args if isinstance(a, PartitionedTensor)), args[0])
        if func == _T.data.__get__:
            with torch._C.DisableTorchFunctionSubclass():
                alias = func(*args, **kwargs)
            alias.__class__ = PartitionedTensor
            alias.zerostate_name = getattr(tensor, "zerostate_name", None)
            return alias
        if func == _T.data.__set__ and args[1] is args[0]:  # Module._apply of a no-op .to()
            return None
        if func in _CONVERSIONS and _is_noop_conversion(func, args, kwargs):
            return args[0]
        raise _refuse(func, tensor)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"zerostate partitioned parameter of shape {tuple(self.shape)}, {self.dtype}: "
            "no values outside engine.gathered()"
        )

    def __format__(self, spec: str) -> str:
        return repr(self)


class PartitionedParameter(PartitionedTensor, nn.Parameter):
    """The class of a released stage-3 ``nn.Parameter``."""


def release(param: torch.Tensor, qualified: str) -> None:
    """Mark ``param`` (its storage just resized to zero bytes) as holding no values;
    ``qualified`` is its name in the model, for the error."""
    if type(param) is nn.Parameter:
        param.__class__ = PartitionedParameter
        param.zerostate_name = qualified


def restore(param: torch.Tensor) -> None:
    """Undo :func:`release` before the storage is filled again."""
    if type(param) is PartitionedParameter:
        param.__class__ = nn.Parameter


def unguarded(method: _F) -> _F:
    """Run ``method`` (the runtime's own bookkeeping on released parameters: their
    ``.grad``, their storage) without the guard: each access through it is a Python call
    (about 1.4 µs against 0.08), and a stage-3 step made about nine per parameter."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]
