"""ZeRO stages as strategies: what each stage does at each point of a training step.

The engine picks one :class:`Strategy` at construction (:func:`make_strategy`) and calls
the same hooks in the same order whatever the stage:

* ``setup()``: give every ``ShardedParam`` its fp32 master (and working storage);
* ``pre_forward()`` / ``post_forward()`` around the module's forward;
* per micro-step: ``prepare(boundary=...)``, then ``on_grad_ready(sp)`` from each
  parameter's post-accumulate-grad hook while backward runs, then ``finish_backward()``;
* at the step: ``step_grads()`` (gradient of every trainable parameter as this rank holds
  it), ``reduce_norm_and_flags()`` (make the local sum of squares and per-parameter
  gradient flags global), ``refresh(params)``
  (working parameters from the updated masters), ``zero()``.

Stage 0 and stage 1 accumulate full gradients locally between communicating micro-steps
(the last of ``grad_accum_steps``) in flat per-bucket buffers of the reduce dtype; when
that equals the working dtype the parameters' ``.grad`` are views of the buffers (autograd
accumulates in place), otherwise each micro-step's gradient is added into the buffer and
dropped (the fp32 buffer costs ``4 Psi`` bytes instead of ``2 Psi``). Stage 2 reduce-
scatters every micro-step into fp32 shards as buckets fill. Buckets are launched in a fixed
order (reverse parameter order, the order backward usually produces gradients), so every
rank issues the same collectives in the same sequence. Stage 3 lives in ``stage3.py``.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from zerostate import collectives
from zerostate.comm import (
    CommContext,
    InFlight,
    all_gather_groups,
    all_reduce_flat,
    reduce_scatter_grads,
)
from zerostate.sharded import FlatLayout, ShardedParam, split_into_buckets


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Strategy(abc.ABC):
    """One ZeRO stage's behaviour; see the module docstring for the call order."""

    def __init__(self, ctx: CommContext, params: list[ShardedParam], *, bucket_numel: int) -> None:
        self.ctx = ctx
        self.params = params
        self.trainable = [sp for sp in params if sp.trainable]
        self.bucket_numel = bucket_numel
        #: Names of tensors no initialiser wrote (stage 3 on the meta device; see
        #: [Note: unset state] in stage3.py): the engine refuses to run until they are loaded.
        self.unset: list[str] = []

    @abc.abstractmethod
    def setup(self, model: nn.Module, config: Any) -> None:
        """Give every parameter its fp32 master slice and working storage."""

    def pre_forward(self) -> None:
        """Before the module's forward (stages 0-2 hold full parameters: nothing to do)."""
        return None

    def post_forward(self) -> None:
        """After the module's forward."""
        return None

    @abc.abstractmethod
    def prepare(self, *, boundary: bool) -> None:
        """Before a micro-step's backward; ``boundary``: the last before a step."""

    @abc.abstractmethod
    def on_grad_ready(self, sp: ShardedParam) -> None:
        """``sp``'s gradient of this micro-step has been accumulated into ``.grad``."""

    @abc.abstractmethod
    def finish_backward(self) -> None:
        """After backward: launch what is left and wait for all communication."""

    @abc.abstractmethod
    def step_grads(self) -> list[torch.Tensor]:
        """Summed (unscaled) gradient of every trainable parameter as this rank holds it,
        aligned with ``master``."""

    def reduce_norm_and_flags(self, folded: torch.Tensor) -> None:
        """``folded`` is ``[this rank's sum of squared gradient elements, one flag per
        trainable parameter]``; sum both over the ranks, in place, in one all-reduce."""
        collectives.all_reduce(folded, group=self.ctx.group, stats=self.ctx.stats)

    @abc.abstractmethod
    def refresh(self, params: list[ShardedParam] | None = None) -> None:
        """Rebuild working values from the masters: of the trainable parameters after an
        optimizer step (``None``; communication counted), or of ``params`` after their
        masters were overwritten (a load; not counted)."""

    @abc.abstractmethod
    def zero(self) -> None:
        """Forget the gradients of the step just taken."""

    @abc.abstractmethod
    def full_masters(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        """Full flat fp32 values of ``params`` (collective)."""

    def gather_full(
        self, params: list[ShardedParam], shards: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Full flat fp32 tensors from every rank's slice ``shards[i]`` of ``params[i]``,
        aligned like the masters (collective; counted as step traffic)."""
        return gather_full_values(self.ctx, params, shards, self.bucket_numel, counted=True)

    @abc.abstractmethod
    def bytes_held(self) -> dict[str, int]:
        """Bytes of working parameters, gradients and in-flight buffers this rank holds."""


def place_masters(params: list[ShardedParam], dtype: torch.dtype, *, full: bool) -> None:
    """Cast parameters to the working dtype and keep fp32 masters of the whole tensor
    (``full``) or of the owned range. fp32 masters alias the working storage."""
    for sp in params:
        p = sp.param
        original = p.data.contiguous()
        lo, hi = (0, sp.numel) if full else (sp.start, sp.stop)
        sp.master_start = lo
        p.data = original.to(dtype)
        if dtype == torch.float32:
            sp.master, sp.master_aliased = p.data.view(-1)[lo:hi], True
        else:
            sp.master = original.view(-1)[lo:hi].to(torch.float32).clone()


class _Bucket:
    def __init__(self, params: list[ShardedParam], ctx: CommContext) -> None:
        self.params = params
        self.numel = sum(p.numel for p in params)
        self.layout = FlatLayout(params, ctx.world_size, ctx.rank)
        self.offsets: dict[int, int] = {}
        offset = 0
        for p in params:
            self.offsets[id(p)] = offset
            offset += p.numel
        self.flat: torch.Tensor | None = None  # full gradients accumulated locally
        self.shard: torch.Tensor | None = None  # fp32 owned slices, summed over ranks
        self.fresh = True  # shard holds nothing since the last zero()
        self.num_ready = 0

    def flat_views(self) -> list[torch.Tensor]:
        return [self.flat_view(p) for p in self.params]

    def flat_view(self, p: ShardedParam) -> torch.Tensor:
        offset = self.offsets[id(p)]
        return self.flat[offset : offset + p.numel]


class _BucketStrategy(Strategy):
    """Stages 0-2: working parameters replicated, gradients communicated per bucket."""

    #: Whether full gradients are summed locally until the boundary micro-step.
    accumulates_locally = True

    def __init__(self, ctx: CommContext, params: list[ShardedParam], **kw: Any) -> None:
        super().__init__(ctx, params, **kw)
        self.buckets = [
            _Bucket(b, ctx)
            for b in split_into_buckets(list(reversed(self.trainable)), self.bucket_numel)
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._views = ctx.reduce_dtype == ctx.param_dtype
        if self.accumulates_locally:
            for b in self.buckets:
                b.flat = torch.zeros(b.numel, dtype=ctx.reduce_dtype, device=ctx.device)
        self._inflight = InFlight()
        self._next = 0
        self._sync = False

    def prepare(self, *, boundary: bool) -> None:
        self._sync = boundary or not self.accumulates_locally
        self._next = 0
        for b in self.buckets:
            b.num_ready = 0
        if self.accumulates_locally and self._views:
            self._attach_flat_grads()

    def _attach_flat_grads(self) -> None:
        # Autograd accumulates into an existing .grad in place, so a view keeps the bucket
        # as the one gradient storage (re-attached if the user replaced or dropped it).
        for b in self.buckets:
            for p, view in zip(b.params, b.flat_views(), strict=True):
                view = view.view(p.shape)
                grad = p.param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    if grad is not None:
                        view.copy_(grad)
                    p.param.grad = view

    def on_grad_ready(self, sp: ShardedParam) -> None:
        bucket = self._bucket_of[id(sp)]
        if self.accumulates_locally and not self._views:
            bucket.flat_view(sp).add_(sp.param.grad.reshape(-1))
            sp.param.grad = None
        if not self._sync:
            return
        bucket.num_ready += 1
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch(nxt)
            self._next += 1

    @abc.abstractmethod
    def _launch(self, bucket: _Bucket) -> None: ...

    def finish_backward(self) -> None:
        if self._sync:
            for bucket in self.buckets[self._next :]:
                self._launch(bucket)
            self._next = len(self.buckets)
        self._inflight.drain()

    def bytes_held(self) -> dict[str, int]:
        grads = sum(_nbytes(b.flat) + _nbytes(b.shard) for b in self.buckets)
        grads += sum(
            _nbytes(sp.param.grad)
            for sp in self.trainable
            if not (self.accumulates_locally and self._views)
        )
        params = sum(_nbytes(sp.param.data) for sp in self.params)
        return {"params": params, "grads": grads, "in_flight": 0}


class ReplicatedStrategy(_BucketStrategy):
    """Stage 0: plain data parallelism; every rank holds and updates the whole model."""

    def setup(self, model: nn.Module, config: Any) -> None:
        place_masters(self.params, self.ctx.param_dtype, full=True)

    def _launch(self, bucket: _Bucket) -> None:
        all_reduce_flat(self.ctx, self._inflight, bucket.flat)

    def step_grads(self) -> list[torch.Tensor]:
        views = {
            id(p): v for b in self.buckets for p, v in zip(b.params, b.flat_views(), strict=True)
        }
        return [views[id(sp)] for sp in self.trainable]

    def reduce_norm_and_flags(self, folded: torch.Tensor) -> None:
        # The gradients are already the full, identical sum on every rank: one copy of the
        # squares counts; the flags still need every rank's (a rank may see no gradient).
        if self.ctx.rank != 0:
            folded[:1].zero_()
        super().reduce_norm_and_flags(folded)

    def refresh(self, params: list[ShardedParam] | None = None) -> None:
        targets = self.trainable if params is None else params
        pairs = [(sp.param.data.view(-1), sp.master) for sp in targets if not sp.master_aliased]
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])

    def zero(self) -> None:
        for b in self.buckets:
            b.flat.zero_()

    def full_masters(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        return [sp.master.clone() for sp in params]

    def gather_full(
        self, params: list[ShardedParam], shards: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        return [t.reshape(-1) for t in shards]  # masters (and so the shards) are whole here


class PartitionedStrategy(_BucketStrategy):
    """Stages 1 and 2: optimizer states (1) and gradients (2) partitioned.

    Stage 1 sums full gradients locally and reduce-scatters them on the boundary
    micro-step; stage 2 reduce-scatters every micro-step as buckets fill and keeps only
    the fp32 shard. After the step, updated masters are all-gathered bucket by bucket.
    """

    def __init__(self, ctx: CommContext, params: list[ShardedParam], *, stage: int, **kw: Any):
        self.accumulates_locally = stage == 1
        super().__init__(ctx, params, **kw)

    def setup(self, model: nn.Module, config: Any) -> None:
        place_masters(self.params, self.ctx.param_dtype, full=False)

    def _shard(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.shard is None:
            bucket.shard = torch.zeros(
                bucket.layout.seg_numel, dtype=torch.float32, device=self.ctx.device
            )
            for p, view in zip(bucket.params, bucket.layout.shard_views(bucket.shard), strict=True):
                p.grad_shard = view
        return bucket.shard

    def _launch(self, bucket: _Bucket) -> None:
        if self.accumulates_locally:
            grads: list[torch.Tensor | None] = bucket.flat_views()
        else:
            grads = [
                None if p.param.grad is None else p.param.grad.reshape(-1) for p in bucket.params
            ]
            for p in bucket.params:
                p.param.grad = None  # the full gradient is consumed; only the shard stays
        shard = self._shard(bucket)
        reduce_scatter_grads(
            self.ctx, self._inflight, bucket.layout, grads, shard, accumulate=not bucket.fresh
        )
        bucket.fresh = False

    def step_grads(self) -> list[torch.Tensor]:
        for b in self.buckets:
            if b.fresh:  # nothing was reduced this step (no backward reached it)
                self._shard(b).zero_()
        return [sp.grad_shard for sp in self.trainable]

    def refresh(self, params: list[ShardedParam] | None = None) -> None:
        if params is None:
            groups = [b.params for b in self.buckets]
            layouts = [b.layout for b in self.buckets]
        else:
            groups = split_into_buckets(params, self.bucket_numel)
            layouts = [FlatLayout(g, self.ctx.world_size, self.ctx.rank) for g in groups]
        all_gather_groups(
            self.ctx,
            layouts,
            [[p.master for p in g] for g in groups],
            [[p.param.data.view(-1) for p in g] for g in groups],
            dtype=self.ctx.param_dtype,
            counted=params is None,
        )

    def zero(self) -> None:
        for b in self.buckets:
            b.fresh = True
            if self.accumulates_locally:
                b.flat.zero_()
                # Stage 1 holds full gradients between steps, not shards: free them.
                b.shard = None
                for p in b.params:
                    p.grad_shard = None
            else:
                for p in b.params:
                    p.param.grad = None

    def full_masters(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        return gather_full_masters(self.ctx, params, self.bucket_numel)


def gather_full_masters(
    ctx: CommContext, params: list[ShardedParam], bucket_numel: int
) -> list[torch.Tensor]:
    """Full fp32 flat values of ``params`` from every rank's owned master slices."""
    return gather_full_values(ctx, params, [sp.master for sp in params], bucket_numel)


def gather_full_values(
    ctx: CommContext,
    params: list[ShardedParam],
    shards: list[torch.Tensor],
    bucket_numel: int,
    *,
    counted: bool = False,
) -> list[torch.Tensor]:
    """Full fp32 flat tensors from every rank's owned slice ``shards[i]`` of ``params[i]``
    (masters for export, an optimizer's update matrices for Muon)."""
    full = [torch.empty(sp.numel, dtype=torch.float32, device=ctx.device) for sp in params]
    index = {id(sp): i for i, sp in enumerate(params)}
    groups = split_into_buckets(params, bucket_numel)
    all_gather_groups(
        ctx,
        [FlatLayout(g, ctx.world_size, ctx.rank) for g in groups],
        [[shards[index[id(p)]].reshape(-1) for p in g] for g in groups],
        [[full[index[id(p)]] for p in g] for g in groups],
        dtype=torch.float32,
        counted=counted,
    )
    return full


def make_strategy(
    stage: int, ctx: CommContext, params: list[ShardedParam], *, bucket_numel: int, config: Any
) -> Strategy:
    """The strategy object for ``stage`` (the only place the engine's stage is looked at)."""
    if stage == 0:
        return ReplicatedStrategy(ctx, params, bucket_numel=bucket_numel)
    if stage in (1, 2):
        return PartitionedStrategy(ctx, params, stage=stage, bucket_numel=bucket_numel)
    from zerostate.stage3 import Stage3Strategy

    return Stage3Strategy(ctx, params, bucket_numel=bucket_numel, config=config)
