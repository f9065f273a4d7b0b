"""One parameter group: the unit of sharding, communication and lifecycle at every stage.

A :class:`ParamGroup` owns a fixed list of parameters (a stage 0-2 bucket, a stage-3 module
unit: the same object), their working storage, their gradient buffers and their pending
gathers. What it does with them is decided by a frozen :class:`GroupPolicy`; ZeRO stages
are presets of that policy (:meth:`GroupPolicy.for_stage`). The runtime
(:mod:`zerostate.runtime.runtime`) only sequences groups.

[Note: group policy]
* ``shard_optimizer``: fp32 masters and optimizer state cover only the owned range of each
  parameter (stages 1-3); otherwise the whole tensor (stage 0).
* ``shard_grads``: every micro-step's gradients are reduce-scattered into an fp32 shard of
  the owned range as soon as the group's gradients are complete (stages 2-3). Otherwise
  full gradients accumulate locally, in the reduce dtype, and are communicated once on the
  accumulation boundary: all-reduced when optimizer states are replicated (stage 0),
  reduce-scattered in place when they are sharded (stage 1).
* ``shard_params``: the working parameters are partitioned too and gathered for use
  (stage 3, [Note: partitioned parameters]).
* ``offload_optimizer``: the fp32 masters and optimizer states of the owned ranges live in
  host memory and the optimizer steps there (any sharded stage, [Note: offload] in
  zerostate.runtime.offload); ``offload_params``: the parameter shards too (stage 3).

[Note: local accumulation layout]
Stage 0 accumulates in a flat buffer in parameter order, so each parameter's full gradient
is a contiguous view (and, when the reduce dtype is the working dtype, is ``.grad`` itself:
autograd accumulates in place). Stage 1 accumulates in the rank-segmented layout of
[Note: bucket layout]: each arriving ``.grad`` is added into its column block and dropped,
so no working-dtype gradient outlives its hook, and on the boundary one reduce-scatter runs
in place (the output is this rank's own segment of the same buffer). No second full-size
buffer exists at any time.

[Note: written on arrival]
The local buffer is never zeroed between steps. The first gradient of a parameter in an
accumulation window is copied into its place (cast to the reduce dtype), later ones are
added, and a parameter whose gradient never came has its place zeroed when its group is
launched. So a step writes each gradient element once where zeroing the buffer and adding
into it wrote it twice and read it once more. At stage 0 with views the parameter's
``.grad`` is None until its first gradient of the window: autograd hands its freshly
computed tensor over (no add into a zeroed view), the hook copies it into the buffer and
puts the view in ``.grad``, where the window's later micro-steps accumulate in place.
After the step ``.grad`` is None again, as after torch's ``zero_grad()``. Padding is
zeroed once, when the buffer is made: the reduce sums zeros there on every rank, so it
stays zero.

[Note: partitioned parameters]
Every parameter stays an ``nn.Parameter`` of its full shape inside the model, but its
storage is resized to zero bytes whenever its group is not gathered; the rank keeps only
its owned slice (``ShardedParam.shard``) and the fp32 master/optimizer slices. Gathering
resizes the storage back and fills it from an all-gather. Autograd's saved tensors
reference the same storage, so they see the re-gathered values in backward. Writes go
through ``param.data`` (whose version counter is separate) so autograd never sees an
in-place change.

[Note: group tags]
Each segment of a stage-3 gather buffer ends with one tag element, written through an
integer view of the same width: the group's index + 1 when a rank gathers the group it
expects, minus the index + 1 of the group it wants when it deviates. After the gather every
rank reads every rank's tag, so two ranks that exchanged different groups of equal size
(which the collective itself cannot notice) both find out and raise instead of computing
with each other's weights.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerostate.dist import collectives
from zerostate.dist.comm import (
    CommContext,
    InFlight,
    PendingOp,
    PooledBuffer,
    all_reduce_flat,
    all_reduce_replicas,
    reduce_scatter_grads,
    reduce_scatter_in_place,
    start_all_gather,
)
from zerostate.runtime import hollow
from zerostate.runtime.grad_stand_in import GradStandIn
from zerostate.runtime.sharded import FlatLayout, ShardedParam
from zerostate.runtime.tp import LocalParam

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class GroupState(enum.Enum):
    """Where a group's working parameters are."""

    SHARDED = "sharded"  # only the owned slices exist
    GATHERING = "gathering"  # an all-gather is in flight
    GATHERED = "gathered"  # full parameters are materialised


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPolicy:
    """What a group partitions; see [Note: group policy]."""

    shard_optimizer: bool
    """fp32 masters and optimizer state hold only the owned range of each parameter."""
    shard_grads: bool
    """Reduce-scatter every micro-step into fp32 gradient shards."""
    shard_params: bool
    """Working parameters partitioned, gathered around their module's forward/backward."""
    prefetch: bool = True
    """Start gathering the next group while the current one computes (``shard_params``)."""
    offload_optimizer: bool = False
    """Masters and optimizer states on the host; the optimizer step runs there."""
    offload_params: bool = False
    """Parameter shards on the host too, copied to the device by their group's gather."""

    def __post_init__(self) -> None:
        if self.offload_optimizer and not self.shard_optimizer:
            raise ValueError("offload_optimizer needs shard_optimizer (stage 1 or higher)")
        if self.offload_params and not (self.shard_params and self.offload_optimizer):
            raise ValueError("offload_params needs shard_params and offload_optimizer")
        if self.shard_grads and not self.shard_optimizer:
            raise ValueError("shard_grads needs shard_optimizer (a shard has no full master)")
        if self.shard_params and not self.shard_grads:
            raise ValueError("shard_params needs shard_grads (no full gradient buffer exists)")

    @classmethod
    def for_stage(
        cls, stage: int, *, prefetch: bool = True, offload: str | None = None
    ) -> GroupPolicy:
        return cls(
            shard_optimizer=stage >= 1,
            shard_grads=stage >= 2,
            shard_params=stage >= 3,
            prefetch=prefetch,
            offload_optimizer=offload is not None,
            offload_params=offload == "params",
        )

    @property
    def accumulates_locally(self) -> bool:
        return not self.shard_grads


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ParamGroup:
    """Parameters sharded, gathered and reduced together; see the module docstring."""

    def __init__(
        self,
        index: int,
        name: str,
        params: list[ShardedParam],
        policy: GroupPolicy,
        ctx: CommContext,
    ) -> None:
        self.index = index
        self.name = name
        self.params = params
        self.trainable = [p for p in params if p.trainable]
        self.policy = policy
        self.ctx = ctx
        world, rank = ctx.world_size, ctx.rank
        self.grad_layout = FlatLayout(self.trainable, world, rank) if self.trainable else None
        self.gather_layout = (
            FlatLayout(params, world, rank, num_tags=1) if policy.shard_params and params else None
        )
        self.state = GroupState.SHARDED if policy.shard_params else GroupState.GATHERED
        self._gather: tuple[PendingOp, PooledBuffer, int] | None = None
        self._offsets: list[int] = []  # stage 0: each trainable's offset in the flat buffer
        offset = 0
        for p in self.trainable:
            self._offsets.append(offset)
            offset += p.numel
        #: Full gradients accumulated locally (stages 0-1; [Note: local accumulation layout]).
        self.acc: torch.Tensor | None = None
        #: Per trainable: its place in ``acc`` holds this window's gradient ([Note: written
        #: on arrival]); False means stale values, not zeros.
        self._written = [False] * len(self.trainable)
        #: fp32 gradient shard of the owned ranges (stages 2-3), summed over micro-steps.
        self.grad_shard: torch.Tensor | None = None
        self.fresh = True  # no gradient communicated since the last zero()
        # Per micro-step: gradients complete on this rank / communication launched.
        self.num_ready = 0
        self.ready = False
        self.launched = False
        # Stage 3, per iteration: forward calls whose post-backward is pending / done.
        self.num_backward_calls = 0
        self.num_backward_done = 0
        self.needs_backward = False
        # Between backward and step ([Note: gradient stand-ins]): one stand-in per
        # trainable parameter, made once, and the .grad each one covers while it is lent.
        self._stand_ins: list[GradStandIn] | None = None
        self._covered: list[torch.Tensor | None] | None = None

    # -- working storage -------------------------------------------------------------
    def place(self, dtype: torch.dtype) -> None:
        """Replicated parameters: cast to the working dtype, keep fp32 masters of the whole
        tensor (stage 0) or the owned range. fp32 masters alias the working storage."""
        for sp in self.params:
            original = sp.param.data.contiguous()
            lo, hi = (sp.start, sp.stop) if self.policy.shard_optimizer else (0, sp.numel)
            sp.master_start = lo
            sp.param.data = original.to(dtype)
            flat = sp.param.data.view(-1)
            sp.shard = flat[sp.start : sp.stop]
            if dtype == torch.float32:
                sp.master, sp.master_aliased = flat[lo:hi], True
            else:
                sp.master = original.view(-1)[lo:hi].to(torch.float32).clone()
        if self.trainable and self.policy.accumulates_locally:
            numel = self.grad_layout.numel if self.policy.shard_optimizer else self._offsets_end
            self.acc = torch.zeros(numel, dtype=self.ctx.reduce_dtype, device=self.ctx.device)

    @property
    def _offsets_end(self) -> int:
        return sum(p.numel for p in self.trainable)

    @property
    def _grad_views(self) -> bool:
        # Stage 0 with the reduce dtype equal to the working dtype: .grad is the buffer.
        # A DTensor's .grad must stay a DTensor ([Note: tensor parallelism]): copied.
        return (
            self.acc is not None
            and not self.policy.shard_optimizer
            and self.ctx.reduce_dtype == self.ctx.param_dtype
            and not any(isinstance(p.param, LocalParam) for p in self.trainable)
        )

    def _flat_view(self, i: int) -> torch.Tensor:
        return self.acc[self._offsets[i] : self._offsets[i] + self.trainable[i].numel]

    # -- gathering (partitioned parameters) ----------------------------------------------
    def start_gather(self, tag: int | None = None) -> bool:
        """Launch the all-gather of the full parameters; False if nothing was launched
        (already gathered or in flight)."""
        if self.state is not GroupState.SHARDED:
            return False
        layout = self.gather_layout
        if layout is None:
            self.state = GroupState.GATHERED
            return False
        tag = self.index + 1 if tag is None else tag
        op, buffer = self._launch_gather(tag)
        self._gather = (op, buffer, tag)
        self.state = GroupState.GATHERING
        return True

    def wait_gather(self) -> list[int]:
        """Complete the gather; returns every rank's tag ([Note: group tags]) without
        unpacking. The caller checks the tags, then calls :meth:`unpack_gather` (or
        :meth:`drop_gather` to discard what arrived)."""
        assert self._gather is not None, self.name
        op, buffer, _ = self._gather
        op.complete()
        return _read_tags(self.gather_layout, buffer.tensor)

    def join_gather(self) -> None:
        """Take part in another rank's gather of this group, whatever this rank holds,
        and discard what arrives ([Note: conditional units] in zerostate.runtime.schedule)."""
        if self.gather_layout is None:
            return
        op, buffer = self._launch_gather(self.index + 1)
        op.complete()
        if buffer is not None:
            self.ctx.pool.release(buffer)

    def _launch_gather(self, tag: int) -> tuple[PendingOp, PooledBuffer | None]:
        """The all-gather of this rank's shards into a pooled buffer, ``tag`` written into
        this rank's segment ([Note: group tags])."""
        layout = self.gather_layout
        return start_all_gather(
            self.ctx,
            layout,
            [p.shard for p in self.params],
            None,
            dtype=self.ctx.param_dtype,
            before_launch=lambda buf: _write_tag(layout, buf, tag),
        )

    def unpack_gather(self) -> None:
        op, buffer, _ = self._gather
        self._gather = None
        targets = []
        for p in self.params:
            hollow.restore(p.param)  # [Note: reading a parameter outside a gather]
            data = p.param.data
            data.untyped_storage().resize_(p.numel * data.element_size())
            targets.append(data.view(-1))
        with torch.no_grad():
            self.gather_layout.unpack(buffer.tensor, targets)
        self.ctx.pool.release(buffer)
        self.state = GroupState.GATHERED

    def drop_gather(self) -> None:
        if self._gather is not None:
            op, buffer, _ = self._gather
            op.complete()
            self.ctx.pool.release(buffer)
            self._gather = None
        self.state = GroupState.SHARDED

    @property
    def gather_tag(self) -> int | None:
        return None if self._gather is None else self._gather[2]

    @hollow.unguarded
    def release(self) -> None:
        """Free the full parameters (partitioned parameters only)."""
        if not self.policy.shard_params:
            return
        if self.state is GroupState.GATHERING:
            self.drop_gather()
        for p in self.params:
            p.param.data.untyped_storage().resize_(0)
            hollow.release(p.param, p.name)
        self.state = GroupState.SHARDED

    def write_back(self) -> None:
        """Copy the (possibly edited) full parameters into the shards and masters."""
        with torch.no_grad():
            for sp in self.params:
                flat = sp.param.data.view(-1)
                if self.policy.shard_params:
                    sp.shard.copy_(flat[sp.start : sp.stop])
                if not sp.master_aliased:
                    lo = sp.master_start
                    sp.master.copy_(flat[lo : lo + sp.master.numel()])

    # -- gradients -------------------------------------------------------------------
    @hollow.unguarded
    def prepare(self, *, communicate: bool) -> None:
        """Before a micro-step's backward."""
        self.num_ready = 0
        self.ready = False
        self.launched = not communicate or self.grad_layout is None
        if self._grad_views:
            self._attach_flat_grads()

    def _attach_flat_grads(self) -> None:
        # Autograd accumulates into an existing .grad in place, so a view keeps the buffer
        # as the one gradient storage (re-attached if the user replaced or dropped it). A
        # parameter without a gradient in this window keeps None ([Note: written on
        # arrival]); a .grad the user put there joins the window's sum.
        for i, p in enumerate(self.trainable):
            grad = p.param.grad
            if grad is None and not self._written[i]:
                continue
            view = self._flat_view(i).view(p.shape)
            if grad is None or grad.data_ptr() != view.data_ptr():
                self._fold(i, grad)
                p.param.grad = view

    def _fold(self, index: int, grad: torch.Tensor | None) -> None:
        """Copy (first in the window) or add ``grad`` into parameter ``index``'s place in the
        local buffer; ``None`` leaves a written place as it is ([Note: written on arrival])."""
        if grad is None:
            return
        grad = grad.reshape(-1)
        accumulate = self._written[index]
        if self.policy.shard_optimizer:
            self.grad_layout.add_param(self.acc, index, grad, accumulate=accumulate)
        elif accumulate:
            self._flat_view(index).add_(grad)
        else:
            self._flat_view(index).copy_(grad)
        self._written[index] = True

    def _zero_unwritten(self) -> None:
        """A parameter whose gradient never came this window contributes zeros."""
        for i, written in enumerate(self._written):
            if written:
                continue
            if self.policy.shard_optimizer:
                self.grad_layout.zero_param(self.acc, i)
            else:
                self._flat_view(i).zero_()
            self._written[i] = True

    def on_grad(self, index: int) -> bool:
        """Trainable parameter ``index``'s gradient was accumulated into ``.grad``; fold it
        into the local buffer if there is one. True once every one has arrived."""
        sp = self.trainable[index]
        if self.acc is not None:
            grad = sp.param.grad
            if self._grad_views:
                view = self._flat_view(index).view(sp.shape)
                if grad.data_ptr() != view.data_ptr():  # the window's first: handed over
                    self._fold(index, grad)
                    sp.param.grad = view
            else:
                self._fold(index, grad)
                sp.param.grad = None
        self.num_ready += 1
        return self.num_ready == len(self.trainable)

    @hollow.unguarded
    def launch(self, inflight: InFlight, on_complete: Callable[[], None] | None = None) -> None:
        """Communicate this micro-step's gradients (once per micro-step); ``on_complete``
        runs once this rank's reduced gradients are final ([Note: completion hooks] in
        zerostate.comm; sharded optimizer states only)."""
        assert not self.launched, self.name
        self.launched = True
        if self.acc is not None:
            self._zero_unwritten()
            if self.policy.shard_optimizer:
                reduce_scatter_in_place(
                    self.ctx, inflight, self.grad_layout, self.acc, on_complete=on_complete
                )
            else:
                all_reduce_flat(self.ctx, inflight, self.acc, on_complete=on_complete)
            return
        grads = [None if p.param.grad is None else p.param.grad.reshape(-1) for p in self.trainable]
        for p in self.trainable:
            p.param.grad = None  # the full gradient is consumed; only the shard stays
        reduce_scatter_grads(
            self.ctx,
            inflight,
            self.grad_layout,
            grads,
            self._shard(),
            accumulate=not self.fresh,
            on_complete=on_complete,
        )
        self.fresh = False

    def _shard(self) -> torch.Tensor:
        if self.grad_shard is None:
            # [Note: reduce precision]: summed in fp32 by default; a 16-bit reduce dtype
            # keeps the shard in that dtype too, as the paper counts it.
            self.grad_shard = torch.zeros(
                self.grad_layout.seg_numel, dtype=self.ctx.reduce_dtype, device=self.ctx.device
            )
        return self.grad_shard

    def step_grads(self) -> list[torch.Tensor]:
        """This rank's summed gradient of every trainable parameter, aligned with its
        master (full at stage 0, the owned range otherwise)."""
        if not self.trainable:
            return []
        if self.acc is not None and not self.policy.shard_optimizer:
            return [self._flat_view(i) for i in range(len(self.trainable))]
        views = self.reduced_grads()
        if self.ctx.predivide != 1.0:  # fp16 sums are kept pre-divided (no fp16 overflow)
            return [v.float().mul_(self.ctx.predivide) for v in views]
        return views

    def reduce_replicas(self) -> None:
        """Sum this rank's reduced gradients of the accumulation window across the replicas
        of a hybrid-sharded mesh ([Note: hybrid sharding] in zerostate.runtime.mesh): the
        whole flat buffer at stage 0, the owned segment otherwise (pre-divided in fp16)."""
        if not self.trainable:
            return
        if self.acc is not None and not self.policy.shard_optimizer:
            all_reduce_replicas(self.ctx, self.acc, predivided=False)
        elif self.acc is not None:
            all_reduce_replicas(self.ctx, self.grad_layout.segment(self.acc), predivided=True)
        else:
            all_reduce_replicas(self.ctx, self._shard(), predivided=True)

    def reduced_grads(self) -> list[torch.Tensor]:
        """The owned range of every trainable parameter's summed gradient as the reduce left
        it: in the reduce dtype, fp16 sums pre-divided (sharded optimizer states only)."""
        if self.acc is not None:
            return self.grad_layout.shard_views(self.grad_layout.segment(self.acc))
        if self.fresh:  # nothing was reduced this step
            self._shard().zero_()
        return self.grad_layout.shard_views(self.grad_shard)

    @hollow.unguarded
    def zero(self) -> None:
        """Forget the gradients of the step just taken."""
        self.fresh = True
        if self.acc is not None:
            # [Note: written on arrival]: the buffer's stale values are overwritten, not zeroed.
            self._written = [False] * len(self.trainable)
            if self._grad_views:
                for p in self.trainable:
                    p.param.grad = None
        elif not self.policy.shard_params:
            for p in self.trainable:
                p.param.grad = None

    # -- .grad between backward and step ([Note: gradient stand-ins]) ---------------
    @hollow.unguarded
    def cover_grads(self, reason: str) -> None:
        """Put a stand-in in every trainable parameter's ``.grad``, keeping what was there."""
        if self._covered is not None or not self.trainable:
            return
        holders = [_grad_holder(sp) for sp in self.trainable]
        if self._stand_ins is None:
            self._stand_ins = [
                GradStandIn(holder, sp.name, reason)
                for sp, holder in zip(self.trainable, holders, strict=True)
            ]
        self._covered = [holder.grad for holder in holders]
        for holder, stand_in in zip(holders, self._stand_ins, strict=True):
            holder.grad = stand_in

    @hollow.unguarded
    def uncover_grads(self) -> None:
        """Put back the ``.grad`` each stand-in covered (a ``.grad`` the user replaced or
        set to None meanwhile stays as the user left it)."""
        if self._covered is None:
            return
        for sp, grad in zip(self.trainable, self._covered, strict=True):
            holder = _grad_holder(sp)
            if isinstance(holder.grad, GradStandIn):
                holder.grad = grad
        self._covered = None

    # -- accounting ------------------------------------------------------------------
    def param_bytes(self) -> int:
        if self.policy.shard_params:
            return sum(_nbytes(sp.shard) for sp in self.params)
        return sum(_nbytes(sp.param.data) for sp in self.params)

    def grad_bytes(self) -> int:
        held = _nbytes(self.acc) + _nbytes(self.grad_shard)
        if not self._grad_views:  # a stand-in holds no bytes; what it covers may
            if self._covered is None:
                held += sum(_nbytes(sp.param.grad) for sp in self.trainable)
            else:
                held += sum(_nbytes(_local(g)) for g in self._covered)
        return held

    def gathered_bytes(self) -> int:
        if not self.policy.shard_params:
            return 0
        return sum(sp.param.untyped_storage().nbytes() for sp in self.params)


def _write_tag(layout: FlatLayout, buffer: torch.Tensor, tag: int) -> None:
    column = layout.tags(buffer)[layout.rank]
    column.view(_INT_OF_WIDTH[buffer.element_size()]).fill_(tag)


def _read_tags(layout: FlatLayout, buffer: torch.Tensor) -> list[int]:
    tags = layout.tags(buffer)[:, 0]
    return tags.view(_INT_OF_WIDTH[buffer.element_size()]).tolist()


def _grad_holder(sp: ShardedParam) -> torch.Tensor:
    """The tensor whose ``.grad`` a user's script sees: the DTensor parameter itself under
    tensor parallelism (a :class:`LocalParam` only lends its local shard to the engine)."""
    return sp.param.dparam if isinstance(sp.param, LocalParam) else sp.param


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    return collectives.dtensor_local(grad) if collectives.is_dtensor(grad) else grad
