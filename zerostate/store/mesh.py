"""Format 3: tensors stored as their tensor-parallel x data-parallel pieces.

[Note: mesh tensors]
Format 3 is format 2 (rows, slots, checksums, the commit protocol: ``docs/format.md``) plus
one optional entry per tensor, ``"mesh"``: the tensor's :class:`~zerostate.layout.MeshLayout`
as JSON ([Note: tensor-parallel layouts] in ``zerostate.layout``). A tensor with a mesh entry
is the *logical* tensor of the mesh entry's ``shape``, stored as a flat *stored array* of
format-2 rows:

* its pieces ``(t, d)`` (tp shard ``t``, data-parallel rank ``d``) are numbered
  ``t * dp_shard + d``, ``P = num_tp_pieces * dp_shard`` of them, and piece ``i`` is chunk
  ``i`` of the stored array, owned by row ``i`` (``first_owner`` 0);
* every chunk is ``c = max(1, largest piece)`` elements: a piece's elements first, in piece
  order (:meth:`MeshLayout.segments` says where each lies in the logical tensor), then zeros;
* so the stored array is ``P * c`` elements, its entry's ``shape`` is ``[P * c]`` and its
  ``layout`` is ``{"numel": P*c, "world_size": W, "chunk_numel": c, "first_owner": 0}``,
  with ``P <= W`` (rows past ``P`` hold none of it). A logical tensor of 0 elements stores
  nothing: ``numel`` 0.

A writer at tp ``M`` x dp ``K`` is a step of world size ``M * K``; rank ``t * K + d`` writes
piece ``(t, d)`` of every tensor (a tensor replicated across tp: rank ``d`` writes piece
``(0, d)``, tp ranks above 0 write nothing of it). Readers check the mesh entry
(:func:`zerostate.layout.from_json`) and that the stored layout is exactly the one above
before anything is read, and show the logical tensor: a read of logical elements
``[start, stop)`` reads, per piece, the one stored range holding the outer rows it touches
(:func:`piece_reads`), so memory follows the request, never the whole tensor. A step holding
any mesh tensor says ``format_version`` 3 everywhere; readers of version 2 refuse it rather
than show stored arrays as tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerostate.errors import LayoutError
from zerostate.layout import MeshLayout, PieceId
from zerostate.partition import TensorLayout, chunk_reads

#: The format version of a step holding any mesh tensor.
VERSION = 3


def num_pieces(mesh: MeshLayout) -> int:
    return mesh.num_tp_pieces * mesh.dp_shard


def piece_index(mesh: MeshLayout, piece: PieceId) -> int:
    """The chunk (and row) of the stored array holding ``piece``."""
    return piece[0] * mesh.dp_shard + piece[1]


def stored_layout(mesh: MeshLayout, world_size: int, name: str = "<tensor>") -> TensorLayout:
    """The format-2 layout of ``mesh``'s stored array in a step of ``world_size`` rows."""
    pieces = num_pieces(mesh)
    if pieces > world_size:
        raise LayoutError(
            f"{name}: {mesh.num_tp_pieces} tp x {mesh.dp_shard} dp pieces do not fit the "
            f"step's {world_size} rows"
        )
    if mesh.numel == 0:
        return TensorLayout(0, world_size, 1, 0)
    chunk = max(1, _largest_piece(mesh))
    return TensorLayout(pieces * chunk, world_size, chunk, 0)


@functools.lru_cache(maxsize=1024)
def _largest_piece(mesh: MeshLayout) -> int:
    """Elements of ``mesh``'s largest piece. Cached: a model repeats a few layouts in every
    layer, and opening a step checks each tensor's (the report's layout row: 171 mesh
    tensors took 30 ms of a 4-rank open on this machine, most of it here)."""
    return max(mesh.piece_numel(p) for p in mesh.piece_ids())


def check_stored(mesh: MeshLayout, layout: TensorLayout, name: str) -> None:
    """A stored array's layout read from storage must be exactly :func:`stored_layout`."""
    expected = stored_layout(mesh, layout.world_size, name)
    if layout != expected:
        raise LayoutError(
            f"{name}: stored layout {layout.to_json()} is not the one its mesh entry gives "
            f"({expected.to_json()})"
        )


@dataclass(frozen=True, slots=True)
class PieceRead:
    """Stored elements ``[start, stop)`` (of the stored array), and where they go: each
    ``(out offset, offset in this read, numel)``."""

    start: int
    stop: int
    copies: tuple[tuple[int, int, int], ...]


def piece_reads(mesh: MeshLayout, chunk: int, start: int, stop: int) -> list[PieceRead]:
    """What to read of the stored array (chunks of ``chunk`` elements) for logical elements
    ``[start, stop)``, and where each element goes in the result (offsets from ``start``).

    Around the tp dim the logical tensor is ``outer`` rows; the request touches rows
    ``o0..o1``, and in each tp shard exactly the same rows, which are one contiguous local
    range: its chunks (pieces) are read whole over that range, then cut into segments. A
    tensor replicated across tp (or sharded on dim 0) has one row: the request itself."""
    if not 0 <= start <= stop <= mesh.numel:
        raise LayoutError(f"range [{start}, {stop}) outside a tensor of {mesh.numel} elements")
    if start == stop:
        return []
    reads: list[PieceRead] = []
    for t, lo, hi in _local_ranges(mesh, start, stop):
        dp = mesh.dp_layout(t)
        for read in chunk_reads(dp, lo, hi):
            rank = dp.chunk_owner(read.chunk_index)
            local_a = lo + read.out_start
            local_b = local_a + (read.chunk_stop - read.chunk_start)
            copies = []
            for g, n, p in mesh.local_segments(t, local_a, local_b):
                a, b = max(g, start), min(g + n, stop)
                if a < b:
                    copies.append((a - start, p + a - g, b - a))
            if copies:
                base = piece_index(mesh, (t, rank)) * chunk + read.chunk_start
                reads.append(
                    PieceRead(base, base + read.chunk_stop - read.chunk_start, tuple(copies))
                )
    return reads


def _local_ranges(mesh: MeshLayout, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """``(tp shard, local start, local stop)``: the elements of each tp shard lying in the
    outer rows that logical ``[start, stop)`` touches."""
    if mesh.tp_dim is None:
        yield 0, start, stop
        return
    inner = math.prod(mesh.shape[mesh.tp_dim + 1 :])
    row = mesh.shape[mesh.tp_dim] * inner
    if row == 0:
        return
    first, last = start // row, (stop - 1) // row
    for t in range(mesh.num_tp_pieces):
        local_row = mesh.local_shape(t)[mesh.tp_dim] * inner
        if local_row:
            yield t, first * local_row, (last + 1) * local_row


def piece_values(mesh: MeshLayout, flat: Any, piece: PieceId, chunk: int) -> Any:
    """Piece ``piece`` of the logical tensor ``flat`` (1-D torch tensor), padded with zeros to
    ``chunk`` elements: what its row stores (writers and tests build stored arrays with it)."""
    import torch

    out = torch.zeros(chunk, dtype=flat.dtype)
    for g, n, p in mesh.segments(piece):
        out[p : p + n] = flat[g : g + n]
    return out
