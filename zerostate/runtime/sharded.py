"""Per-parameter sharded state and the rank-segmented layout of a group of parameters.

[Note: bucket layout]
Every parameter is split evenly (:func:`zerostate.layout.partition.even_layout`): parameter ``i``
of ``numel_i`` elements is padded to ``c_i * world_size`` with ``c_i = ceil(numel_i /
world_size)``, and rank ``r`` owns ``[r * c_i, (r + 1) * c_i)`` clipped to ``numel_i``.
A group of parameters (a bucket, a stage-3 unit) is one buffer of ``world_size`` equal
segments of ``sum(c_i)`` elements: segment ``r`` is the concatenation, in group order, of
every parameter's rank-``r`` piece padded to ``c_i``. Viewed as a ``[world_size,
sum(c_i)]`` matrix, parameter ``i`` is the column block ``[:, off_i:off_i + c_i]``, i.e.
its padded flat storage reshaped to ``[world_size, c_i]``. Then one reduce-scatter hands
rank ``r`` exactly its pieces (summed over ranks) and one all-gather of every rank's
segment rebuilds the full parameters. Padding is at most ``world_size - 1`` elements per
parameter; it is zero on the way in and never read on the way out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import TensorLayout


@dataclass(frozen=True)
class ShardView:
    """One logical tensor's state held by this rank (see ``Engine.state_views``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: TensorLayout
    local: torch.Tensor
    local_start: int
    mesh: MeshLayout | None = None
    """Under tensor parallelism: the tensor's tp x dp layout; ``shape`` is then the global
    shape, ``layout`` the data-parallel split of tp shard ``tp_index`` and ``local`` /
    ``local_start`` a range of that shard, flattened ([Note: tensor-parallel checkpoints] in
    zerostate.checkpoint.tensor_parallel)."""
    tp_index: int = 0
    piece: tuple[int, int] | None = None
    """The ``(tp index, dp rank)`` piece this rank writes (None: another tp rank writes
    this replicated tensor's pieces)."""
    attrs: dict | None = None
    """Stored with the tensor: ``{COMPLEX_ATTR: ...}`` for a complex buffer, which the view
    holds as its real pairs ([Note: complex tensors] in zerostate.store.format)."""


class ShardedParam:
    """One parameter's state on this rank.

    ``master`` (fp32) covers ``[master_start, master_start + master.numel())`` of the flat
    parameter: the owned range when optimizer states are partitioned, the whole tensor at
    stage 0. ``shard`` is the working-dtype owned range ``[start, stop)``: a view of the full
    parameter when parameters are replicated, the only storage of the values when they are
    partitioned (see [Note: partitioned parameters] in zerostate.runtime.group). When the
    working dtype is fp32 the master is a view of the working storage, not a copy
    (``master_aliased``).
    """

    __slots__ = (
        "name", "param", "shape", "numel", "layout", "start", "stop", "trainable",
        "no_decay", "master", "master_aliased", "master_start", "shard",
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
        self.master_start = self.start
        self.shard: torch.Tensor | None = None

    @property
    def owned_numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Layout of a group of evenly split parameters in one rank-segmented buffer.

    Follows [Note: bucket layout]. Holds no tensors: buffers come from a
    :class:`~zerostate.comm.BufferPool` (or are owned by the caller) and are passed in.
    """

    def __init__(
        self, params: Sequence[ShardedParam], world_size: int, rank: int, *, num_tags: int = 0
    ) -> None:
        self.params = list(params)
        self.world_size = world_size
        self.rank = rank
        self.chunks = [_even_chunk(p, world_size) for p in self.params]
        self.offsets: list[int] = []
        offset = 0
        for c in self.chunks:
            self.offsets.append(offset)
            offset += c
        #: Elements at the end of every segment that carry a tag instead of values
        #: ([Note: group tags] in zerostate.runtime.group).
        self.num_tags = num_tags
        self.tag_offset = offset
        self.seg_numel = max(1, offset + num_tags)
        self.numel = self.seg_numel * world_size

    def segment(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.rank * self.seg_numel : (self.rank + 1) * self.seg_numel]

    def shard_views(self, segment: torch.Tensor) -> list[torch.Tensor]:
        """This rank's owned slice of every parameter inside a segment-sized tensor."""
        return [
            segment[off : off + p.stop - p.start]
            for off, p in zip(self.offsets, self.params, strict=True)
        ]

    def _blocks(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        matrix = buffer[: self.numel].view(self.world_size, self.seg_numel)
        return [matrix[:, off : off + c] for off, c in zip(self.offsets, self.chunks, strict=True)]

    def pack(self, buffer: torch.Tensor, sources: Sequence[torch.Tensor | None]) -> None:
        """Copy full flat tensors into the buffer (casting); ``None`` stands for zeros."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for block, source, c, p in zip(
            self._blocks(buffer), sources, self.chunks, self.params, strict=True
        ):
            if source is None:
                block.zero_()
                continue
            rows, rest = divmod(p.numel, c)
            if rows:
                dst.append(block[:rows])
                src.append(source[: rows * c].view(rows, c))
            if rows < self.world_size:  # padding: zeros, so sums over ranks stay finite
                block[rows:].zero_()
                if rest:
                    dst.append(block[rows, :rest])
                    src.append(source[rows * c :])
        if dst:
            torch._foreach_copy_(dst, src)

    def add_param(
        self, buffer: torch.Tensor, index: int, source: torch.Tensor, *, accumulate: bool = True
    ) -> None:
        """Add (``accumulate=False``: copy) the full flat tensor of parameter ``index`` into
        its block of ``buffer``; the block's padding is left as it is."""
        c, p, off = self.chunks[index], self.params[index], self.offsets[index]
        block = buffer[: self.numel].view(self.world_size, self.seg_numel)[:, off : off + c]
        rows, rest = divmod(p.numel, c)
        if rows:
            _write(block[:rows], source[: rows * c].view(rows, c), accumulate)
        if rest:
            _write(block[rows, :rest], source[rows * c :], accumulate)

    def zero_param(self, buffer: torch.Tensor, index: int) -> None:
        """Zero parameter ``index``'s block of ``buffer``, padding included."""
        c, off = self.chunks[index], self.offsets[index]
        buffer[: self.numel].view(self.world_size, self.seg_numel)[:, off : off + c].zero_()

    def tags(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[world_size, num_tags]`` view of every segment's tag elements."""
        matrix = buffer[: self.numel].view(self.world_size, self.seg_numel)
        return matrix[:, self.tag_offset : self.tag_offset + self.num_tags]

    def unpack(self, buffer: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
        """Copy the buffer into full flat tensors (casting to their dtype)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for block, target, c, p in zip(
            self._blocks(buffer), targets, self.chunks, self.params, strict=True
        ):
            rows, rest = divmod(p.numel, c)
            if rows:
                dst.append(target[: rows * c].view(rows, c))
                src.append(block[:rows])
            if rest:
                dst.append(target[rows * c :])
                src.append(block[rows, :rest])
        if dst:
            torch._foreach_copy_(dst, src)


def _write(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)


def _even_chunk(p: ShardedParam, world_size: int) -> int:
    layout = p.layout
    # Internal invariant: the engine plans every parameter with partition.even_layout.
    assert layout.first_owner == 0 and layout.world_size == world_size, p.name
    assert layout.chunk_numel * world_size >= p.numel, p.name
    return layout.chunk_numel
