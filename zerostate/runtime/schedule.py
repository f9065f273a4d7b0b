"""Which unit each rank gathers next: the agreed order, and gathers on demand for units that
run on some ranks only.

[Note: agreed gather order]
Ranks must gather units in one order. During the first forward every gather is preceded by
a tiny synchronous exchange of the unit's index, which records the order. Afterwards a rank
that enters a unit other than the next one of the recorded order takes part in the
collective the other ranks issue next (the next unit's gather) with a deviation tag
([Note: group tags] in zerostate.runtime.group), so every rank learns of it from that same
collective; a rank that leaves the order first waits for the gathers it prefetched and
reads their tags, so no rank announces past a collective that already carried another
rank's announcement, and every rank finds out at the same collective. If every rank left
the order alike (an evaluation forward that skips a head), they continue with synchronous
exchanges for the rest of that forward. Otherwise the ranks ran different units:
[Note: conditional units].

[Note: conditional units]
Heads picked per sample, a list of experts at the top of a model, a block skipped on some
ranks: a unit may run on some ranks only. Once any forward shows it (an exchange or a tag
that differs between ranks), every rank switches, at that same collective, to gathering on
demand for the rest of training. Each gather is then preceded by a *round*: a synchronous
exchange of ``[kind, unit, reductions ready]`` in which every rank says which unit it needs
now (or that it has finished the forward or backward); every rank then takes part in the
gather of each unit some rank asked for, in ascending unit order, keeping the ones it
asked for and discarding the others. A rank that has finished keeps answering rounds until
every rank has, so forward and backward end together. Gradient reductions keep their
static order ([Note: reduce order] in zerostate.runtime.runtime), but during backward they
are launched only in rounds, up to the smallest prefix of that order every rank has ready;
a unit a rank did not enter in the forward is ready at once (its gradients are zeros). So
every rank issues the same collectives in the same order whatever each one computed, and
nobody waits for a reduction another rank cannot launch yet. The cost: no prefetch, and one
small exchange per gather, for the models that need it; ``leaf_modules`` still gathers a
conditional part whole with its owner instead.
"""

from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING

from zerostate.errors import DistributedMismatchError
from zerostate.runtime.group import GroupState, ParamGroup

if TYPE_CHECKING:
    from zerostate.runtime.runtime import GroupRuntime

log = logging.getLogger("zerostate.engine")

# Kinds of a round's row ([Note: conditional units]).
GATHER, END = 1, 2


class GroupMismatchError(DistributedMismatchError):
    """Ranks gathered different parameter groups in one collective."""


class GatherSchedule:
    """The stage-3 forward's gather order of one runtime ([Note: agreed gather order])."""

    def __init__(self, runtime: GroupRuntime) -> None:
        self.rt = runtime
        self.order: list[ParamGroup] = []
        self.recording = True
        self.adhoc = False
        #: Gathers on demand for good ([Note: conditional units]).
        self.conditional = False
        self.cursor = 0
        self.launched_upto = 0
        self.entered: list[int] = []
        #: Units entered since the last backward ended: the others get zero gradients.
        self.ran: set[int] = set()

    # -- forward ---------------------------------------------------------------------------
    def start_forward(self) -> None:
        self.entered = []
        self.cursor = 0
        self.launched_upto = 0
        self.adhoc = False

    def prefetch_first(self) -> None:
        if self.rt.policy.prefetch and not (self.recording or self.conditional) and self.order:
            self._prefetch_next()

    def enter(self, group: ParamGroup) -> None:
        self.entered.append(group.index)
        self.ran.add(group.index)
        if self.conditional:
            self.demand(group)
            return
        if self.recording or self.adhoc:
            rows = self._round(GATHER, group)
            if any(r[:2] != rows[0][:2] for r in rows):
                self._switch(rows)
            elif self.recording:
                self.order.append(group)
            return
        expected = self.order[self.cursor] if self.cursor < len(self.order) else None
        if group is expected:
            self.cursor += 1
            if self._take(group) and self.rt.policy.prefetch:
                self._prefetch_next()
            return
        self._deviate(group)

    def end_forward(self) -> None:
        if not (self.conditional or self.recording or self.adhoc) and self.cursor < len(self.order):
            self._deviate(None)  # this rank skipped trailing units
        if self.conditional:
            self.finish_phase()
        else:
            signature = zlib.crc32(repr(self.entered).encode())
            rows = self._round(END, value=signature)
            if any(r[0] != END for r in rows):
                self._switch(rows)  # this rank ended while another entered a unit
                self.finish_phase()
            elif any(r[1] != signature for r in rows):
                self._fail({rank: f"entered units {r[1]:#x}" for rank, r in enumerate(rows)})
        self.recording = False

    def demand(self, group: ParamGroup) -> None:
        """Gather ``group`` in a round, unless this rank holds it ([Note: conditional
        units])."""
        if group.state is not GroupState.GATHERED:
            self._round(GATHER, group)

    def finish_phase(self) -> None:
        """Answer rounds until every rank has finished its forward or backward."""
        while True:
            rows = self._round(END)
            if all(r[0] == END for r in rows):
                return

    def _prefetch_next(self) -> None:
        while self.launched_upto <= self.cursor and self.launched_upto < len(self.order):
            nxt = self.order[self.launched_upto]
            self.launched_upto += 1
            nxt.start_gather()

    def _take(self, group: ParamGroup) -> bool:
        """Complete the gather of the expected unit; False if another rank announced a
        deviation in it (the ranks switch to rounds, and a round gathers it again)."""
        if group.state is GroupState.GATHERED:
            return True
        group.start_gather()
        if group.state is GroupState.GATHERED:
            return True
        tags = group.wait_gather()
        if all(t == group.index + 1 for t in tags):
            group.unpack_gather()
            return True
        group.drop_gather()
        self._diverged(tags, want=group)
        return False

    def _deviate(self, wanted: ParamGroup | None) -> None:
        """This rank leaves the recorded order (``wanted`` is None: its forward ended
        early): say so in the collective the others issue next, the gather of the next
        unit not yet launched ([Note: agreed gather order])."""
        for pending in self.order[self.cursor : self.launched_upto]:
            if pending.state is GroupState.GATHERING:
                tags = pending.wait_gather()
                pending.drop_gather()
                if any(t != pending.index + 1 for t in tags):
                    self._diverged(tags, want=wanted)
                    return
        code = -(wanted.index + 1) if wanted is not None else -(len(self.rt.groups) + 1)
        position = max(self.launched_upto, self.cursor)
        if position < len(self.order):
            nxt = self.order[position]
            nxt.release()
            nxt.start_gather(tag=code)
            tags = nxt.wait_gather()
            nxt.drop_gather()
            self.launched_upto = position + 1
            if len(set(tags)) != 1:
                self._diverged(tags, want=wanted)
                return
        self.adhoc = True
        if wanted is not None:
            rows = self._round(GATHER, wanted)
            if any(r[:2] != rows[0][:2] for r in rows):
                self._switch(rows)

    # -- rounds ([Note: conditional units]) -------------------------------------------------
    def _round(self, kind: int, group: ParamGroup | None = None, value: int = 0) -> list:
        rt = self.rt
        if group is not None:
            value = group.index
        rows = rt.coordinator.exchange([kind, value, rt.ready_upto()], every_step=True)
        wanted = sorted({r[1] for r in rows if r[0] == GATHER})
        for index in wanted:
            if not 0 <= index < len(rt.groups):
                raise GroupMismatchError(f"stage 3: a rank asked for unit {index}, which is none")
            target = rt.groups[index]
            if target is group and kind == GATHER and target.state is not GroupState.GATHERED:
                rt.gather_now(target)
            else:
                target.join_gather()
        rt.launch_agreed(min(r[2] for r in rows))
        return rows

    def _switch(self, rows: list) -> None:
        if self.conditional:
            return
        self.conditional = True
        if self.rt.ctx.rank == 0:
            groups = self.rt.groups
            shown = ", ".join(
                f"rank {rank} "
                + (self.rt.label(groups[r[1]]) if r[0] == GATHER else "at the end of forward")
                for rank, r in enumerate(rows)
            )
            log.info(
                "zerostate: stage 3: ranks ran different units in one forward (%s); from now "
                "on each unit is gathered on demand ([Note: conditional units])",
                shown,
            )

    def _diverged(self, tags: list[int], *, want: ParamGroup | None) -> None:
        """A collective's tags showed ranks that left the recorded order differently: every
        rank is at this same collective. Switch, then ask for what this rank needs now (a
        rank whose forward ended asks in :meth:`end_forward`)."""
        num_groups = len(self.rt.groups)
        rows = []
        for tag in tags:  # [Note: group tags]
            index = tag - 1 if tag > 0 else -tag - 1
            rows.append([GATHER, index] if 0 <= index < num_groups else [END, 0])
        self._switch(rows)
        if want is not None:
            self.demand(want)

    # -- failures -------------------------------------------------------------------------
    def raise_mismatch(self, tags: list[int]) -> None:
        groups = self.rt.groups
        wanted = {}
        for rank, tag in enumerate(tags):
            if 0 < tag <= len(groups):
                wanted[rank] = f"gathers {self.rt.label(groups[tag - 1])}"
            elif 0 <= -tag - 1 < len(groups):
                wanted[rank] = f"gathers {self.rt.label(groups[-tag - 1])}"
            else:
                wanted[rank] = "has finished its forward"
        self._fail(wanted)

    def _fail(self, wanted: dict[int, str]) -> None:
        shown = "; ".join(f"rank {r} {what}" for r, what in sorted(wanted.items()))
        raise GroupMismatchError(
            f"stage 3: ranks issued different gathers in one collective ({shown}). This is "
            "a defect in zerostate's gather schedule: please report it with the model; "
            "leaf_modules=['<the module>'] gathers a module that runs on some ranks only "
            "whole with its owner and avoids it"
        )
