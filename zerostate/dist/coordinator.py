"""One object for the control traffic of a collective call: arrive, exchange, agree.

A save, a load or ``load_pretrained`` is collective, and each of its phases that can fail
on one rank must end with every rank knowing whether any rank failed ([Note: failing
together] in zerostate.checkpoint). The calls that do it live in :mod:`zerostate.dist.collectives`
as free functions taking the process group, rank, world size and device every time; a
:class:`Coordinator` binds them once, so the checkpoint sessions (and any other component)
speak of the group in one line per phase.

[Note: one coordinator]
The engine binds its coordinator once, when it is built, and every component that needs
control traffic over the engine's group gets it from there: the stage-3 runtime (its
forward-order checks), the checkpointer (its save and load phases), ``load_pretrained``
and the engine's own arrivals. What differs between them is derived, not rebound: the
error a rank raises when another one failed (:meth:`Coordinator.with_errors`) and, for
the ranks of another group of the same engine (the replicas of a hybrid-sharded mesh, the
ranks that save a tensor-parallel checkpoint together), :meth:`Coordinator.over`. Control
traffic that recurs at every step is counted in the engine's communication counters
(``exchange(..., every_step=True)``); a save's or a load's is not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from zerostate.dist import arrival, collectives
from zerostate.dist.collectives import CommStats
from zerostate.errors import ZerostateError


@dataclass(frozen=True, slots=True)
class Coordinator:
    """The control collectives of one process group, from this rank's side."""

    group: Any
    """The process group (None: the default group, or no process group at all)."""
    rank: int
    world_size: int
    device: torch.device
    """Where the small control tensors live (the backend's device)."""
    arrival_timeout_s: float
    """Seconds :meth:`arrive` waits for the other ranks ([Note: arrival deadline])."""
    error_cls: type[Exception] = ZerostateError
    """What the ranks that succeeded raise when another rank failed."""
    note: str = ""
    """Appended to that error's message (what the failure means, e.g. nothing committed)."""
    stats: CommStats | None = None
    """The engine's communication counters, where the exchanges that recur at every step
    are counted ([Note: one coordinator]); None: nothing is counted."""

    def with_errors(self, error_cls: type[Exception], note: str = "") -> Coordinator:
        """This coordinator, raising ``error_cls`` (with ``note``) where another rank failed."""
        return replace(self, error_cls=error_cls, note=note)

    def over(self, group: Any, rank: int, world_size: int) -> Coordinator:
        """The coordinator of another group this process belongs to (this rank's ``rank`` in
        it, its ``world_size``), on the same device and arrival deadline. Its exchanges
        are not counted: the engine's counters are of its own group."""
        return replace(self, group=group, rank=rank, world_size=world_size, stats=None)

    def arrive(self, what: str) -> None:
        """Wait until every rank entered call ``what`` ([Note: arrival deadline] in
        zerostate.dist.arrival)."""
        arrival.arrive(
            what,
            group=self.group,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.arrival_timeout_s,
        )

    def barrier(self) -> None:
        collectives.barrier(group=self.group)

    def exchange(self, row: list[int], *, every_step: bool = False) -> list[list[int]]:
        """Every rank's ``row`` of integers, in rank order (one all-gather). ``every_step``:
        traffic that recurs at every training step, counted in :attr:`stats`."""
        return collectives.exchange(
            row,
            group=self.group,
            world_size=self.world_size,
            device=self.device,
            stats=self.stats if every_step else None,
        )

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank learns whether any rank failed ``what``: the failing rank re-raises
        ``error``, the others raise :attr:`error_cls` naming the failed rank(s)."""
        collectives.agree(
            error,
            what,
            group=self.group,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            error_cls=self.error_cls,
            note=self.note,
        )

    def raise_if_failed(self, error: BaseException | None, failed: list[bool], what: str) -> None:
        """:meth:`agree` for a verdict that already travelled in an :meth:`exchange`
        (``failed``: one flag per rank)."""
        if error is not None:
            raise error
        ranks = [r for r, bad in enumerate(failed) if bad]
        if ranks:
            raise self.error_cls(
                f"{what} failed on rank(s) {ranks} (see the error rank {ranks[0]} raised); "
                f"rank {self.rank}'s part succeeded{self.note}"
            )
