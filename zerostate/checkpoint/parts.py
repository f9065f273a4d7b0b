"""What the checkpoint code sees of an engine: its state as parts, never the engine.

[Note: engine parts]
A save, a load, ``load_pretrained`` and the fitting of a peer's step need a handful of
things from the engine that trains: the live tensors to write or read into
(``state_views``), the engine-state document a step records (``engine_state``), a load
planned and checked before anything changes and then installed (``plan_load`` /
``apply_load``, [Note: planned load] in zerostate.checkpoint.load_plan), the working copies
rebuilt from the masters afterwards, and a few plain facts (rank, coordinator, module,
config, weight tying). :class:`EngineParts` names exactly those; the engine builds one
object that implements it (``zerostate.engine.parts.StateParts``) from its pieces and
hands that object, not itself, to the checkpoint code. So the sessions cannot reach the
engine's other members, and another trainer joins the same session code by implementing
this protocol, as a component joins DCP by implementing ``Stateful``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from zerostate.checkpoint.load_plan import AppliedLoad, LoadPlan
    from zerostate.checkpoint.tensor_parallel import CheckpointWorld
    from zerostate.dist.coordinator import Coordinator
    from zerostate.runtime.sharded import ShardView

__all__ = ["EngineParts"]


class EngineParts(Protocol):
    """An engine's state as the checkpoint code uses it ([Note: engine parts])."""

    rank: int
    """This rank in the engine's (data-parallel shard) group."""
    coordinator: Coordinator
    """The engine's control collectives ([Note: one coordinator] in zerostate.dist.coordinator)."""
    checkpoint_world: CheckpointWorld | None
    """Who saves together under tensor parallelism; None without a tp dimension."""
    module: nn.Module
    """The model the engine trains (its config and adapters are recorded with a step)."""
    config: Any
    """The engine's :class:`~zerostate.engine.config.EngineConfig` (a peer's update settings are
    compared with it at load)."""
    tied: Mapping[str, str]
    """Tied parameter aliases: alias -> canonical name."""

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (the default step number of a save)."""
        ...

    def engine_state(self) -> dict:
        """The engine-state document a step records."""
        ...

    def state_views(self) -> list[ShardView]:
        """Every logical tensor's live local state, in a fixed order."""
        ...

    def plan_load(
        self,
        state: dict,
        stored: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        where: str = "the checkpoint",
        step: int | None = None,
    ) -> LoadPlan:
        """Check a step's engine-state document (and its tensors) against the engine and
        decode it; changes nothing."""
        ...

    def apply_load(self, plan: LoadPlan, read: Collection[str] = ()) -> AppliedLoad:
        """Install a checked plan before the tensors named in ``read`` are read into the
        state views; returns the undo."""
        ...

    def whole_replicas(self) -> dict[str, torch.Tensor]:
        """``{"model/<name>": whole flat working parameter}`` a load may read whole."""
        ...

    def refresh_from_masters(self, read_whole: Collection[str] = ()) -> None:
        """Rebuild the working parameters from the masters, except those read whole."""
        ...

    def optimizer_classes(self) -> list[type]:
        """The classes of the inner optimizers, in order."""
        ...

    def group_names(self) -> list[list[str]]:
        """The canonical parameter names of each optimizer param group, in order."""
        ...

    def mark_set(self, names: Collection[str]) -> None:
        """``names`` were written by a load ([Note: unset state], [Note: torn weights])."""
        ...

    def mark_torn(self, names: Collection[str], source: str) -> None:
        """A read from ``source`` that failed part-way may have partly written ``names``
        ([Note: torn weights] in zerostate.engine.parts)."""
        ...
