"""Format 3: tensors stored as their tensor-parallel x data-parallel pieces.

[Note: mesh tensors]
Format 3 is format 2 (rows, slots, checksums, the commit protocol: ``docs/format.md``) plus
one optional entry per tensor, ``"mesh"``: the tensor's
:class:`~zerostate.layout.mesh_layout.MeshLayout` as JSON ([Note: tensor-parallel layouts] in
``zerostate.layout.mesh_layout``). A tensor with a mesh entry is the *logical* tensor of the
mesh entry's ``shape``, stored as a flat *stored array* of format-2 rows:

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
(:func:`zerostate.layout.mesh_layout.from_json`) and that the stored layout is exactly the one above
before anything is read, and show the logical tensor: a read of logical elements
``[start, stop)`` is planned by :func:`zerostate.layout.planner.plan_logical`, and a range of
a tp shard of another layout (an engine view on a mesh, a target piece of ``reshard``:
``read_layout_many``) by :func:`zerostate.layout.planner.plan_range`; either reads, per source
piece, the one stored span its copies touch (:func:`stored_start` places the piece), so
memory follows the request, never the whole tensor. A stored layout that is not exactly
the one above (pieces that would overlap in its chunks, stored elements outside the tensor,
pieces beyond the step's rows) is refused when the step is opened. A step holding
any mesh tensor says ``format_version`` 3 everywhere; readers of version 2 refuse it rather
than show stored arrays as tensors.
"""

from __future__ import annotations

import functools
from typing import Any

from zerostate.errors import LayoutError
from zerostate.layout.mesh_layout import MeshLayout, PieceId
from zerostate.layout.partition import TensorLayout

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
        last = divmod(pieces - 1, mesh.dp_shard)
        raise LayoutError(
            f"tensor {name!r}: piece {last} lies outside the step's {world_size} rows "
            f"({mesh.num_tp_pieces} tp x {mesh.dp_shard} dp pieces, one row each)"
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
    if layout == expected:
        return
    what = f"tensor {name!r}: stored layout {layout.to_json()} is not its mesh entry's"
    if layout.chunk_numel < expected.chunk_numel:
        raise LayoutError(
            f"{what}: pieces of up to {expected.chunk_numel} elements would overlap in "
            f"chunks of {layout.chunk_numel}"
        )
    if layout.numel > expected.numel or layout.chunk_numel > expected.chunk_numel:
        raise LayoutError(
            f"{what}: {layout.numel} stored elements in chunks of {layout.chunk_numel}, where "
            f"its pieces take {expected.numel} in chunks of {expected.chunk_numel}: stored "
            "elements lie outside the tensor"
        )
    raise LayoutError(f"{what} ({expected.to_json()})")


def stored_start(mesh: MeshLayout, layout: TensorLayout, piece: PieceId) -> int:
    """The element of the stored array (of ``layout``) where ``piece`` begins: a planned
    copy's ``source_offset`` counts from there ([Note: mesh tensors])."""
    return piece_index(mesh, piece) * layout.chunk_numel


def piece_values(mesh: MeshLayout, flat: Any, piece: PieceId, chunk: int) -> Any:
    """Piece ``piece`` of the logical tensor ``flat`` (1-D torch tensor), padded with zeros to
    ``chunk`` elements: what its row stores (writers and tests build stored arrays with it)."""
    import torch

    out = torch.zeros(chunk, dtype=flat.dtype)
    for g, n, p in mesh.segments(piece):
        out[p : p + n] = flat[g : g + n]
    return out
