"""Format v2 row plan: where each rank's bytes of each tensor live. Pure, no I/O.

[Note: rows]
Tensors are grouped by the prefix before their last ``/`` (``model``, ``optim/exp_avg``,
``buffers``, ...; a name without ``/`` belongs to the group ``_top``). Each group is one
zarr array of ``uint8`` and shape ``[world_size, S]``: row ``r`` holds the bytes rank ``r``
owns of every tensor of the group. Every tensor gets a *slot* of
``chunk_numel * itemsize`` bytes at the same ``offset`` in every row (tensors in name
order, slots back to back, so ``S`` is the sum of the slots); rank ``r`` stores its owned
range of the tensor at the start of the slot. Offsets are therefore one number per
tensor, not per rank, and the commit record stays O(tensors + world_size).

Each row is one zarr shard (sharding codec, chunk shape ``[1, n * C]``) of ``n`` inner
chunks of ``C`` bytes, each stored as ``C`` bytes + crc32c; the shard index (``n`` pairs
of little-endian uint64 ``offset, nbytes`` + crc32c) is at the end of the object. An inner
chunk is stored iff it overlaps bytes the rank owns (stored chunks are written in index
order, back to back, so their positions follow from the plan); the others are absent
(index entry all ones, read as zeros). A row with no stored chunk is not written.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch

from zerostate.errors import CheckpointError, ConfigError
from zerostate.layout.partition import TensorLayout, ceil_div

TOP_GROUP = "_top"
CHECKSUM_NBYTES = 4
INDEX_ENTRY_NBYTES = 16
MISSING = 0xFFFF_FFFF_FFFF_FFFF
#: Inner chunk size bounds. The lower bound keeps the crc and index overhead under 2%;
#: the upper bound keeps one verified read small next to host memory.
MIN_INNER_NBYTES = 256
MAX_INNER_NBYTES = 4 << 20
#: A resharding reader touches about two pieces per tensor per source row and may read up
#: to one inner chunk too many per piece; ``C <= S / (32 * tensors)`` keeps that under ~5%.
PIECES_FACTOR = 32


def group_of(name: str) -> str:
    """The state group (zarr array) a tensor belongs to."""
    return name.rsplit("/", 1)[0] if "/" in name else TOP_GROUP


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def inner_chunk_nbytes(row_nbytes: int, num_tensors: int) -> int:
    """Default inner chunk size of a group: see ``PIECES_FACTOR``."""
    target = row_nbytes // (PIECES_FACTOR * max(1, num_tensors))
    return min(MAX_INNER_NBYTES, max(MIN_INNER_NBYTES, pow2_floor(target)))


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor's place in its group's rows."""

    name: str
    layout: TensorLayout
    itemsize: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_numel * self.itemsize if self.layout.num_chunks else 0

    def owned_bytes(self, rank: int) -> tuple[int, int]:
        """Half-open byte range of the row that ``rank`` stores for this tensor."""
        return self.offset, self.offset + self.layout.owned_numel(rank) * self.itemsize


@dataclass(slots=True)
class GroupPlan:
    """The rows of one group. Built identically by every rank from the specs alone."""

    name: str
    world_size: int
    slots: list[Slot]
    inner: int
    row_nbytes: int
    _present: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    _sizes: np.ndarray | None = None

    @property
    def num_inner(self) -> int:
        return ceil_div(self.row_nbytes, self.inner) if self.row_nbytes else 0

    @property
    def stored_chunk_nbytes(self) -> int:
        return self.inner + CHECKSUM_NBYTES

    @property
    def index_nbytes(self) -> int:
        return self.num_inner * INDEX_ENTRY_NBYTES + CHECKSUM_NBYTES

    def spans(self, rank: int) -> list[tuple[int, int, Slot]]:
        """``(start, stop, slot)`` byte spans ``rank`` stores, ascending, non-empty."""
        out = []
        for slot in self.slots:
            lo, hi = slot.owned_bytes(rank)
            if hi > lo:
                out.append((lo, hi, slot))
        return out

    def present(self, rank: int) -> list[tuple[int, int]]:
        """Runs ``[first, stop)`` of the inner chunks stored in ``rank``'s row, ascending."""
        runs = self._present.get(rank)
        if runs is None:
            runs = []
            for lo, hi, _ in self.spans(rank):
                a, b = lo // self.inner, ceil_div(hi, self.inner)
                if runs and a <= runs[-1][1]:
                    runs[-1] = (runs[-1][0], max(runs[-1][1], b))
                else:
                    runs.append((a, b))
            self._present[rank] = runs
        return runs

    def num_present(self, rank: int) -> int:
        return sum(b - a for a, b in self.present(rank))

    def object_nbytes(self, rank: int) -> int:
        """Size of ``rank``'s row object, 0 when the row is not written."""
        n = self.num_present(rank)
        return n * self.stored_chunk_nbytes + self.index_nbytes if n else 0

    def object_sizes(self) -> np.ndarray:
        """``object_nbytes`` of every rank at once: rank 0 checks every manifest against
        them, and a loop over ranks and tensors takes seconds at thousands of ranks."""
        if self._sizes is None:
            self._sizes = self._object_sizes()
        return self._sizes

    def _object_sizes(self) -> np.ndarray:
        # Blocks of slots x ranks at once: a loop over slots took 13 ms of rank 0's commit
        # for the 2,670 pieces of a 2-rank DCP step. ``covered`` (stored chunks [0, covered)
        # so far) is a running maximum down the slots, carried from block to block.
        world = self.world_size
        ranks = np.arange(world, dtype=np.int64)
        covered = np.zeros(world, dtype=np.int64)
        count = np.zeros(world, dtype=np.int64)
        slots = [s for s in self.slots if s.layout.num_chunks]  # ascending offsets
        per_block = max(1, _SIZES_BLOCK // world)
        for b in range(0, len(slots), per_block):
            block = slots[b : b + per_block]
            numel, chunk, owner, offset, itemsize = (
                np.array(column, dtype=np.int64)[:, None]
                for column in zip(
                    *(
                        (
                            s.layout.numel,
                            s.layout.chunk_numel,
                            s.layout.first_owner,
                            s.offset,
                            s.itemsize,
                        )
                        for s in block
                    ),
                    strict=True,
                )
            )
            index = (ranks - owner) % world
            owned = np.clip(numel - index * chunk, 0, chunk)
            has = owned > 0
            stop = np.where(has, -(-(offset + owned * itemsize) // self.inner), 0)
            reach = np.maximum.accumulate(np.vstack([covered, stop]), axis=0)
            new = np.where(has, stop - np.maximum(offset // self.inner, reach[:-1]), 0)
            count += np.maximum(new, 0).sum(axis=0)
            covered = reach[-1]
        return np.where(count > 0, count * self.stored_chunk_nbytes + self.index_nbytes, 0)

    def position(self, rank: int, chunk: int) -> int | None:
        """Position of inner chunk ``chunk`` within ``rank``'s object, None if absent."""
        runs = self.present(rank)
        i = bisect.bisect_right(runs, (chunk, math.inf)) - 1
        if i < 0 or not runs[i][0] <= chunk < runs[i][1]:
            return None
        return sum(b - a for a, b in runs[:i]) + chunk - runs[i][0]

    def index_bytes(self, rank: int) -> bytes:
        """The shard index (without its crc32c) of ``rank``'s row."""
        # Per run of stored chunks, not per chunk: a DCP step's row has tens of thousands.
        entries = np.full((self.num_inner, 2), MISSING, dtype="<u8")
        stride, pos = self.stored_chunk_nbytes, 0
        for a, b in self.present(rank):
            entries[a:b, 0] = np.arange(pos, pos + b - a, dtype=np.uint64) * np.uint64(stride)
            entries[a:b, 1] = stride
            pos += b - a
        return entries.tobytes()

    def tensors_in_chunk(self, rank: int, chunk: int) -> list[str]:
        """Names of the tensors whose stored bytes in ``rank``'s row touch ``chunk``."""
        lo, hi = chunk * self.inner, (chunk + 1) * self.inner
        return [s.name for a, b, s in self.spans(rank) if a < hi and b > lo]

    def array_document(self) -> dict:
        """The zarr v3 array document of this group (see [Note: rows])."""
        shard = [1, max(1, self.num_inner) * self.inner]
        crc = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": [self.world_size, self.row_nbytes],
            "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [1, self.inner],
                        "codecs": crc,
                        "index_codecs": crc,
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {"zerostate_group": {"tensors": [s.name for s in self.slots]}},
            "storage_transformers": [],
        }


def row_path(group: str, rank: int) -> str:
    """Key of ``rank``'s row object (zarr's default chunk key of chunk ``(rank, 0)``)."""
    return f"{group}/c/{rank}/0"


def check_group_tree(groups: Iterable[str]) -> None:
    """Group arrays cannot contain nodes: no group may be a parent of another."""
    names = set(groups)
    for g in names:
        parts = g.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in names:
                raise ConfigError(
                    f"state group {parent!r} (tensors named '{parent}/<x>') is also a parent "
                    f"of group {g!r}; a zarr array cannot contain other nodes: rename the "
                    "tensors so that no group name is a prefix of another"
                )


@dataclass(frozen=True, slots=True)
class RowView:
    """Where a run of a group's tensors lies in the group's rows, for a writer given only
    those tensors' specs ([Note: row views]): their first slot's byte ``offset``, the row's
    size and its inner chunk size, as the plan of every tensor of the group has them."""

    offset: int
    row_nbytes: int
    inner: int

    def to_json(self) -> list[int]:
        return [self.offset, self.row_nbytes, self.inner]


# [Note: row views]
# A rank writes only its own row, and what it needs of a group's plan for that is its own
# slots (consecutive in name order), where the first one starts, the row's size and the inner
# chunk size: never the slots of the other ranks' tensors. A save whose tensors are each
# stored by one rank (a DCP step's pieces) gives each rank only its own specs and a RowView
# per group, so that what a coordinator sends each rank is O(its tensors), not O(all of
# them): the whole piece list sent to every rank is quadratic in ranks (76 s of pickling on
# rank 0 per save at 256 ranks). ``row_views`` derives the views from the full plans; rank 0,
# which holds every spec, checks each manifest against the digest of the view it sent.


def plan_groups(
    entries: Iterable[tuple[str, TensorLayout, int]],
    world_size: int,
    inner: dict[str, int] | None = None,
    views: dict[str, RowView] | None = None,
) -> dict[str, GroupPlan]:
    """Group plans from ``(name, layout, itemsize)``; tensors go in name order.

    ``inner`` overrides inner chunk sizes (a reader takes them from the commit record).
    ``views`` places a group's given tensors at a view's offset in rows of the view's size
    ([Note: row views]): the plan then holds only those slots.
    """
    by_group: dict[str, list[tuple[str, TensorLayout, int]]] = {}
    for entry in sorted(entries, key=lambda e: e[0]):
        by_group.setdefault(group_of(entry[0]), []).append(entry)
    check_group_tree(by_group)
    views = views or {}
    unknown = sorted(set(views) - set(by_group))
    if unknown:
        raise ConfigError(f"row views of groups {unknown[:5]} that no given tensor is in")
    plans = {}
    for group, members in sorted(by_group.items()):
        view = views.get(group)
        start = offset = view.offset if view is not None else 0
        slots = []
        for name, layout, itemsize in members:
            slot = Slot(name, layout, itemsize, offset)
            slots.append(slot)
            offset += slot.nbytes
        if view is not None:
            if not (0 <= start <= offset <= view.row_nbytes and view.inner >= MIN_INNER_NBYTES):
                raise ConfigError(
                    f"group {group!r}: tensors of {offset - start} bytes do not fit a row view "
                    f"at {start} of a {view.row_nbytes}-byte row (inner {view.inner})"
                )
            plans[group] = GroupPlan(group, world_size, slots, view.inner, view.row_nbytes)
            continue
        size = (inner or {}).get(group) or inner_chunk_nbytes(offset, len(members))
        plans[group] = GroupPlan(group, world_size, slots, size, offset)
    return plans


def row_views(plans: dict[str, GroupPlan], owners: dict[str, int]) -> dict[int, dict[str, RowView]]:
    """Per rank, the row views that place the tensors ``owners`` gives it (a tensor name ->
    the rank whose specs it is in) as the full ``plans`` do ([Note: row views]). One pass
    over the slots, whatever the number of ranks; a rank's tensors must be consecutive in
    each group's name order."""
    views: dict[int, dict[str, RowView]] = {}
    last: dict[tuple[int, str], int] = {}
    placed = 0
    for group, plan in plans.items():
        for i, slot in enumerate(plan.slots):
            rank = owners.get(slot.name)
            if rank is None:
                continue
            placed += 1
            prev = last.get((rank, group))
            if prev is None:
                views.setdefault(rank, {})[group] = RowView(
                    slot.offset, plan.row_nbytes, plan.inner
                )
            elif prev != i - 1:
                raise ConfigError(
                    f"group {group!r}: rank {rank}'s tensors are not consecutive in name "
                    "order; a row view cannot place them"
                )
            last[(rank, group)] = i
    if placed != len(owners):
        raise ConfigError(f"{len(owners) - placed} tensor(s) given owners are in no plan")
    return views


class LazyShard:
    """A shard whose bytes are produced on demand, in order, while its row streams out:
    ``read(offset, nbytes)`` returns bytes ``[offset, offset + nbytes)`` of the shard.
    Lets a converter (``reshard``) write a row without holding it in memory."""

    def __init__(self, numel: int, dtype: torch.dtype, read: Callable[[int, int], Any]) -> None:
        self.numel, self.dtype, self.read = numel, dtype, read


Source = memoryview | LazyShard


def _piece(source: Source, offset: int, nbytes: int) -> Any:
    if isinstance(source, LazyShard):
        data = memoryview(source.read(offset, nbytes)).cast("B")
        if data.nbytes != nbytes:
            raise CheckpointError(
                f"internal: lazy shard gave {data.nbytes} bytes, {nbytes} were asked for"
            )
        return data
    return source[offset : offset + nbytes]


#: Inner chunks smaller than this are written in batches ([Note: batched small chunks]).
BATCH_BELOW_NBYTES = 16 << 10
#: Most slots x ranks :meth:`GroupPlan.object_sizes` takes at once.
_SIZES_BLOCK = 1 << 20
#: About the most stored bytes one batch holds.
BATCH_NBYTES = 4 << 20


def row_parts(
    plan: GroupPlan, rank: int, sources: dict[str, Source], chunk_crcs: bytearray
) -> Iterator[Any]:
    """The bytes of ``rank``'s row object of ``plan``: stored inner chunks each followed by
    its crc32c, then the shard index and its crc32c. The chunk checksums are appended to
    ``chunk_crcs``. Large inner chunks come as views of the sources (no copy), small ones
    in batches of many chunks ([Note: batched small chunks])."""
    if plan.inner < BATCH_BELOW_NBYTES:
        chunks = _batched_chunks(plan, rank, sources, chunk_crcs)
    else:
        chunks = _chunk_views(plan, rank, sources, chunk_crcs)
    yield from chunks
    index = plan.index_bytes(rank)
    yield index
    yield crc32c.crc32c(index).to_bytes(CHECKSUM_NBYTES, "little")


def _batched_chunks(
    plan: GroupPlan, rank: int, sources: dict[str, Source], chunk_crcs: bytearray
) -> Iterator[memoryview]:
    """The stored inner chunks of ``rank``'s row, a batch of them per part.

    [Note: batched small chunks]
    The default inner chunk shrinks as a group's tensors grow in number
    (:func:`inner_chunk_nbytes`): a DCP step stores one tensor per chunk DCP planned, and
    a 2-rank FSDP2 state of 38 MB got 512-byte chunks, about 37,000 per row. Handed to the
    storage one chunk at a time, with a checksum call, a yield and a copy into the write
    buffer each, the Python work kept the row's write at 60-70 ms of a 137-172 ms save
    where the disk needed about 20. Such chunks are now built a batch at a time: the
    batch is an array of stored chunks (payload, then crc32c), each source span placed
    with at most three copies (a partial first chunk, whole chunks as one strided copy, a
    partial last one), gaps left zero, then one checksum call per chunk. The bytes are
    exactly those of :func:`_chunk_views`. The row's write of that save took 40-46 ms.
    The batch costs one more copy of the row, so it pays only for small chunks: the CPU
    time to produce a row and copy it into a write buffer, one chunk at a time against
    batched, was 0.090 against 0.021-0.026 s for a 19 MiB row at 512 bytes, 0.110-0.120
    against 0.057-0.064 s for 140 MiB at 4 KiB, 0.064-0.066 against 0.048-0.050 s at
    8 KiB, and 0.034-0.036 against 0.047-0.048 s at 32 KiB: chunks of
    ``BATCH_BELOW_NBYTES`` and more still go as views.
    """
    spans = plan.spans(rank)
    size = plan.inner
    stride = size + CHECKSUM_NBYTES
    per_batch = max(1, BATCH_NBYTES // stride)
    crc = crc32c.crc32c
    k = 0
    for first, stop in plan.present(rank):
        for j0 in range(first, stop, per_batch):
            j1 = min(stop, j0 + per_batch)
            n = j1 - j0
            lo, hi = j0 * size, j1 * size
            block = np.zeros((n, stride), dtype=np.uint8)
            while k < len(spans) and spans[k][1] <= lo:
                k += 1
            i = k
            while i < len(spans) and spans[i][0] < hi:
                s_lo, s_hi, slot = spans[i]
                a, b = max(s_lo, lo), min(s_hi, hi)
                src = np.frombuffer(_piece(sources[slot.name], a - s_lo, b - a), dtype=np.uint8)
                _place(block, a - lo, b - lo, src, size)
                i += 1
            flat = memoryview(block.reshape(-1))
            crcs = np.fromiter(
                (crc(flat[at : at + size]) for at in range(0, n * stride, stride)),
                dtype="<u4",
                count=n,
            )
            block[:, size:] = crcs.view(np.uint8).reshape(n, CHECKSUM_NBYTES)
            chunk_crcs += crcs.tobytes()
            yield flat


def _place(block: np.ndarray, u: int, v: int, src: np.ndarray, size: int) -> None:
    """Put payload bytes ``[u, v)`` of a batch (``block``: one stored chunk per row, the
    payload in its first ``size`` columns) from ``src``: a partial first chunk, whole
    chunks in one strided copy, a partial last chunk."""
    r0, o0 = divmod(u, size)
    r1, o1 = divmod(v, size)
    if r0 == r1:
        block[r0, o0:o1] = src
        return
    at = 0
    if o0:
        at = size - o0
        block[r0, o0:size] = src[:at]
        r0 += 1
    if r1 > r0:
        n = (r1 - r0) * size
        block[r0:r1, :size] = src[at : at + n].reshape(r1 - r0, size)
        at += n
    if o1:
        block[r1, :o1] = src[at:]


def _chunk_views(
    plan: GroupPlan, rank: int, sources: dict[str, Source], chunk_crcs: bytearray
) -> Iterator[Any]:
    """The stored inner chunks of ``rank``'s row in pieces that are mostly views of the
    sources (no copy): each chunk's payload, then its crc32c."""
    spans = plan.spans(rank)
    size = plan.inner
    zeros = memoryview(bytes(size))
    k = 0
    for first, stop in plan.present(rank):
        for j in range(first, stop):
            lo, hi = j * size, (j + 1) * size
            while k < len(spans) and spans[k][1] <= lo:
                k += 1
            pos, crc, i = lo, 0, k
            while pos < hi:
                if i < len(spans) and spans[i][0] < hi:
                    s_lo, s_hi, slot = spans[i]
                    if s_lo > pos:
                        gap = zeros[: s_lo - pos]
                        crc = crc32c.crc32c(gap, crc)
                        yield gap
                        pos = s_lo
                    end = min(s_hi, hi)
                    piece = _piece(sources[slot.name], pos - s_lo, end - pos)
                    crc = crc32c.crc32c(piece, crc)
                    yield piece
                    pos = end
                    if end == s_hi:
                        i += 1
                else:
                    gap = zeros[: hi - pos]
                    crc = crc32c.crc32c(gap, crc)
                    yield gap
                    pos = hi
            tail = crc.to_bytes(CHECKSUM_NBYTES, "little")
            chunk_crcs += tail
            yield tail
