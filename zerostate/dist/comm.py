"""The collective patterns of training, written once: every stage uses these.

In the spirit of FSDP2's ``foreach_reduce`` / ``foreach_all_gather``: a group of
parameters ([Note: bucket layout] in ``sharded.py``) is packed into one pooled buffer, one
collective is launched asynchronously, at most ``max_in_flight`` launches stay pending (the
oldest is completed first, which bounds buffer memory), and completing a launch
accumulates or unpacks its result and returns the buffers to the pool.

* :func:`reduce_scatter_grads`: full gradients -> this rank's fp32 gradient shard (summed
  into it across micro-steps). Stages 2 and 3.
* :func:`reduce_scatter_in_place`: a locally accumulated rank-segmented buffer -> this
  rank's segment of it. Stage 1.
* :func:`all_reduce_flat`: a full flat gradient buffer, summed in place. Stage 0.
* :func:`start_all_gather` / :class:`PendingOp` ``complete()``: owned slices -> full
  tensors. Stages 1-2 after the step, stage 3 per unit, and exports / loads.
* :func:`all_reduce_replicas`: a reduced gradient (shard) summed across the replicas of a
  hybrid-sharded mesh ([Note: hybrid sharding] in zerostate.runtime.mesh).

[Note: reduce precision]
Gradients are communicated in ``CommContext.reduce_dtype`` (``EngineConfig.reduce_dtype``,
fp32 by default) and accumulated over micro-steps in buffers of that dtype: fp32 whatever
the working dtype by default; with a 16-bit reduce dtype the gradient shards are 16-bit
too, the 2 bytes per element the ZeRO paper counts. The engine divides the sums once, in
fp32, at the step. When the reduce dtype is fp16,
inputs are pre-divided by ``predivide`` (a power of two near ``sqrt(world_size)``, so the
division is exact) against overflow, and the result is multiplied back in fp32.

[Note: single rank]
With one rank every collective is the identity on its data: a reduce-scatter's output is its
input, an all-gather's buffer already holds its only segment, an all-reduce changes nothing.
The patterns then do only their local work (pack, accumulate, unpack, the completion hooks)
and hand nothing to torch.distributed: gloo moves a one-rank collective at about a tenth of
copy speed (68 MB: 43 ms against 6 ms for ``copy_``, measured on this machine), which made
a one-process step pay for traffic that goes nowhere. Everything around the collective
(buffers, pending ops, their order and hooks) takes the same lines at every world size, and
the communication counters, which count what is handed to torch.distributed, stay at zero.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.dist.collectives import CommStats, Handle
from zerostate.runtime.sharded import FlatLayout

#: Launched collectives kept pending before the oldest is completed (bounds buffer memory).
MAX_IN_FLIGHT = 2


class PooledBuffer:
    """A buffer lent by :class:`BufferPool`: ``tensor`` is exactly the requested size."""

    __slots__ = ("storage", "tensor")

    def __init__(self, storage: torch.Tensor, numel: int) -> None:
        self.storage = storage
        self.tensor = storage[:numel]


class BufferPool:
    """Flat communication buffers, reused across buckets, units and steps.

    ``acquire`` lends the smallest free buffer that fits (or allocates one) as a handle;
    ``release`` takes the handle back. Buffers are never freed, so steady-state training
    allocates nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> PooledBuffer:
        fits = [i for i, b in enumerate(self._free) if b.dtype == dtype and b.numel() >= numel]
        if fits:
            storage = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            storage = torch.empty(numel, dtype=dtype, device=self.device)
            self._bytes += storage.numel() * storage.element_size()
        return PooledBuffer(storage, numel)

    def release(self, buffer: PooledBuffer) -> None:
        self._free.append(buffer.storage)

    @property
    def allocated_bytes(self) -> int:
        return self._bytes


def fp16_predivide_factor(world_size: int) -> float:
    """Power of two closest below ``sqrt(world_size)`` (1 for one or two ranks)."""
    return float(2 ** int(math.floor(math.log2(math.sqrt(world_size)))))


@dataclass(kw_only=True)
class Replicas:
    """The ``dp_replicate`` dimension of a hybrid-sharded mesh: its group, this rank's
    coordinate in it, its size and its own communication counters."""

    group: Any
    rank: int
    size: int
    stats: CommStats


@dataclass(kw_only=True)
class CommContext:
    """Everything a collective pattern needs, passed around as one object.

    ``group`` / ``rank`` / ``world_size`` are the group ZeRO partitions over; ``replicas``
    is the dimension that group is replicated over (hybrid sharding), or None."""

    group: Any
    rank: int
    world_size: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    stats: CommStats
    pool: BufferPool
    replicas: Replicas | None = None
    predivide: float = field(init=False)

    def __post_init__(self) -> None:
        # Against overflow of the sum over every data-parallel rank, replicas included.
        self.predivide = (
            fp16_predivide_factor(self.num_data_parallel)
            if self.reduce_dtype == torch.float16
            else 1.0
        )

    @property
    def num_data_parallel(self) -> int:
        """Ranks whose gradients are summed: ``world_size`` times the replicas."""
        return self.world_size * (1 if self.replicas is None else self.replicas.size)

    @property
    def device(self) -> torch.device:
        return self.pool.device


#: A launched collective at one rank ([Note: single rank]): nothing to wait for.
_LOCAL = Handle(None)


class PendingOp:
    """A launched collective and what completing it does (accumulate, unpack, release),
    then ``on_complete``: the caller's hook on the finished result ([Note: completion hooks])."""

    __slots__ = ("handle", "on_done", "on_complete", "done")

    def __init__(
        self,
        handle: Handle,
        on_done: Callable[[], None] | None,
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.on_done = on_done
        self.on_complete = on_complete
        self.done = False

    def complete(self) -> None:
        """Wait for the collective and run its completion once; idempotent."""
        if self.done:
            return
        self.done = True
        self.handle.wait()
        if self.on_done is not None:
            self.on_done()
        if self.on_complete is not None:
            self.on_complete()


def _finished(handle: Handle) -> bool:
    work = handle.work
    if work is None:
        return True
    query = getattr(work, "is_completed", None)  # a Work that cannot say is waited for
    return query is not None and bool(query())


class InFlight:
    """Launched collectives, oldest first; ``make_room`` keeps at most ``limit`` pending.

    [Note: completion hooks]
    A gradient reduce takes an ``on_complete`` hook that runs once its result is final: when
    the op is waited for to make room for a later launch, found finished by :meth:`poll`
    (every launch polls first), or drained at the end of backward. Hooks therefore run in
    launch order, while backward continues, on the thread that runs backward. Offload uses
    it to start each group's device -> host gradient copy as soon as its reduce is done
    ([Note: offload] in zerostate.runtime.offload).
    """

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self.limit = limit
        self._pending: deque[PendingOp] = deque()

    def add(self, op: PendingOp) -> PendingOp:
        self._pending.append(op)
        return op

    def make_room(self) -> None:
        self.poll()
        while len(self._pending) >= self.limit:
            self._pending.popleft().complete()

    def poll(self) -> None:
        """Complete, oldest first, the launches whose collective has already finished (so
        their completion hooks run as early as possible), stopping at the first that has
        not; never blocks."""
        while self._pending and _finished(self._pending[0].handle):
            self._pending.popleft().complete()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().complete()

    def __len__(self) -> int:
        return len(self._pending)


def reduce_scatter_grads(
    ctx: CommContext,
    inflight: InFlight,
    layout: FlatLayout,
    grads: Sequence[torch.Tensor | None],
    shard: torch.Tensor,
    *,
    accumulate: bool,
    on_complete: Callable[[], None] | None = None,
) -> None:
    """Sum full flat ``grads`` (``None``: zeros) over ranks into this rank's ``shard``
    (``layout.seg_numel`` elements; ``accumulate`` adds to it, else overwrites it).

    Launches asynchronously; the shard is final once ``inflight`` completed the launch,
    which then runs ``on_complete`` ([Note: completion hooks]).
    An fp32 shard receives the true sum; a shard in the (16-bit) reduce dtype keeps the
    pre-divided sum, which the reader multiplies by ``ctx.predivide`` in fp32. See
    [Note: reduce precision].
    """
    inflight.make_room()
    scale = ctx.predivide if shard.dtype == torch.float32 else 1.0
    direct = not accumulate and scale == 1.0 and shard.dtype == ctx.reduce_dtype
    single = ctx.world_size == 1  # [Note: single rank]
    if single and direct:
        layout.pack(shard, grads)  # the sum over one rank is its own gradient
        inflight.add(PendingOp(_LOCAL, None, on_complete))
        return
    source = ctx.pool.acquire(layout.numel, ctx.reduce_dtype)
    layout.pack(source.tensor, grads)
    if ctx.predivide != 1.0:
        source.tensor.div_(ctx.predivide)
    if single:
        result, handle = source, _LOCAL
    else:
        result = None if direct else ctx.pool.acquire(layout.seg_numel, ctx.reduce_dtype)
        out = shard if result is None else result.tensor
        handle = collectives.reduce_scatter(
            out, source.tensor, group=ctx.group, stats=ctx.stats, async_op=True
        )

    def done() -> None:
        if result is not None:
            # In the shard's dtype: multiplying back in fp16 would overflow.
            if accumulate:
                shard.add_(result.tensor, alpha=scale)
            else:
                shard.copy_(result.tensor).mul_(scale)
            if result is not source:
                ctx.pool.release(result)
        ctx.pool.release(source)

    inflight.add(PendingOp(handle, done, on_complete))


def reduce_scatter_in_place(
    ctx: CommContext,
    inflight: InFlight,
    layout: FlatLayout,
    buffer: torch.Tensor,
    *,
    on_complete: Callable[[], None] | None = None,
) -> None:
    """Sum a rank-segmented buffer over ranks into this rank's own segment of it.

    The other segments are left undefined. With an fp16 reduce dtype the inputs are
    pre-divided and the segment is *not* multiplied back (that would overflow in fp16): the
    caller multiplies by ``ctx.predivide`` once it has the values in fp32. ``on_complete``
    runs once the segment is final ([Note: completion hooks]).
    """
    inflight.make_room()
    if ctx.predivide != 1.0:
        buffer.div_(ctx.predivide)
    handle = _LOCAL
    if ctx.world_size > 1:  # [Note: single rank]: one rank's segment is the whole buffer
        handle = collectives.reduce_scatter(
            layout.segment(buffer), buffer, group=ctx.group, stats=ctx.stats, async_op=True
        )
    inflight.add(PendingOp(handle, None, on_complete))


def all_reduce_flat(
    ctx: CommContext,
    inflight: InFlight,
    flat: torch.Tensor,
    *,
    on_complete: Callable[[], None] | None = None,
) -> None:
    """Sum a full flat gradient buffer over ranks, in place (asynchronously); then
    ``on_complete`` ([Note: completion hooks])."""
    inflight.make_room()
    if ctx.world_size == 1:  # [Note: single rank]
        inflight.add(PendingOp(_LOCAL, None, on_complete))
        return
    if ctx.predivide != 1.0:
        flat.div_(ctx.predivide)
    handle = collectives.all_reduce(flat, group=ctx.group, stats=ctx.stats, async_op=True)
    factor = ctx.predivide
    multiply_back = (lambda: flat.mul_(factor)) if factor != 1.0 else None
    inflight.add(PendingOp(handle, multiply_back, on_complete))


def all_reduce_replicas(ctx: CommContext, reduced: torch.Tensor, *, predivided: bool) -> None:
    """Sum ``reduced`` (a gradient already summed over ``ctx.group``) over the replicas, in
    place, blocking; nothing without replicas. ``predivided``: a 16-bit ``reduced`` keeps
    sums pre-divided by ``ctx.predivide`` ([Note: reduce precision]); otherwise a 16-bit
    one is divided for the collective and multiplied back, exactly (a power of two)."""
    replicas = ctx.replicas
    if replicas is None or replicas.size == 1:  # [Note: single rank]
        return
    factor = 1.0 if predivided or reduced.dtype == torch.float32 else ctx.predivide
    if factor != 1.0:
        reduced.div_(factor)
    collectives.all_reduce(reduced, group=replicas.group, stats=replicas.stats)
    if factor != 1.0:
        reduced.mul_(factor)


def start_all_gather(
    ctx: CommContext,
    layout: FlatLayout,
    shards: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    *,
    dtype: torch.dtype,
    counted: bool = True,
    before_launch: Callable[[torch.Tensor], None] | None = None,
) -> tuple[PendingOp, PooledBuffer | None]:
    """Launch the all-gather that rebuilds full tensors from every rank's ``shards``.

    ``shards[i]`` is this rank's owned slice of ``layout.params[i]``. With ``targets``
    (full flat tensors) completing the op unpacks into them and returns the buffer to the
    pool (no buffer is returned); without, the caller unpacks the returned buffer itself and
    releases it.
    ``before_launch(buffer)`` runs once this rank's segment is packed (to write tags).
    """
    if ctx.world_size == 1 and targets is not None:
        # [Note: single rank]: this rank's shards are the whole tensors.
        _copy_unaliased(list(targets), list(shards))
        return PendingOp(_LOCAL, None), None
    buffer = ctx.pool.acquire(layout.numel, dtype)
    segment = layout.segment(buffer.tensor)
    torch._foreach_copy_(layout.shard_views(segment), list(shards))
    if before_launch is not None:
        before_launch(buffer.tensor)
    handle = _LOCAL
    if ctx.world_size > 1:
        handle = collectives.all_gather(
            buffer.tensor,
            segment,
            group=ctx.group,
            stats=ctx.stats if counted else None,
            async_op=True,
        )
    if targets is None:
        return PendingOp(handle, None), buffer

    def done() -> None:
        with torch.no_grad():
            layout.unpack(buffer.tensor, targets)
        ctx.pool.release(buffer)

    return PendingOp(handle, done), buffer


def all_gather_groups(
    ctx: CommContext,
    layouts: Sequence[FlatLayout],
    shards: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[Sequence[torch.Tensor]],
    *,
    dtype: torch.dtype,
    counted: bool = True,
) -> None:
    """All-gather several parameter groups into full ``targets``, pipelined; blocking.
    Large parameters whose targets are of ``dtype`` are gathered in place where the backend
    allows ([Note: in-place gathers])."""
    inflight = InFlight()
    for layout, group_shards, group_targets in zip(layouts, shards, targets, strict=True):
        in_place = _in_place_members(ctx, layout, group_targets, dtype)
        if in_place:
            inflight.make_room()
            inflight.add(
                _all_gather_in_place(
                    ctx,
                    layout,
                    [(i, group_shards[i], group_targets[i]) for i in in_place],
                    counted=counted,
                )
            )
            chosen = set(in_place)
            packed = [i for i in range(len(layout.params)) if i not in chosen]
            if not packed:
                continue
            layout = FlatLayout([layout.params[i] for i in packed], layout.world_size, layout.rank)
            group_shards = [group_shards[i] for i in packed]
            group_targets = [group_targets[i] for i in packed]
        inflight.make_room()
        op, _ = start_all_gather(
            ctx, layout, group_shards, group_targets, dtype=dtype, counted=counted
        )
        inflight.add(op)
    inflight.drain()


#: Smallest range one rank owns of a parameter gathered in place ([Note: in-place gathers]):
#: below it, ``world_size`` more collectives cost more than packing and unpacking them.
IN_PLACE_MIN_PIECE = 1 << 20


def _in_place_members(
    ctx: CommContext,
    layout: FlatLayout,
    targets: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> list[int]:
    """[Note: in-place gathers]
    Packing every rank's shards into one buffer and unpacking it into the full tensors
    copies each gathered element twice more than the collective itself. Where the backend
    runs an all-gather as one rooted collective per segment anyway (gloo, [Note: gloo
    segments]), a parameter needs no buffer: its full flat tensor already has every rank's
    owned range in place ([Note: bucket layout]), so each range is broadcast from its owner
    straight into the tensor, and a shard that is a view of its own range (an fp32 master
    aliasing the working parameter) is not copied at all. That costs ``world_size``
    collectives per parameter, so only parameters whose per-rank range holds at least
    :data:`IN_PLACE_MIN_PIECE` elements go this way; the others share a packed buffer as
    before. Measured at stage 1 on 2 shared cores (quiet, ms of ``step()``, packed against
    in place): 3 x Linear(3072, 3072), 2 ranks 65-68 / 51-53, 4 ranks 118-120 / 101-104;
    the 8 x Linear(1024, 1024) MLP (512K and 256K elements a rank), 2 ranks 22 / 21-22, 4
    ranks 43-44 / 55-59; GPT-2 small (parameters of 65K-262K), 4 ranks 24 / 57-67: each
    collective's fixed cost outweighs the copies it saves until a rank's range is about a
    million elements. The choice depends on sizes and dtypes only, so every rank makes the
    same one and issues the same collectives."""
    if ctx.world_size == 1 or not targets:
        return []
    if not collectives.gathers_in_place(targets[0], ctx.group):
        return []
    return [
        i
        for i, (p, t) in enumerate(zip(layout.params, targets, strict=True))
        if layout.chunks[i] >= IN_PLACE_MIN_PIECE and t.dtype == dtype and t.is_contiguous()
    ]


def _all_gather_in_place(
    ctx: CommContext,
    layout: FlatLayout,
    members: list[tuple[int, torch.Tensor, torch.Tensor]],
    *,
    counted: bool,
) -> PendingOp:
    """[Note: in-place gathers]: ``members`` are ``(index in layout, shard, full target)``."""
    pieces: list[list[torch.Tensor]] = [[] for _ in range(ctx.world_size)]
    for i, shard, full in members:
        c, numel = layout.chunks[i], layout.params[i].numel
        for r in range(ctx.world_size):
            piece = full[r * c : min((r + 1) * c, numel)]
            if not piece.numel():
                continue
            if r == ctx.rank and piece.data_ptr() != shard.data_ptr():
                piece.copy_(shard)
            pieces[r].append(piece)
    handle = collectives.all_gather_in_place(
        pieces, group=ctx.group, stats=ctx.stats if counted else None
    )
    return PendingOp(handle, None)


def _copy_unaliased(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    # A fp32 master can be the working storage itself (same bytes): nothing to copy then.
    pairs = [
        (t, s)
        for t, s in zip(targets, sources, strict=True)
        if t.numel() and not (t.data_ptr() == s.data_ptr() and t.dtype == s.dtype)
    ]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
