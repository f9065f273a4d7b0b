"""Per-parameter sharded state, the rank-segmented bucket layout, and reusable buffers.

[Note: bucket layout]
Ownership comes from :func:`zerostate.partition.plan_layouts`, so a parameter's owned
ranges are uneven in general (a small tensor may live wholly on one rank). A bucket of
parameters is laid out in ``world_size`` equal segments: segment ``r`` is the
concatenation, in bucket order, of every parameter's rank-``r`` owned slice, padded to the
longest segment. Then ``reduce_scatter_tensor`` hands rank ``r`` exactly its slices (summed
over ranks) and ``all_gather_into_tensor`` of every rank's segment rebuilds the full
parameters. Padding is at most the difference between the largest and the smallest
per-rank share of the bucket; it is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerostate.partition import TensorLayout


@dataclass(frozen=True)
class ShardView:
    """One logical tensor's state held by this rank (see ``Engine.state_views``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: TensorLayout
    local: torch.Tensor
    local_start: int


class ShardedParam:
    """One parameter's state on this rank.

    ``master`` (fp32) covers ``[local_start, local_start + master.numel())`` of the flat
    parameter: the owned range for stages >= 1, the whole tensor at stage 0. When the
    working dtype is fp32 it is a view of the working storage (param or stage-3 shard), not
    a copy. ``local`` is the stage-3 working-dtype shard of the owned range.
    """

    __slots__ = (
        "name", "param", "shape", "numel", "layout", "start", "stop", "trainable",
        "no_decay", "master", "master_aliased", "exp_avg", "exp_avg_sq", "local",
        "grad_shard", "unit",
    )  # fmt: skip

    def __init__(
        self, name: str, param: nn.Parameter, layout: TensorLayout, rank: int, no_decay: bool
    ) -> None:
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.layout = layout
        self.start, self.stop = layout.owned_range(rank)
        self.trainable = param.requires_grad
        self.no_decay = no_decay
        self.master: torch.Tensor | None = None
        self.master_aliased = False
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.local: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.unit = None  # stage 3: the gathering unit this parameter belongs to

    @property
    def owned_numel(self) -> int:
        return self.stop - self.start


class ShardBucket:
    """Layout of a group of parameters in one padded, rank-segmented buffer.

    Follows [Note: bucket layout]. Holds no tensors: buffers come from a
    :class:`BufferPool` (or are owned by the caller) and are passed in.
    """

    def __init__(self, params: list[ShardedParam], world_size: int, rank: int) -> None:
        self.params = params
        self.world_size = world_size
        self.rank = rank
        per_rank = [[p.layout.owned_numel(r) for p in params] for r in range(world_size)]
        self.seg_numel = max(1, max(sum(sizes) for sizes in per_rank))
        self.numel = self.seg_numel * world_size
        # pieces[j]: (lo, hi, offset in the full buffer) of each owned chunk of param j.
        self.pieces: list[list[tuple[int, int, int]]] = [[] for _ in params]
        self.my_offsets: list[int] = [0] * len(params)
        for r in range(world_size):
            offset = r * self.seg_numel
            for j, p in enumerate(params):
                lo, hi = p.layout.owned_range(r)
                if r == rank:
                    self.my_offsets[j] = offset - r * self.seg_numel
                if hi > lo:
                    self.pieces[j].append((lo, hi, offset))
                    offset += hi - lo

    def segment(self, buffer: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        r = self.rank if rank is None else rank
        return buffer[r * self.seg_numel : (r + 1) * self.seg_numel]

    def shard_views(self, segment: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slice of every parameter inside ``segment`` (a segment-sized tensor)."""
        return [
            segment[off : off + p.owned_numel]
            for off, p in zip(self.my_offsets, self.params, strict=True)
        ]

    def pack(self, buffer: torch.Tensor, sources: list[torch.Tensor | None]) -> None:
        """Copy full flat tensors into the buffer's segments; ``None`` stands for zeros."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for pieces, source in zip(self.pieces, sources, strict=True):
            for lo, hi, off in pieces:
                view = buffer[off : off + hi - lo]
                if source is None:
                    view.zero_()
                else:
                    dst.append(view)
                    src.append(source[lo:hi])
        if dst:
            torch._foreach_copy_(dst, src)

    def unpack(self, buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Copy the buffer's segments into full flat tensors (casting to their dtype)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for pieces, target in zip(self.pieces, targets, strict=True):
            for lo, hi, off in pieces:
                dst.append(target[lo:hi])
                src.append(buffer[off : off + hi - lo])
        if dst:
            torch._foreach_copy_(dst, src)


def split_into_buckets(params: list[ShardedParam], bucket_numel: int) -> list[list[ShardedParam]]:
    """Consecutive runs of ``params`` of at most ``bucket_numel`` elements (at least one
    parameter per bucket, so a parameter larger than a bucket gets its own)."""
    buckets: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0
    for p in params:
        if current and size + p.numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel
    if current:
        buckets.append(current)
    return buckets


class BufferPool:
    """Flat communication buffers, reused across buckets and steps.

    ``acquire`` returns the smallest free buffer that fits (or allocates one); ``release``
    gives it back. Buffers are never freed, so steady-state training allocates nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        fits = [i for i, b in enumerate(self._free) if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._bytes += buffer.numel() * buffer.element_size()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)

    @property
    def allocated_bytes(self) -> int:
        return self._bytes
