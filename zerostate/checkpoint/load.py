"""A load session: one collective load of a step (any format, any world size) into an engine.

[Note: planned load] in zerostate.checkpoint.load_plan: every check runs before anything in the
engine changes; then the plan is applied, this rank's ranges are read into the engine in
one batched read, and the ranks agree ([Note: failing together] in zerostate.checkpoint)
before the working copies are rebuilt and the stateful objects restored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerostate import jsonstate
from zerostate.checkpoint import peer_settings
from zerostate.checkpoint.foreign import open_any_step
from zerostate.checkpoint.roots import EngineRoots
from zerostate.checkpoint.state import (
    check_stateful,
    left_behind,
    restore_rng,
    saved_rank_state,
    saved_rng,
)
from zerostate.checkpoint.tensor_parallel import layout_read
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts

log = logging.getLogger(__name__)


class LoadSession:
    """One call of ``engine.load``; :meth:`run` is collective."""

    def __init__(
        self,
        parts: EngineParts,
        path: str,
        *,
        coordinator: Coordinator,
        roots: EngineRoots,
        settle: Callable[[], None],
        step: int | None,
        storage_options: dict | None,
        strict: bool,
        stateful: dict | None,
        strict_state: bool,
    ) -> None:
        self.parts, self.path, self.coordinator = parts, path, coordinator
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self._roots, self._settle = roots, settle
        self._step, self._storage_options = step, storage_options
        self._strict, self._strict_state = strict, strict_state
        self._stateful = check_stateful(stateful, loading=True)

    def run(self) -> Any:
        """Load; returns the step's ``client_state``."""
        parts, path, stateful = self.parts, self.path, self._stateful
        self.coordinator.arrive("load")
        error, st, restore, left, undo, plan = None, None, None, [], None, None
        read_whole, staged = set(), []
        try:
            self._settle()  # the save in flight finishes, its snapshot is taken
            root = self._roots.open(path, self._storage_options)  # [Note: one root per location]
            st, document = open_any_step(parts, root, self._step)
            # [Note: planned load]: every check runs before anything in the engine changes.
            plan = parts.plan_load(
                document, st.tensors, strict=self._strict, where=path, step=st.step
            )
            restore = saved_rank_state(
                st, stateful, self._strict, rank=self.rank, world_size=self.world_size
            )
            left = left_behind(st, stateful, self.world_size)
            if left and self._strict_state:
                raise CheckpointError(
                    f"step {st.step} in {path} holds state this load was not asked to "
                    f"restore: {'; '.join(left)} (strict_state=True)"
                )
            applied = parts.apply_load(plan, st.tensors.keys())
            undo = applied.undo
            read_whole, staged = self._read_tensors(st, applied.fresh)
        except Exception as exc:
            error = exc
        try:
            # Every rank must know before the collectives below whether all ranks read
            # their part ([Note: failing together]); a rank's read error fails every rank.
            try:
                self.coordinator.agree(error, f"loading {path}")
            except BaseException:
                if undo is not None:
                    undo()
                raise
            _land(staged)
            parts.refresh_from_masters(read_whole)
            rng, objects = restore
            restore_rng(st, rng, rank=self.rank, world_size=self.world_size)
            for name, value in objects.items():
                stateful[name].load_state_dict(value)
            self.coordinator.barrier()
        finally:
            if st is not None:
                st.close()  # its read threads wait for the next load ([Note: pool reuse])
        self._roots.memory(path).own = True  # resuming this run ([Note: save target])
        if self.rank == 0:
            self._warn(st, plan, left)
        # jsonstate's encoding (plain JSON in steps before it, which decodes as itself)
        return jsonstate.decode(st.attrs.get("client_state"), f"client_state of step {st.step}")

    def _warn(self, st: Any, plan: Any, left: list[str]) -> None:
        path = self.path
        # [Note: a peer's update settings]
        for warning in peer_settings.differences(st.attrs, self.parts.config, path):
            log.warning("zerostate: %s", warning)
        for group in plan.optimizer.mixed:
            log.warning(
                "zerostate: load(strict=False) from %s step %d kept this engine's "
                "hyperparameters for %s: its parameters were saved in different groups "
                "([Note: groups by membership] in zerostate.optim)",
                path,
                st.step,
                group,
            )
        # left_behind lists the RNG states last, after the stateful objects. They differ in
        # what the user can do: a stateful object left out is fixed by passing it, while the
        # RNG states of ranks that no longer exist cannot be restored by anything, and a
        # world-size change (the resume a resharding store exists for) is expected to leave
        # them. So the objects get a warning with the fix, the RNG states an info line.
        rng = bool(left) and st.world_size != self.world_size and saved_rng(st)
        objects = left[:-1] if rng else left
        if objects:
            log.warning(
                "zerostate: loaded step %d from %s but left saved state unrestored: %s. "
                "Pass it to load(stateful={...}) to restore it, or strict_state=True to make "
                "this an error",
                st.step,
                path,
                "; ".join(objects),
            )
        if rng:
            log.info(
                "zerostate: loaded step %d from %s, saved by %d ranks, on %d: the saved RNG "
                "states of %d ranks are kept per rank and restored only at the same world "
                "size, so this run continues from its own RNG states (expected after a "
                "change of world size)",
                st.step,
                path,
                st.world_size,
                self.world_size,
                st.world_size,
            )

    def _read_tensors(
        self, st: Any, fresh: frozenset[int]
    ) -> tuple[set[str], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Read this rank's ranges of every view the step holds: the optimizer state that
        ``apply_load`` prepared for it (their ``id`` s in ``fresh``) in place, the rest
        into staging. Returns the names of the working parameters read whole and the
        ``(engine tensor, staged data)`` pairs :func:`_land` copies once every rank has read
        its part.

        [Note: nothing lands before every rank has read]
        A damaged or missing row is found only by reading it, after other ranges of this
        rank, and every range of the other ranks, have been read. Reads used to land in the
        engine's own tensors, so such a load raised with the weights and moments part
        checkpoint, part what they were, and at stage 3 the masters out of step with the
        working parameters (found with a flipped byte at stages 1 and 3, 2 ranks). Now the
        optimizer state the step holds is read into fresh tensors (``apply_load``; its undo
        puts the old ones back untouched), and the weights, buffers and working parameters
        into staging that :func:`_land` copies in after the ranks agreed that every read
        went through ([Note: failing together] in zerostate.checkpoint). So a load that
        fails while reading changes nothing, like one refused by its plan. Moments still
        zero as the engine made them at construction (a resumed run) are read in place and
        zeroed again by the undo: a resume holds no second copy of them ([Note: known zero
        moments] in zerostate.optim).
        The cost is host memory: until the copy, this rank holds its part of the weights
        (its whole working parameters where it reads them whole, see below) twice, and an
        engine that had stepped holds its old and the new moments. Tensors on an
        accelerator were already read through host memory and copied after the read; that
        copy now waits for the agreement too, into the tensors they had (no accelerator
        memory is added).

        [Note: whole replicas at load]
        At stages 1-2 the working parameters are replicated and the masters are the owned
        ranges. A load used to read each rank's ranges and then all-gather the parameters
        from the masters, as a step does. When the step reads locally (``reads_locally``:
        files on this host, whose pages every rank of the host shares) and a parameter is
        fp32 in host memory with its master a view of it, each rank reads the parameter
        whole instead: the master is filled by the same read, and the other ranks' ranges
        come from the page cache at the cost of a copy, while the all-gather moved them over
        the process group's transport. With 3 ranks of gloo on 2 cores, the gather of a
        42 MB model took 50-90 ms of a 0.19 s load. Parameters on an accelerator (NCCL
        gathers them faster than any disk), in another working dtype, offloaded, or read from
        object stores (every rank would fetch the whole model) are still gathered.
        ``Engine.whole_replicas`` names the same parameters on every rank, so every rank
        leaves the same ones out of the gather."""
        views = self.parts.state_views()
        # One batched read: every piece of storage this rank needs is fetched once, adjacent
        # pieces together, into fresh memory.
        whole = self.parts.whole_replicas() if st.reads_locally else {}
        requests, targets, read_whole = [], [], set()
        mesh_reads, mesh_targets = [], []
        for view in views:
            info, local, start = st.tensors.get(view.name), view.local, view.local_start
            if info is None:
                continue
            in_place = id(local) in fresh
            if view.mesh is not None:  # [Note: tensor-parallel checkpoints]
                name, mesh, tp_index, lo, hi, out = layout_read(view)
                direct = in_place and local.device.type == "cpu" and local.is_contiguous()
                if not direct or local.dtype != info.dtype:
                    out = torch.empty(hi - lo, dtype=info.dtype)
                    mesh_targets.append((local, out))
                mesh_reads.append((name, mesh, tp_index, lo, hi, out))
                continue
            if view.name in whole:
                local, start, in_place = whole[view.name], 0, False
                read_whole.add(view.name)
            if local.numel() == 0:
                continue
            direct = (
                in_place
                and local.device.type == "cpu"
                and local.is_contiguous()
                and local.dtype == info.dtype
            )
            out = local.detach().view(-1) if direct else None
            requests.append((view.name, start, start + local.numel(), out))
            targets.append(None if direct else local)
        results = st.read_many(requests)  # every format batches (see store/protocol.py)
        st.read_layout_many(mesh_reads)
        staged = [(t, d) for t, d in zip(targets, results, strict=True) if t is not None]
        return read_whole, staged + mesh_targets


def _land(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy staged reads into the engine's tensors ([Note: nothing lands before every rank
    has read]); each staged buffer goes as soon as it has landed."""
    with torch.no_grad():
        while staged:
            local, data = staged.pop()
            # Into ``local`` itself: ``local.reshape(-1)`` of a strided tensor is a copy.
            local.copy_(data.to(local.dtype).reshape(local.shape), non_blocking=True)
