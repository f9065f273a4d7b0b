"""The plan of a load: the checks of an engine-state document against the engine that
loads it, and what a load changes. The document itself (its schema and versions, and the
check of its version) belongs to the store: :mod:`zerostate.store.state_doc`.

[Note: planned load]
A load is planned and checked completely before anything in the engine changes, so a
refused load leaves the engine exactly as it was (weights, optimizer state, step counts,
group hyperparameters, loss scale) and the "resume if there is a checkpoint"
idiom (``try: engine.load(...) except CheckpointError: pass``) trains on as if no load
had been tried. :meth:`Engine.plan_load` checks the document's version, the weight tying,
the optimizer classes, group membership, the decoded optimizer state and loss scale, and
the tensors the engine would need against those the step stores (missing, unexpected,
shapes), and returns a :class:`LoadPlan`; a peer's step is fitted to the engine on a copy
of its document first (``zerostate.checkpoint``). Only then :meth:`Engine.apply_load`
installs the plan and the reader reads the tensors. A read that fails after that (a
damaged or missing row, found only by reading it) changes nothing either: the optimizer
state the step holds is read into fresh tensors (or into the zero ones the engine made,
which the undo zeroes again: [Note: known zero moments] in zerostate.optim), everything
else into staging until every rank has read its part ([Note: nothing lands before every
rank has read] in zerostate.checkpoint.load), and the undo that ``apply_load`` returns
puts the optimizer's previous state, scalars, groups, step count and loss scale back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zerostate.errors import CheckpointError
from zerostate.optim import OptimizerLoad

#: Names an error lists before it only counts the rest.
LISTED_NAMES = 10


def listing(names: list[str]) -> str:
    """The first :data:`LISTED_NAMES` of ``names``, then how many more there are."""
    shown = ", ".join(names[:LISTED_NAMES])
    rest = len(names) - LISTED_NAMES
    return f"{shown} and {rest} more" if rest > 0 else shown


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Everything a load changes in the engine, checked and decoded."""

    step: int
    loss_scaler: dict
    optimizer: OptimizerLoad


@dataclass(frozen=True)
class AppliedLoad:
    """An installed :class:`LoadPlan`: ``undo()`` puts the engine back as it was before,
    and ``fresh`` holds the ``id`` s of the optimizer-state tensors the reader may fill in
    place: new ones, and the engine's own zero ones that the undo zeroes again."""

    undo: Callable[[], None]
    fresh: frozenset[int]


def check_tying(state: dict, tied: dict[str, str]) -> None:
    saved = state.get("tied", {})
    if saved != tied:
        raise CheckpointError(
            f"the checkpoint ties {saved} but this model ties {tied}; load it into "
            "a model with the same weight tying"
        )


def check_tensors(
    needed: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, Any],
    *,
    strict: bool,
    where: str,
    step: int,
) -> None:
    """The tensors a load would write (``needed``: name -> shape) against those the step
    stores (name -> info with ``.shape``): missing ones refused under ``strict`` (logged
    otherwise), another shape always refused."""
    missing = [name for name in needed if name not in stored]
    if not strict:
        from zerostate.runtime.adapt import report_skipped

        report_skipped(where, step, list(needed), stored)
    if missing and strict:
        raise CheckpointError(
            f"step {step} in {where} lacks {len(missing)} tensor(s) the model needs: "
            f"{listing(missing)}. Is it a checkpoint of this model? (strict=False skips "
            "them)"
        )
    mismatched = [
        f"{name} (checkpoint {tuple(info.shape)}, model {tuple(shape)})"
        for name, shape in needed.items()
        if (info := stored.get(name)) is not None and tuple(info.shape) != tuple(shape)
    ]
    if mismatched:
        raise CheckpointError(
            f"step {step} in {where}: {len(mismatched)} tensor(s) have another shape "
            f"than the model's: {listing(mismatched)}. Is it a checkpoint of this model "
            "(same configuration)?"
        )
