"""Tensor-parallel x data-parallel layouts of one tensor: which elements each piece holds.

Pure functions and frozen dataclasses; no ``torch.distributed`` and no I/O. The engine (what a
rank of a device mesh holds), the store (what a piece on storage holds) and the resharding
planner (:mod:`zerostate.layout.planner`) describe a tensor with :class:`MeshLayout` and agree on
its pieces through :meth:`MeshLayout.segments`.

[Note: tensor-parallel layouts]
A checkpoint holds each tensor as its *global* (logical) tensor of ``shape``, written in
*pieces*. A piece is identified by ``(tp index, dp rank)`` and is made in two cuts:

* **Tensor-parallel cut.** With ``tp_dim`` set, the global tensor is cut along ``tp_dim``
  into ``tp_degree`` shards the way DTensor's ``Shard(tp_dim)`` cuts it: ``torch.chunk``
  sizes, ``ceil(size / tp_degree)`` rows per shard, the last shards short or empty. A fused
  parameter (q/k/v, gate/up: ``fused_sizes`` rows of sub-tensors concatenated along
  ``tp_dim``) is cut per sub-tensor: shard ``t`` holds chunk ``t`` of *each* sub-tensor,
  concatenated in sub-tensor order (Megatron's fused layout), so it splits correctly at
  another degree. With ``tp_dim`` ``None`` the tensor is replicated across tensor-parallel
  ranks and there is a single tp piece, index 0, holding all of it.
* **Data-parallel cut.** Each tp shard, flattened (C order), is cut across the ``dp_shard``
  ranks by [Note: partition rule] (:mod:`zerostate.layout.partition`): evenly, or with
  ``min_shard_numel`` and a per-shard ``first_owner``. ``dp_replicate`` replicas hold
  identical pieces, so they share piece ids.

Where a piece's elements lie is a short list of contiguous *global flat segments*
``(global_start, length, piece_offset)``, computed by block arithmetic: around ``tp_dim`` the
global tensor is ``[outer, D, inner]`` and a tp shard ``[outer, D_t, inner]``, so each outer
row contributes one run per sub-tensor (fewer where runs touch and are merged). The pieces of
a valid layout tile the global tensor: every element lies in exactly one piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerostate.errors import LayoutError
from zerostate.layout.partition import TensorLayout, ceil_div, chunk_numel_for, even_layout

#: Version of the JSON a :class:`MeshLayout` is stored as; readers refuse any other.
LAYOUT_VERSION = 1
#: Bounds for values read from storage (the format caps world sizes at 100 000 too): a hostile
#: degree must not make a reader enumerate billions of pieces.
MAX_DEGREE = 100_000
MAX_RANK = 64

PieceId = tuple[int, int]
"""``(tp index, dp rank)`` of a piece."""

Segment = tuple[int, int, int]
"""``(global_start, length, piece_offset)``: elements ``[global_start, global_start + length)``
of the flattened global tensor are elements ``[piece_offset, piece_offset + length)`` of the
piece."""


def tp_chunk(size: int, degree: int, index: int) -> tuple[int, int]:
    """Half-open rows ``[start, stop)`` of a dimension of ``size`` that tp shard ``index`` of
    ``degree`` holds: ``torch.chunk`` sizes, shards past the data empty (``(size, size)``)."""
    step = ceil_div(size, degree)
    return min(index * step, size), min((index + 1) * step, size)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshLayout:
    """The layout of one tensor on a ``(dp_replicate, dp_shard, tp)`` mesh; see
    [Note: tensor-parallel layouts]. Fields left at their defaults are filled in by
    ``__post_init__`` so equal layouts compare equal after a JSON round trip."""

    shape: tuple[int, ...]
    """Global (logical) shape of the tensor."""
    tp_dim: int | None = None
    """Dimension sharded across tensor-parallel ranks; ``None``: replicated across them."""
    tp_degree: int = 1
    """Number of tensor-parallel ranks."""
    fused_sizes: tuple[int, ...] = ()
    """Rows of each fused sub-tensor along ``tp_dim``, summing to ``shape[tp_dim]``; default
    one sub-tensor. Empty when ``tp_dim`` is ``None``."""
    dp_shard: int = 1
    """Number of data-parallel ranks each tp shard is partitioned across (ZeRO)."""
    min_shard_numel: int | None = None
    """``None``: the even split; otherwise the smallest chunk ([Note: partition rule])."""
    first_owners: tuple[int, ...] = ()
    """Per tp piece, the dp rank owning chunk 0 (as :func:`plan_layouts` places it); default 0."""
    dp_replicate: int = 1
    """Number of replicas of every piece (HSDP); replicas share piece ids."""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fused = tuple(self.fused_sizes)
        if self.tp_dim is not None and _is_int(self.tp_dim) and not fused:
            if 0 <= self.tp_dim < len(self.shape):
                fused = (self.shape[self.tp_dim],)
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "fused_sizes", fused)
        pieces = self.tp_degree if self.tp_dim is not None else 1
        # A hostile degree must be refused by check_layout, not allocated here first.
        valid = _is_int(pieces) and 1 <= pieces <= MAX_DEGREE
        owners = tuple(self.first_owners) or (0,) * (pieces if valid else 0)
        object.__setattr__(self, "first_owners", owners)
        check_layout(self)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_tp_pieces(self) -> int:
        """Distinct tp shards: ``tp_degree``, or 1 when replicated across tp."""
        return self.tp_degree if self.tp_dim is not None else 1

    @property
    def tp_sharded(self) -> bool:
        """Whether the tp cut changes anything (a degree of 1 holds the whole tensor)."""
        return self.tp_dim is not None and self.tp_degree > 1

    def piece_ids(self) -> list[PieceId]:
        """Every piece, empty ones included, in ``(tp index, dp rank)`` order."""
        return [(t, r) for t in range(self.num_tp_pieces) for r in range(self.dp_shard)]

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per layout and ``key``: what planners derive from a
        (frozen) layout, such as a sorted index of its pieces, is kept with it."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def tp_blocks(self, tp_index: int) -> list[tuple[int, int, int]]:
        """``(global row, rows, local row)`` along ``tp_dim`` of each non-empty run of rows
        shard ``tp_index`` holds, runs that touch merged (one run per sub-tensor at most)."""
        key = ("blocks", tp_index)
        if key not in self._cache:
            blocks: list[tuple[int, int, int]] = []
            base = local = 0
            for size in self.fused_sizes:
                lo, hi = tp_chunk(size, self.tp_degree, tp_index)
                if hi > lo:
                    if blocks and blocks[-1][0] + blocks[-1][1] == base + lo:
                        g, n, lr = blocks.pop()
                        blocks.append((g, n + hi - lo, lr))
                    else:
                        blocks.append((base + lo, hi - lo, local))
                    local += hi - lo
                base += size
            self._cache[key] = blocks
        return self._cache[key]

    def local_shape(self, tp_index: int) -> tuple[int, ...]:
        """Shape of tp shard ``tp_index`` (what DTensor's ``to_local()`` has)."""
        if self.tp_dim is None:
            return self.shape
        rows = sum(n for _, n, _ in self.tp_blocks(tp_index))
        return self.shape[: self.tp_dim] + (rows,) + self.shape[self.tp_dim + 1 :]

    def dp_layout(self, tp_index: int) -> TensorLayout:
        """The [Note: partition rule] layout of tp shard ``tp_index``, flattened."""
        key = ("dp", tp_index)
        if key not in self._cache:
            numel = math.prod(self.local_shape(tp_index))
            if self.min_shard_numel is None:
                chunk = even_layout(numel, self.dp_shard).chunk_numel
            else:
                chunk = chunk_numel_for(numel, self.dp_shard, self.min_shard_numel)
            owner = self.first_owners[tp_index]
            self._cache[key] = TensorLayout(numel, self.dp_shard, chunk, owner)
        return self._cache[key]

    def piece_numel(self, piece: PieceId) -> int:
        return self.dp_layout(piece[0]).owned_numel(piece[1])

    def segments(self, piece: PieceId) -> list[Segment]:
        """Where the elements of ``piece`` lie in the flattened global tensor, in piece order."""
        tp_index, rank = piece
        start, stop = self.dp_layout(tp_index).owned_range(rank)
        return self.local_segments(tp_index, start, stop)

    def local_segments(self, tp_index: int, start: int, stop: int) -> list[Segment]:
        """Global segments of elements ``[start, stop)`` of flattened tp shard ``tp_index``;
        piece offsets count from ``start``."""
        if stop <= start:
            return []
        blocks = self.tp_blocks(tp_index) if self.tp_dim is not None else []
        dim_rows = self.shape[self.tp_dim] if self.tp_dim is not None else 0
        if self.tp_dim is None or (len(blocks) == 1 and blocks[0][1] == dim_rows):
            return [(start, stop - start, 0)]  # the shard is the whole tensor
        inner = math.prod(self.shape[self.tp_dim + 1 :])
        local_row = sum(n for _, n, _ in blocks) * inner
        global_row = dim_rows * inner
        spans = [(g * inner, n * inner, lr * inner - start) for g, n, lr in blocks]
        segs = [
            (o * global_row + g, n, o * local_row + lo)
            for o in range(start // local_row, (stop - 1) // local_row + 1)
            for g, n, lo in spans
        ]
        return _merge(_clip(segs, stop - start), blocks, dim_rows)


def _clip(segs: list[Segment], numel: int) -> list[Segment]:
    """Cut whole-row runs down to piece offsets ``[0, numel)``; only the runs of the first and
    last outer row can stick out, so this touches a handful of entries."""
    first = 0
    while segs[first][2] + segs[first][1] <= 0:
        first += 1
    last = len(segs) - 1
    while segs[last][2] >= numel:
        last -= 1
    segs = segs[first : last + 1]
    g, n, off = segs[0]
    if off < 0:
        segs[0] = (g - off, n + off, 0)
    g, n, off = segs[-1]
    if off + n > numel:
        segs[-1] = (g, numel - off, off)
    return segs


def _merge(segs: list[Segment], blocks: list[tuple[int, int, int]], rows: int) -> list[Segment]:
    """Join the last run of one outer row to the first of the next where they touch, which
    happens only when the shard holds the first and the last row of the dimension."""
    if len(blocks) < 2 or blocks[0][0] != 0 or blocks[-1][0] + blocks[-1][1] != rows:
        return segs
    out = [segs[0]]
    for g, n, off in segs[1:]:
        pg, pn, poff = out[-1]
        if pg + pn == g:
            out[-1] = (pg, pn + n, poff)
        else:
            out.append((g, n, off))
    return out


# -- validation -----------------------------------------------------------------------------


def _fail(name: str, problem: str) -> LayoutError:
    exc = LayoutError(f"tensor {name!r}: {problem}")
    exc.problem = problem  # type: ignore[attr-defined]  # lets from_json name the tensor
    return exc


def check_layout(layout: MeshLayout, name: str = "<layout>") -> None:
    """Raise :class:`LayoutError` naming ``name`` unless every field is in range and consistent."""
    shape = layout.shape
    if len(shape) > MAX_RANK or not all(_is_int(s) and s >= 0 for s in shape):
        raise _fail(name, f"shape {list(shape)} is not a list of at most {MAX_RANK} ints >= 0")
    for field_name in ("tp_degree", "dp_shard", "dp_replicate"):
        value = getattr(layout, field_name)
        if not _is_int(value) or not 1 <= value <= MAX_DEGREE:
            raise _fail(name, f"{field_name} {value!r} is not an int in [1, {MAX_DEGREE}]")
    dim = layout.tp_dim
    if dim is None:
        if layout.fused_sizes:
            raise _fail(name, "fused_sizes given for a tensor replicated across tp")
    elif not _is_int(dim) or not 0 <= dim < len(shape):
        raise _fail(name, f"tp shard dim {dim!r} outside the rank {len(shape)} of {list(shape)}")
    else:
        fused = layout.fused_sizes
        if not fused or not all(_is_int(s) and s >= 0 for s in fused):
            raise _fail(name, f"fused sizes {list(fused)} are not ints >= 0")
        if sum(fused) != shape[dim]:
            raise _fail(
                name, f"fused sizes {list(fused)} sum to {sum(fused)}, not dim {dim}'s {shape[dim]}"
            )
    msn = layout.min_shard_numel
    if msn is not None and (not _is_int(msn) or msn < 1):
        raise _fail(name, f"min_shard_numel {msn!r} is not an int >= 1")
    owners = layout.first_owners
    if len(owners) != layout.num_tp_pieces:
        raise _fail(
            name,
            f"first_owners {list(owners)[:8]} are not {layout.num_tp_pieces} ranks "
            f"in [0, {layout.dp_shard}) (one per tp shard)",
        )
    bad = [o for o in owners if not _is_int(o) or not 0 <= o < layout.dp_shard]
    if bad:
        raise _fail(
            name,
            f"first_owners {list(owners)[:8]}: dp shard index {bad[0]!r} beyond its count "
            f"{layout.dp_shard}",
        )


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """A piece as a reader finds it on storage: elements ``[start, stop)`` of flattened tp
    shard ``tp_index``. Pieces need not follow the layout's dp rule (a peer's checkpoint
    chunks its own way); they must only tile the tensor."""

    tp_index: int
    start: int
    stop: int


def _check_piece(layout: MeshLayout, piece: StoredPiece, name: str) -> None:
    t, start, stop = piece.tp_index, piece.start, piece.stop
    if not all(_is_int(v) for v in (t, start, stop)):
        raise _fail(name, f"piece {piece} has a non-integer field")
    if not 0 <= t < layout.num_tp_pieces:
        raise _fail(name, f"tp shard index {t} beyond its count {layout.num_tp_pieces}")
    local = math.prod(layout.local_shape(t))
    if not 0 <= start <= stop <= local:
        raise _fail(name, f"piece range [{start}, {stop}) outside tp shard {t} of {local} elements")


def stored_segments(
    layout: MeshLayout, pieces: Sequence[StoredPiece], name: str
) -> list[list[Segment]]:
    """Global segments of each stored piece, after checking its tp index and range."""
    for piece in pieces:
        _check_piece(layout, piece, name)
    return [layout.local_segments(p.tp_index, p.start, p.stop) for p in pieces]


def check_tiling(numel: int, pieces: Mapping[Any, Sequence[Segment]], name: str) -> None:
    """Raise :class:`LayoutError` unless the pieces' global segments cover ``[0, numel)``
    exactly once and each piece's offsets run from 0 without gaps or overlaps."""
    spans: list[tuple[int, int, Any]] = []
    for pid, segs in pieces.items():
        for seg in segs:
            if not isinstance(seg, tuple | list) or len(seg) != 3 or not all(map(_is_int, seg)):
                raise _fail(name, f"piece {pid!r}: segment {seg!r:.80} is not three ints")
        offset = 0
        for g, n, off in sorted(segs, key=lambda s: s[2]):
            if n < 0 or g < 0 or off < 0:
                raise _fail(name, f"piece {pid!r}: negative segment {tuple(seg)}")
            if g + n > numel:
                raise _fail(
                    name, f"piece {pid!r}: segment [{g}, {g + n}) outside the {numel} elements"
                )
            if off != offset:
                raise _fail(name, f"piece {pid!r}: offsets jump from {offset} to {off}")
            offset += n
            if n:
                spans.append((g, g + n, pid))
    spans.sort(key=lambda s: s[0])
    pos, prev = 0, None
    for lo, hi, pid in spans:
        if lo < pos:
            raise _fail(name, f"pieces {prev!r} and {pid!r} overlap at element {lo}")
        if lo > pos:
            raise _fail(name, f"elements [{pos}, {lo}) are in no piece")
        pos, prev = hi, pid
    if pos != numel:
        raise _fail(name, f"elements [{pos}, {numel}) are in no piece")


def check_stored_pieces(layout: MeshLayout, pieces: Sequence[StoredPiece], name: str) -> None:
    """Check stored pieces given as tp index + dp range against ``layout``: in range, and
    tiling the global tensor exactly.

    The tp cut maps the tp shards' elements one to one onto the global tensor, so the pieces
    tile it exactly iff in every tp shard their ranges tile the flattened shard: a 1-D check
    of the ranges, however many rows (and global segments) a piece spans."""
    by_shard: dict[int, list[tuple[int, int]]] = {t: [] for t in range(layout.num_tp_pieces)}
    for piece in pieces:
        _check_piece(layout, piece, name)
        if piece.stop > piece.start:
            by_shard[piece.tp_index].append((piece.start, piece.stop))
    for t, ranges in by_shard.items():
        ranges.sort()
        pos = 0
        for lo, hi in ranges:
            if lo < pos:
                raise _fail(name, f"tp shard {t}: pieces overlap at element {lo}")
            if lo > pos:
                raise _fail(name, f"tp shard {t}: elements [{pos}, {lo}) are in no piece")
            pos = hi
        local = math.prod(layout.local_shape(t))
        if pos != local:
            raise _fail(name, f"tp shard {t}: elements [{pos}, {local}) are in no piece")


# -- JSON -----------------------------------------------------------------------------------


def to_json(layout: MeshLayout) -> dict[str, Any]:
    return {
        "layout_version": LAYOUT_VERSION,
        "shape": list(layout.shape),
        "tp_dim": layout.tp_dim,
        "tp_degree": layout.tp_degree,
        "fused_sizes": list(layout.fused_sizes),
        "dp_shard": layout.dp_shard,
        "min_shard_numel": layout.min_shard_numel,
        "first_owners": list(layout.first_owners),
        "dp_replicate": layout.dp_replicate,
    }


_FIELDS = {"shape", "tp_dim", "tp_degree", "fused_sizes", "dp_shard", "min_shard_numel"}
_FIELDS |= {"first_owners", "dp_replicate"}


def from_json(data: object, name: str) -> MeshLayout:
    """The layout stored as ``data`` (parsed JSON read from storage), validated: any problem
    is a one-line :class:`LayoutError` naming ``name``."""
    if not isinstance(data, dict):
        raise _fail(name, f"layout is a {type(data).__name__}, not an object")
    version = data.get("layout_version")
    if version != LAYOUT_VERSION or not _is_int(version):
        raise _fail(name, f"layout version {version!r} is not {LAYOUT_VERSION}")
    missing = _FIELDS - data.keys()
    if missing:
        raise _fail(name, f"layout lacks {sorted(missing)}")
    lists = {}
    for key in ("shape", "fused_sizes", "first_owners"):
        value = data[key]
        if not isinstance(value, list) or len(value) > MAX_DEGREE:
            raise _fail(name, f"{key} {value!r:.80} is not a list")
        lists[key] = tuple(value)
    try:
        layout = MeshLayout(
            shape=lists["shape"],
            tp_dim=data["tp_dim"],
            tp_degree=data["tp_degree"],
            fused_sizes=lists["fused_sizes"],
            dp_shard=data["dp_shard"],
            min_shard_numel=data["min_shard_numel"],
            first_owners=lists["first_owners"],
            dp_replicate=data["dp_replicate"],
        )
    except LayoutError as exc:
        raise _fail(name, exc.problem) from None  # type: ignore[attr-defined]
    # The stored form must be the canonical one, or two spellings of a layout compare unequal.
    if to_json(layout) != {k: data[k] for k in _FIELDS | {"layout_version"}}:
        raise _fail(name, "layout fields are not in canonical form")
    return layout
