"""Partition math: who owns which elements of which tensor.

Pure functions and frozen dataclasses; no ``torch.distributed`` and no I/O. The engine
(which shards live on which rank), the store (which rank writes which chunk) and the
resharding reader (which chunks a rank of a new world size must read) all use this module,
so a rank's in-memory shard is byte for byte the chunk it writes.

[Note: partition rule]
Every tensor is viewed flat (1-D, ``numel`` elements) and cut into equal chunks of
``chunk_numel`` elements; the last chunk may be short. Each chunk is owned by exactly one
rank and each rank owns at most one chunk of a tensor, so a rank's shard of a tensor is one
contiguous range (possibly empty).

* Normal tensors are split evenly: ``chunk_numel = ceil(numel / world_size)`` and chunk
  ``i`` belongs to rank ``i``. Padding the tensor to ``chunk_numel * world_size`` adds at
  most ``world_size - 1`` elements.
* Small tensors are not cut into pieces smaller than ``min_shard_numel`` elements:
  ``chunk_numel = max(ceil(numel / world_size), min(numel, min_shard_numel))``. A tiny
  tensor (``numel <= min_shard_numel``) thus becomes a single chunk held by one rank,
  instead of ``world_size`` tiny objects in storage and tiny messages on the wire.
* When a tensor has fewer chunks than ranks, its chunks go to a run of consecutive ranks
  starting at a rotating offset chosen to balance the bytes each rank owns (greedy, in
  tensor order). The choice depends only on the tensors' sizes, ``world_size`` and
  ``min_shard_numel``, so every rank computes the same plan without talking.

The logical content of a tensor never depends on the plan; only the chunk grid does. Reading
a tensor written under one plan into another plan is 1-D range intersection
(:func:`chunk_reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Default smallest piece a tensor is cut into (elements). 2**16 fp32 elements = 256 KiB:
#: below that, per-object overheads of storage and collectives dominate.
DEFAULT_MIN_SHARD_NUMEL = 1 << 16


def ceil_div(a: int, b: int) -> int:
    if b <= 0:
        raise ValueError(f"divisor must be positive, got {b}")
    return -(-a // b)


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """How one flat tensor of ``numel`` elements is chunked and who owns each chunk.

    ``first_owner`` is the rank that owns chunk 0; chunk ``i`` is owned by rank
    ``(first_owner + i) % world_size``. ``num_chunks <= world_size`` always holds.
    """

    numel: int
    world_size: int
    chunk_numel: int
    first_owner: int = 0

    def __post_init__(self) -> None:
        _check_world_size(self.world_size)
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {self.chunk_numel}")
        if not 0 <= self.first_owner < self.world_size:
            raise ValueError(
                f"first_owner must be in [0, {self.world_size}), got {self.first_owner}"
            )
        if self.num_chunks > self.world_size:
            raise ValueError(
                f"{self.num_chunks} chunks of {self.chunk_numel} for {self.numel} elements "
                f"exceed world_size {self.world_size}: each rank owns at most one chunk"
            )

    @property
    def num_chunks(self) -> int:
        return ceil_div(self.numel, self.chunk_numel) if self.numel else 0

    @property
    def padded_numel(self) -> int:
        """Elements covered by the chunk grid (the last chunk stored at full size)."""
        return self.num_chunks * self.chunk_numel

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Half-open element range ``[start, stop)`` of chunk ``index`` (unpadded)."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} out of range [0, {self.num_chunks})")
        start = index * self.chunk_numel
        return start, min(start + self.chunk_numel, self.numel)

    def chunk_owner(self, index: int) -> int:
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} out of range [0, {self.num_chunks})")
        return (self.first_owner + index) % self.world_size

    def owned_chunk(self, rank: int) -> int | None:
        """Index of the chunk ``rank`` owns, or ``None`` if it owns none."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        index = (rank - self.first_owner) % self.world_size
        return index if index < self.num_chunks else None

    def owned_range(self, rank: int) -> tuple[int, int]:
        """Half-open range of elements ``rank`` owns; ``(n, n)``-style empty if none."""
        index = self.owned_chunk(rank)
        if index is None:
            return self.numel, self.numel
        return self.chunk_range(index)

    def owned_numel(self, rank: int) -> int:
        start, stop = self.owned_range(rank)
        return stop - start

    def to_json(self) -> dict:
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "chunk_numel": self.chunk_numel,
            "first_owner": self.first_owner,
        }

    @classmethod
    def from_json(cls, data: dict) -> TensorLayout:
        try:
            return cls(
                numel=int(data["numel"]),
                world_size=int(data["world_size"]),
                chunk_numel=int(data["chunk_numel"]),
                first_owner=int(data.get("first_owner", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed tensor layout {data!r}: {exc}") from exc


def even_layout(numel: int, world_size: int) -> TensorLayout:
    """The plain ZeRO split: ``ceil(numel / world_size)`` per rank, chunk i on rank i."""
    _check_world_size(world_size)
    return TensorLayout(numel, world_size, max(1, ceil_div(numel, world_size)), 0)


def chunk_numel_for(numel: int, world_size: int, min_shard_numel: int) -> int:
    _check_world_size(world_size)
    if min_shard_numel < 1:
        raise ValueError(f"min_shard_numel must be >= 1, got {min_shard_numel}")
    if numel == 0:
        return 1
    return max(ceil_div(numel, world_size), min(numel, min_shard_numel))


def plan_layouts(
    numels: Sequence[int],
    world_size: int,
    min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL,
) -> list[TensorLayout]:
    """Layouts for a list of tensors (in a fixed order), following [Note: partition rule].

    Deterministic: every rank calling this with the same arguments gets the same plan.
    """
    _check_world_size(world_size)
    load = [0] * world_size  # elements owned so far, to place under-split tensors
    layouts: list[TensorLayout] = []
    for numel in numels:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        chunk = chunk_numel_for(numel, world_size, min_shard_numel)
        num_chunks = ceil_div(numel, chunk) if numel else 0
        first = 0
        if 0 < num_chunks < world_size:
            # Pick the run of num_chunks consecutive ranks (cyclically) that owns least.
            best = None
            for start in range(world_size):
                run = sum(load[(start + i) % world_size] for i in range(num_chunks))
                if best is None or run < best:
                    best, first = run, start
        layout = TensorLayout(numel, world_size, chunk, first)
        for index in range(num_chunks):
            lo, hi = layout.chunk_range(index)
            load[layout.chunk_owner(index)] += hi - lo
        layouts.append(layout)
    return layouts


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection of two half-open ranges, or ``None`` when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """Copy ``chunk[chunk_start:chunk_stop]`` of stored chunk ``chunk_index`` to
    ``out[out_start:out_start + (chunk_stop - chunk_start)]``."""

    chunk_index: int
    chunk_start: int
    chunk_stop: int
    out_start: int

    @property
    def numel(self) -> int:
        return self.chunk_stop - self.chunk_start


def chunk_reads(layout: TensorLayout, start: int, stop: int) -> list[ChunkRead]:
    """The stored-chunk pieces that make up element range ``[start, stop)``.

    This is all resharding is: the target rank's range under the new plan, intersected
    with the chunk grid of the plan the data was written under.
    """
    if not 0 <= start <= stop <= layout.numel:
        raise ValueError(f"range [{start}, {stop}) outside tensor of {layout.numel} elements")
    reads: list[ChunkRead] = []
    if start == stop:
        return reads
    first = start // layout.chunk_numel
    last = (stop - 1) // layout.chunk_numel
    for index in range(first, last + 1):
        lo, hi = intersect((start, stop), layout.chunk_range(index))  # type: ignore[misc]
        base = index * layout.chunk_numel
        reads.append(ChunkRead(index, lo - base, hi - base, lo - start))
    return reads


def split_evenly(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Owned ranges of the plain even split, for every rank."""
    layout = even_layout(numel, world_size)
    return [layout.owned_range(r) for r in range(world_size)]
