"""The user's optimizer kept live after the engine takes over ([Note: live user
optimizer]): its ``param_groups`` and ``state`` are the engine's, its ``step()`` is the
engine's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerostate.errors import ConfigError

if TYPE_CHECKING:
    from zerostate.optim.sharded import ShardedOptimizer


# [Note: live user optimizer]
# Users of DeepSpeed and FSDP build a scheduler on the optimizer they created and call
# ``opt.step()``. The engine steps an inner optimizer over the master shards, so the user's
# object would otherwise be a detached copy whose lr changes nothing. After construction
# its class is swapped for a subclass (isinstance and the class name stay) whose
# ``param_groups`` and ``state`` are the inner optimizer's (the same dicts, so a
# ``LambdaLR(opt, ...)`` drives the engine, and a load updates them in place) and whose
# ``step()`` is ``engine.step()``. ``_opt_called`` reports the engine's steps, so torch's
# scheduler sees the optimizer stepped even when the user calls ``engine.step()``.
_LINKED: dict[type, type] = {}
_ENGINE_REF = "_zerostate_engine_ref"
_INNER = "_zerostate_inner"


def _engine_of(opt: Any) -> Any:
    engine = getattr(opt, _ENGINE_REF)()
    if engine is None:
        raise ConfigError(
            f"this {type(opt).__name__} drove a zerostate Engine that no longer exists; "
            "build a new optimizer for a new Engine"
        )
    return engine


class _LinkedOptimizer:
    """Mixed into the user's optimizer class; see [Note: live user optimizer]."""

    @property
    def param_groups(self) -> list[dict]:
        return getattr(self, _INNER).param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        getattr(self, _INNER).param_groups = value

    @property
    def state(self) -> Any:
        return getattr(self, _INNER).state

    @state.setter
    def state(self, value: Any) -> None:
        getattr(self, _INNER).state = value

    @property
    def _opt_called(self) -> bool:
        engine = getattr(self, _ENGINE_REF)()
        return engine is not None and engine.optimizer_steps > 0

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        pass  # derived from the engine's step count

    #: torch.amp.GradScaler.step(opt) then hands this step the scale (``grad_scale``,
    #: ``found_inf``) instead of asserting "No inf checks were recorded for this optimizer"
    #: ([Note: a GradScaler around the engine]).
    _step_supports_amp_scaling = True

    def step(self, closure: Callable | None = None) -> Any:
        """``engine.step()``: the engine owns the update of the partitioned state.

        [Note: a GradScaler around the engine]
        A DDP fp16 script keeps ``torch.amp.GradScaler``: ``scaler.scale(loss)``, then
        ``scaler.step(opt)`` and ``scaler.update()``. Around the engine the scaler's
        ``unscale_`` looked for gradients in ``opt.param_groups`` (the engine's fp32
        masters, whose gradients exist only inside ``engine.step()``), found none and
        raised torch's "No inf checks were recorded for this optimizer", which names
        neither the cause nor the fix (2 ranks, stages 0-3). The scaler cannot be served:
        its ``update()`` needs inf checks recorded in its own state. So the linked
        optimizer declares that it handles scaling, which makes the scaler hand the step
        its scale, and the step refuses with the fix: the engine scales fp16 losses itself
        (``precision="fp16"``), and bf16 needs no scaling. Nothing is stepped; the scaled
        gradients stay accumulated, so a script that catches this must build a new engine.
        """
        if closure is not None:
            raise ConfigError(
                "this optimizer is driven by a zerostate Engine, whose step takes no closure; "
                "call engine.backward(loss) and then engine.step() (or opt.step())"
            )
        if "found_inf" in vars(self):  # set by torch.amp.GradScaler.step(self)
            raise ConfigError(
                "torch.amp.GradScaler around a zerostate Engine: the engine keeps fp32 master "
                "weights and scales fp16 losses itself (Engine(precision='fp16'), dynamic loss "
                "scaling; bf16 needs none). Drop the GradScaler: engine.backward(loss) instead "
                "of scaler.scale(loss).backward(), and engine.step() (or opt.step()) instead of "
                "scaler.step(opt) and scaler.update(). Nothing was stepped; this step's "
                "gradients were scaled by the GradScaler, so start the run again"
            )
        return _engine_of(self).step()

    # torch's LR schedulers wrap an optimizer's step to learn that it was called; this step
    # reports that through _opt_called already, so a scheduler built later leaves it alone.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: ``engine.step()`` zeroes the gradients it consumed."""

    def state_dict(self) -> dict:
        return getattr(self, _INNER).state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        getattr(self, _INNER).load_state_dict(state_dict)


def _linked_class(cls: type) -> type:
    linked = _LINKED.get(cls)
    if linked is None:
        linked = type(cls.__name__, (_LinkedOptimizer, cls), {"__module__": cls.__module__})
        linked.__qualname__ = cls.__qualname__
        _LINKED[cls] = linked
    return linked


def is_linked(opt: Any) -> bool:
    """Whether ``opt`` already drives an engine (see [Note: live user optimizer])."""
    return isinstance(opt, _LinkedOptimizer)


def link_user_optimizers(optimizer: Any, sharded: ShardedOptimizer, engine: Any) -> None:
    """Make the user's optimizer(s) views of the engine's inner ones, in order."""
    import weakref

    if optimizer is None:
        return
    users = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for user, inner in zip(users, sharded.inner, strict=True):
        vars(user).pop("param_groups", None)
        vars(user).pop("state", None)
        vars(user).pop("_opt_called", None)
        vars(user).pop("step", None)  # a scheduler's wrapper of the original step
        object.__setattr__(user, _INNER, inner)
        object.__setattr__(user, _ENGINE_REF, weakref.ref(engine))
        user.__class__ = _linked_class(type(user))
