"""Gradient and parameter communication for stages 0, 1 and 2.

Phases of one optimizer step (K = grad_accum_steps micro-steps):

* every micro-step that communicates (stage 0/1: the last of the K; stage 2: all K), the
  post-accumulate-grad hook marks a parameter ready; a bucket whose parameters are all
  ready is launched asynchronously while backward continues. Buckets are launched in a
  fixed order (reverse parameter order, the order backward usually produces gradients),
  so every rank issues the same collectives in the same sequence.

  - stage 0: ``.grad`` of every parameter is a view into its bucket's flat buffer (autograd
    accumulates into it in place), and the bucket is all-reduced in place.
  - stages 1/2: gradients are packed into a pooled buffer ([Note: bucket layout]), the full
    ``.grad`` is dropped, and a reduce-scatter leaves this rank's slices in the bucket's
    persistent shard buffer (stage 2 sums each micro-step into it).
* after backward: buckets not yet launched (parameters that got no gradient) are launched
  with zeros in place of the missing gradients, and everything is awaited.
* after the optimizer step (stages 1/2): updated master shards are cast to the working
  dtype and all-gathered, bucket by bucket, into the full parameters.

Sums are left unscaled here; the engine divides by ``world_size * grad_accum_steps`` (and
the loss scale) once, in fp32, on the shards.
"""

from __future__ import annotations

from typing import Any

import torch

from zerostate import collectives
from zerostate.collectives import CommStats, Handle
from zerostate.sharded import BufferPool, ShardBucket, ShardedParam, split_into_buckets

#: Launched collectives kept in flight before the oldest is awaited (bounds buffer memory).
MAX_IN_FLIGHT = 2


class _Bucket:
    def __init__(self, params: list[ShardedParam], world_size: int, rank: int) -> None:
        self.params = params
        self.layout = ShardBucket(params, world_size, rank)
        self.flat: torch.Tensor | None = None  # stage 0: the gradients themselves
        self.shard: torch.Tensor | None = None  # stages 1/2: this rank's summed slices
        self.has_grad = False  # shard holds a sum since the last zero()
        self.num_ready = 0
        self.launched = False


class GradReducer:
    def __init__(
        self,
        params: list[ShardedParam],
        *,
        stage: int,
        world_size: int,
        rank: int,
        dtype: torch.dtype,
        bucket_numel: int,
        group: Any,
        stats: CommStats,
        pool: BufferPool,
    ) -> None:
        self.stage = stage
        self.world_size = world_size
        self.dtype = dtype
        self.group = group
        self.stats = stats
        self.pool = pool
        self.buckets = [
            _Bucket(b, world_size, rank)
            for b in split_into_buckets(list(reversed(params)), bucket_numel)
        ]
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p.param)] = bucket
            if stage == 0:
                numel = sum(p.numel for p in bucket.params)
                bucket.flat = torch.zeros(numel, dtype=dtype, device=pool.device)
        self._next = 0
        self._pending: list[tuple[Handle, _Bucket, torch.Tensor, torch.Tensor | None]] = []
        self.sync = False

    # -- backward ---------------------------------------------------------------------
    def prepare(self, sync: bool) -> None:
        """Before a backward; ``sync`` says whether this micro-step communicates."""
        self.sync = sync
        self._next = 0
        for bucket in self.buckets:
            bucket.num_ready = 0
            bucket.launched = False
        if self.stage == 0:
            self._attach_flat_grads()

    def _attach_flat_grads(self) -> None:
        # Autograd accumulates into an existing .grad in place, so a view keeps the bucket
        # as the one gradient storage (re-attached if the user replaced or dropped it).
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                view = bucket.flat[offset : offset + p.numel].view(p.shape)
                grad = p.param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    if grad is not None:
                        view.copy_(grad)
                    p.param.grad = view
                offset += p.numel

    def on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.num_ready += 1
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch(nxt)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if self.stage == 0:
            handle = collectives.all_reduce(
                bucket.flat, group=self.group, stats=self.stats, async_op=True
            )
            self._pending.append((handle, bucket, bucket.flat, None))
            return
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._complete_oldest()
        layout = bucket.layout
        buffer = self.pool.acquire(layout.numel, self.dtype)[: layout.numel]
        grads = [p.param.grad for p in bucket.params]
        layout.pack(buffer, [None if g is None else g.reshape(-1) for g in grads])
        for p in bucket.params:
            p.param.grad = None  # the full gradient is consumed; only the shard stays
        if bucket.shard is None:
            bucket.shard = torch.zeros(layout.seg_numel, dtype=self.dtype, device=buffer.device)
            for p, view in zip(bucket.params, layout.shard_views(bucket.shard), strict=True):
                p.grad_shard = view
        temp = None
        out = bucket.shard
        if bucket.has_grad:
            temp = self.pool.acquire(layout.seg_numel, self.dtype)[: layout.seg_numel]
            out = temp
        bucket.has_grad = True
        handle = collectives.reduce_scatter(
            out, buffer, group=self.group, stats=self.stats, async_op=True
        )
        self._pending.append((handle, bucket, buffer, temp))

    def _complete_oldest(self) -> None:
        handle, bucket, buffer, temp = self._pending.pop(0)
        handle.wait()
        if self.stage == 0:
            return
        if temp is not None:
            bucket.shard.add_(temp)
            self.pool.release(temp._base if temp._base is not None else temp)
        self.pool.release(buffer._base if buffer._base is not None else buffer)

    def finish(self) -> None:
        """After backward: launch what is left (in order) and wait for everything."""
        if self.sync:
            for bucket in self.buckets[self._next :]:
                self._launch(bucket)
            self._next = len(self.buckets)
        while self._pending:
            self._complete_oldest()

    # -- step -------------------------------------------------------------------------
    def step_grads(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        """Summed gradient of each parameter as this rank holds it (stage 0: the full
        flat gradient; stages 1/2: the owned slice), in the working dtype."""
        if self.stage == 0:
            return [p.param.grad.view(-1) for p in params]
        for bucket in self.buckets:
            if bucket.shard is not None and not bucket.has_grad:
                bucket.shard.zero_()
        return [p.grad_shard for p in params]

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.has_grad = False
            if self.stage == 0:
                bucket.flat.zero_()
            elif self.stage == 1:
                # Stage 1 holds full gradients between steps, not shards: free them.
                bucket.shard = None
                for p in bucket.params:
                    p.grad_shard = None
                    p.param.grad = None
            else:
                for p in bucket.params:
                    p.param.grad = None

    def gather_params(self) -> None:
        """All-gather the updated master shards into the full working parameters."""
        pending: list[tuple[Handle, _Bucket, torch.Tensor]] = []

        def complete() -> None:
            handle, bucket, buffer = pending.pop(0)
            handle.wait()
            with torch.no_grad():
                bucket.layout.unpack(buffer, [p.param.data.view(-1) for p in bucket.params])
            self.pool.release(buffer._base if buffer._base is not None else buffer)

        for bucket in self.buckets:
            while len(pending) >= MAX_IN_FLIGHT:
                complete()
            pending.append(self._launch_gather(bucket))
        while pending:
            complete()

    def _launch_gather(self, bucket: _Bucket) -> tuple[Handle, _Bucket, torch.Tensor]:
        layout = bucket.layout
        buffer = self.pool.acquire(layout.numel, self.dtype)[: layout.numel]
        segment = layout.segment(buffer)
        torch._foreach_copy_(layout.shard_views(segment), [p.master for p in bucket.params])
        handle = collectives.all_gather(
            buffer, segment, group=self.group, stats=self.stats, async_op=True
        )
        return handle, bucket, buffer

    def buffer_bytes(self) -> int:
        """Bytes of stage-0 flat gradient buffers and stage-1/2 shard buffers."""
        total = 0
        for bucket in self.buckets:
            for t in (bucket.flat, bucket.shard):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


def all_gather_shards(
    params: list[ShardedParam],
    sources: list[torch.Tensor],
    targets: list[torch.Tensor],
    *,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    bucket_numel: int,
    group: Any,
    stats: CommStats | None,
    pool: BufferPool,
) -> None:
    """Rebuild full flat ``targets[i]`` from every rank's owned slice ``sources[i]``.

    For occasional use (after a load, for export): builds its layouts on the fly.
    """
    index = {id(p): i for i, p in enumerate(params)}
    for chunk in split_into_buckets(params, bucket_numel):
        layout = ShardBucket(chunk, world_size, rank)
        buffer = pool.acquire(layout.numel, dtype)[: layout.numel]
        segment = layout.segment(buffer)
        torch._foreach_copy_(layout.shard_views(segment), [sources[index[id(p)]] for p in chunk])
        collectives.all_gather(buffer, segment, group=group, stats=stats).wait()
        with torch.no_grad():
            layout.unpack(buffer, [targets[index[id(p)]] for p in chunk])
        pool.release(buffer._base if buffer._base is not None else buffer)
