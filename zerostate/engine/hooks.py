"""The engine's hooks on autograd and the runtime, each reaching the engine weakly.

The engine registers a post-accumulate-grad hook on every trainable parameter and, with
offload, a hook the runtime calls as each group's reduce completes. Held strongly, either
would keep the engine alive as long as the model (see :class:`GradReadyHook`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zerostate.engine.facade import Engine


class GradReadyHook:
    """Post-accumulate-grad hook of one trainable parameter; reaches its engine weakly.

    torch's garbage collector does not look inside post-accumulate-grad hooks (they live
    in the tensor's C++ autograd metadata), so a hook holding the engine would close the
    cycle engine -> model -> parameter -> hook -> engine where no collector can see it.
    Every engine would then live until interpreter shutdown, and with it its process
    group, which ``destroy_process_group()`` could then not free: gloo's worker threads
    would run on into interpreter shutdown.
    """

    __slots__ = ("_engine", "_index")

    def __init__(self, engine: Engine, index: int) -> None:
        self._engine = weakref.ref(engine)
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_grad_ready(self._index)


def reduced_hook(ref: weakref.ref) -> Any:
    """The runtime's ``on_reduced`` for an offloading engine, holding it weakly (as
    :class:`GradReadyHook` does)."""

    def hook(group: Any) -> None:
        engine = ref()
        if engine is not None:
            engine._on_reduced(group)

    return hook


def weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` (bound), holding its object weakly: a hook that outlives it does nothing."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call
