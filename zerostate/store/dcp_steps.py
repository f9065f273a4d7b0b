"""Steps written through ``zerostate.dcp`` read as every command reads a step: global
tensors under zerostate's names, and the layout such a step is resharded to.

[Note: DCP steps as global tensors]
A step that ``zerostate.dcp.StorageWriter`` wrote holds DCP's chunks as pieces of group
``dcp`` ([Note: DCP steps] in zerostate.dcp); the commands and ``engine.load`` read
whole logical tensors. :class:`DcpStoreStep` presents such a step the way a foreign DCP
checkpoint is presented (``zerostate.store.foreign.dcp``, [Note: DCP names]): each DCP key
is a global tensor assembled from its boxes, named ``model/<fqn>`` or ``optim/<key>/<fqn>``
after the planner's paths, with the engine state a load restores in ``attrs["engine"]``
(``source`` ``"dcp"``, so ``engine.load`` fits it to the loading engine as it fits a
peer's). The metadata is validated as ``dcp.load`` validates it (``step_contents``), and
every byte is read through the stored step, so each is checked against its crc32c. A
read of elements ``[start, stop)`` reads, from each box that meets the rows they span,
only those rows of its piece (all boxes of a read in one batch of the stored step), and
copies them into place: memory is the range read, plus at most two partial rows.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from zerostate.dcp.common import ATTR, DCP_VERSION, Piece, piece_name
from zerostate.dcp.reader import step_contents
from zerostate.errors import ConfigError, CorruptCheckpointError
from zerostate.layout.partition import TensorLayout
from zerostate.store import format as fmt
from zerostate.store.foreign.dcp import DcpNames
from zerostate.store.format import TensorInfo
from zerostate.store.step_base import StepBase
from zerostate.store.writer import TensorSpec


def is_dcp_step(st: Any) -> bool:
    """Whether ``st`` (a step of the store, as ``CheckpointRoot.step`` opens it) was written
    through ``zerostate.dcp``: its commit record holds the DCP document and no engine state."""
    attrs = st.attrs if isinstance(st.attrs, dict) else {}
    return isinstance(st.format_version, int) and ATTR in attrs and "engine" not in attrs


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """One chunk DCP planned: elements ``offsets .. offsets + sizes`` of a global tensor,
    stored as ``piece`` (owned by store rank ``rank``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    piece: str
    rank: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalTensor:
    """A DCP key's tensor: its global shape and dtype, and the boxes that tile it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]
    complex_dtype: torch.dtype | None = None
    """Set: a complex tensor, read as its real pairs (``shape`` and the boxes end in a
    dimension of 2, ``dtype`` is the pairs'), as its pieces store it ([Note: complex
    chunks] in zerostate.dcp.common)."""

    @property
    def attrs(self) -> dict:
        """The stored attributes a command sees (the complex dtype of real pairs)."""
        return {} if self.complex_dtype is None else fmt.complex_attrs(self.complex_dtype)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape DCP saved (a complex tensor's, without its pairs' dimension)."""
        return self.shape[:-1] if self.complex_dtype is not None else self.shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements of one index of dimension 0 (1 for a scalar)."""
        return math.prod(self.shape[1:])


class DcpStoreStep(StepBase):
    """A step written through ``zerostate.dcp``, read as global tensors ([Note: DCP steps
    as global tensors]). ``stored`` is the step as stored (its pieces): ``verify`` checks
    it, ``inspect`` lists its boxes."""

    format_version = "zerostate.dcp"
    supports_aliases = True
    dcp_pieces = True

    def __init__(self, stored: Any, num_threads: int = 8) -> None:
        self.stored = stored
        self.reads_locally = bool(getattr(stored, "reads_locally", False))
        metadata, pieces, values = step_contents(stored)
        planner = metadata.planner_data or {}
        self.globals: dict[str, GlobalTensor] = {}
        #: Each non-tensor value of the step, by DCP key (decoded JSON, never unpickled).
        self.values: dict[str, Any] = {}
        #: The planner's path of each DCP key (the key alone without planner data).
        self.paths: dict[str, tuple[str, ...]] = {}
        names = DcpNames()
        for key, entry in metadata.state_dict_metadata.items():
            path = tuple(str(p) for p in planner.get(key, (key,))) or (key,)
            self.paths[key] = path
            if isinstance(entry, BytesStorageMetadata):
                self.values[key] = values[key]
                names.add_object(path, values[key])
                continue
            # A complex tensor is read as its real pairs, as its pieces hold it ([Note:
            # complex chunks] in zerostate.dcp.common): one more dimension, of 2.
            dtype = entry.properties.dtype
            real = fmt.COMPLEX_DTYPES.get(dtype)
            at, two = ((0,), (2,)) if real is not None else ((), ())
            boxes = []
            for chunk in entry.chunks:
                offsets = tuple(int(o) for o in chunk.offsets)
                piece, sizes = pieces[(key, offsets)]
                first_owner = stored.tensors[piece].layout.first_owner
                boxes.append(Box((*offsets, *at), (*sizes, *two), piece, first_owner))
            shape = (*(int(d) for d in entry.size), *two)
            tensor = GlobalTensor(
                key, shape, real or dtype, tuple(boxes), dtype if real is not None else None
            )
            self.globals[key] = tensor
            names.add_tensor(path, tensor)
        self._keys: dict[str, str] = {}  # zerostate name -> DCP key, once named
        _, named, attrs = names.engine_view(stored.world_size, self._read_whole, GlobalTensor)
        self._keys = {name: t.key for name, t in named.items()}
        infos = {
            name: TensorInfo(name, t.shape, t.dtype, _read_layout(t), dict(t.attrs))
            for name, t in named.items()
        }
        super().__init__(
            stored.step, stored.world_size, attrs, infos, num_threads, thread_name="zs-dcp"
        )

    @property
    def url(self) -> str:
        return self.stored.url

    @property
    def object_count(self) -> int:
        return self.stored.object_count

    def close(self) -> None:
        super().close()
        self.stored.close()

    def alias(self, name: str, existing: str) -> None:
        """Make ``name`` read what ``existing`` reads (a buffer, which DCP keeps among the
        model's tensors, under the name a load looks for)."""
        self._keys[name] = self._keys[existing]
        info = self.tensors[existing]
        self.tensors[name] = TensorInfo(name, info.shape, info.dtype, info.layout, dict(info.attrs))

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Check every stored byte (the pieces' rows) against its crc32c."""
        self.stored.verify(progress)

    # ------------------------------------------------------------------- reads
    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.read_many([(name, start, stop, out)])[0]

    def read_many(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        keyed = []
        for name, start, stop, out in requests:
            start, stop, out = self._check_range(self.info(name), start, stop, out)
            keyed.append((self._keys[name], start, stop, out))
        return self.read_keys(keyed)

    def read_keys(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """Elements ``[start, stop)`` of the flat global tensors of DCP keys (every tensor
        of the step, those without a zerostate name too), each as a 1-D tensor (into
        ``out``), from one batch of reads of the stored step."""
        outs: list[torch.Tensor] = []
        reads: list[tuple[str, int, int, torch.Tensor | None]] = []
        copies: list[tuple[GlobalTensor, Box, torch.Tensor, int, int]] = []
        finish: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for key, start, stop, out in requests:
            tensor = self.globals.get(key)
            if tensor is None:
                raise KeyError(f"step {self.stored.step} at {self.url} has no DCP tensor {key!r}")
            if not 0 <= start <= stop <= tensor.numel:
                raise ConfigError(f"{key}: range [{start}, {stop}) is outside [0, {tensor.numel})")
            if out is None:
                out = torch.empty(stop - start, dtype=tensor.dtype)
            outs.append(out)
            if stop == start:
                continue
            row = max(1, tensor.row_numel)
            first, last = start // row, -(-stop // row)  # the rows of dim 0 it spans
            whole = start == first * row and stop == last * row
            buf = out if whole else torch.empty((last - first) * row, dtype=tensor.dtype)
            view = buf.view(last - first, *tensor.shape[1:]) if tensor.shape else buf.view(())
            for box in tensor.boxes:
                lo = max(first, box.offsets[0]) if tensor.shape else 0
                hi = min(last, box.offsets[0] + box.sizes[0]) if tensor.shape else 1
                if lo >= hi or not box.numel:
                    continue
                inner = box.numel // box.sizes[0] if tensor.shape else 1
                a = (lo - box.offsets[0]) * inner if tensor.shape else 0
                b = a + (hi - lo) * inner
                dest = view[lo - first : hi - first] if tensor.shape else view
                if tensor.shape and box.sizes[1:] == tensor.shape[1:]:
                    reads.append((box.piece, a, b, dest.reshape(-1)))  # lands in place
                else:
                    reads.append((box.piece, a, b, None))
                    copies.append((tensor, box, dest, len(reads) - 1, hi - lo))
            if not whole:
                finish.append((out, buf, start - first * row))
        datas = self._read_stored(reads)
        for tensor, box, dest, index, rows in copies:
            data = datas[index]
            if tensor.shape:
                data = data.view(rows, *box.sizes[1:])
                for dim in range(1, len(tensor.shape)):
                    dest = dest.narrow(dim, box.offsets[dim], box.sizes[dim])
            dest.copy_(data.view(dest.shape))
        for out, buf, at in finish:
            out.copy_(buf[at : at + out.numel()])
        return outs

    def _read_stored(self, reads: list[tuple[str, int, int, torch.Tensor | None]]) -> list:
        """The stored step's reads, checked; a damaged piece is named by its DCP key."""
        try:
            return self.stored.read_many(reads)
        except CorruptCheckpointError as exc:
            for piece, a, b, _ in reads:  # which piece: each on its own
                try:
                    self.stored.read_many([(piece, a, b, None)])
                except CorruptCheckpointError as one:
                    where = f"step {self.stored.step} at {self.url}"
                    raise CorruptCheckpointError(
                        f"{self._describe_piece(piece)} in {where} is damaged: {one}"
                    ) from exc
            raise

    def _describe_piece(self, piece: str) -> str:
        for tensor in self.globals.values():
            for box in tensor.boxes:
                if box.piece == piece:
                    shown = [name for name, key in self._keys.items() if key == tensor.key]
                    named = f" ({shown[0]})" if shown else ""
                    return f"{tensor.key}{named}, the chunk at {list(box.offsets)}"
        return piece

    def _read_whole(self, tensor: GlobalTensor) -> torch.Tensor:
        (out,) = self.read_keys([(tensor.key, 0, tensor.numel, None)])
        return out.reshape(tensor.shape)


def _read_layout(tensor: GlobalTensor) -> TensorLayout:
    """How a command reads the tensor: in blocks of dimension-0 rows as tall as its tallest
    box (FSDP2's Shard(0) boxes, one block each), so a consolidation holds about a box's
    rows, never the whole tensor unless one box is."""
    numel = tensor.numel
    if not tensor.shape or not numel:
        return TensorLayout(numel, 1, max(1, numel), 0)
    rows = max((b.sizes[0] for b in tensor.boxes if b.numel), default=tensor.shape[0])
    chunk = max(1, rows) * tensor.row_numel
    return TensorLayout(numel, -(-numel // chunk), chunk, 0)


# ------------------------------------------------------------------ resharding
@dataclasses.dataclass(frozen=True, slots=True)
class ShardedPlan:
    """A DCP step laid out for ``world_size`` ranks (:func:`fsdp_plan`): the specs of its
    pieces, each piece's ``(DCP key, flat start, flat stop)`` of its global tensor, and the
    commit record's DCP document."""

    world_size: int
    specs: list[TensorSpec]
    sources: dict[str, tuple[str, int, int]]
    document: dict


def fsdp_plan(st: DcpStoreStep, world_size: int) -> ShardedPlan:
    """The step ``dcp.save`` of FSDP2 (``fully_shard``, ``Shard(0)``) at ``world_size`` ranks
    writes for the state ``st`` holds.

    [Note: DCP reshard layout]
    A DCP step is resharded into a DCP step (``dcp.load`` through ``StorageReader`` still
    reads it): each tensor as FSDP2 shards it, rows split as ``torch.chunk`` splits them
    (``ceil(rows / world_size)`` each, ranks past the end an empty box), except a tensor
    that is replicated: a scalar, or one the source stores whole in one box although it was
    saved by several ranks (a buffer FSDP2 does not shard). DCP's planner writes a
    replicated tensor once, on the rank with the least bytes planned so far
    (``dedup_save_plans``: items in the order of the ranks' plans, non-tensor values on the
    coordinator only), and numbers each rank's pieces in the order of its plan, the state
    dict's flattened order (the planner's data). This does the same, so the pieces an
    FSDP2 job writes at ``world_size`` ranks are the pieces a reshard to ``world_size``
    writes, and a reshard there and back gives the source's row objects byte for byte."""
    order = [*plan_order(st), *st.values]
    replicated = {
        key
        for key, t in st.globals.items()
        if not t.shape or (st.world_size > 1 and len(t.boxes) == 1 and t.boxes[0].sizes == t.shape)
    }

    def box(t: GlobalTensor, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if t.key in replicated:
            return (0,) * len(t.shape), t.shape
        rows = -(-t.shape[0] // world_size)
        lo, hi = min(rank * rows, t.shape[0]), min((rank + 1) * rows, t.shape[0])
        return (lo, *(0,) * (len(t.shape) - 1)), (hi - lo, *t.shape[1:])

    # Each rank's plan: (key, offsets, sizes) in the flattened order; values on rank 0.
    plans: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = []
    for rank in range(world_size):
        plan = []
        for key in order:
            if key in st.globals:
                plan.append((key, *box(st.globals[key], rank)))
            elif rank == 0:
                plan.append((key, (), ()))
        plans.append(plan)
    # DCP's dedup: each item once, on the plan with the least storage planned so far.
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    first_seen: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for rank, plan in enumerate(plans):
        for key, offsets, sizes in plan:
            holders.setdefault((key, offsets), []).append(rank)
            first_seen.setdefault((key, offsets), sizes)
    size = [0] * world_size
    owner: dict[tuple[str, tuple[int, ...]], int] = {}
    for index, ranks in holders.items():
        chosen = min(ranks, key=lambda r: size[r])
        key, sizes = index[0], first_seen[index]
        tensor = st.globals.get(key)
        nbytes = math.prod(sizes) * tensor.dtype.itemsize if tensor is not None else 0
        size[chosen] += nbytes or 1
        owner[index] = chosen
    pieces: list[Piece] = []
    sources: dict[str, tuple[str, int, int]] = {}
    for rank, plan in enumerate(plans):
        seq = 0
        for key, offsets, sizes in plan:
            tensor = st.globals.get(key)
            if tensor is None or owner[(key, offsets)] != rank:
                continue
            name = piece_name(rank, seq, key)
            start = offsets[0] * tensor.row_numel if tensor.shape else 0
            sources[name] = (key, start, start + math.prod(sizes))
            if tensor.complex_dtype is not None:  # the box DCP plans: its pairs' dimension off
                offsets, sizes, dtype = offsets[:-1], sizes[:-1], tensor.complex_dtype
            else:
                dtype = tensor.dtype
            pieces.append(Piece(name, key, offsets, sizes, dtype, rank))
            seq += 1
    return ShardedPlan(
        world_size,
        [p.spec(world_size) for p in pieces],
        sources,
        _document(st, pieces),
    )


_PIECE = re.compile(r"dcp/r(\d{5})\.(\d{7})\.")


def plan_order(st: DcpStoreStep) -> list[str]:
    """The DCP keys of the step's tensors in the order of the state dict DCP flattened,
    as far as the pieces record it: each rank numbered its pieces in that order, so every
    rank's sequence is a part of it, and together (a tensor sharded over several ranks
    links them) they give it. Keys no sequence orders come by their first piece's number."""
    after: dict[str, set[str]] = {key: set() for key in st.globals}
    before: dict[str, int] = dict.fromkeys(st.globals, 0)
    first: dict[str, tuple[int, int]] = {}
    sequences: dict[int, list[tuple[int, str]]] = {}
    for key, tensor in st.globals.items():
        for box in tensor.boxes:
            found = _PIECE.match(box.piece)
            rank, seq = (int(found.group(1)), int(found.group(2))) if found else (0, 1 << 62)
            sequences.setdefault(rank, []).append((seq, key))
            first[key] = min(first.get(key, (seq, rank)), (seq, rank))
    for items in sequences.values():
        items.sort()
        for (_, a), (_, b) in zip(items, items[1:], strict=False):
            if a != b and b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready = [(first.get(k, (0, 0)), k) for k, n in before.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, key = heapq.heappop(ready)
        order.append(key)
        for nxt in after[key]:
            before[nxt] -= 1
            if not before[nxt]:
                heapq.heappush(ready, (first.get(nxt, (0, 0)), nxt))
    if len(order) != len(st.globals):  # ranks that disagree: not DCP's numbering
        order += [key for key in st.globals if key not in set(order)]
    return order


def _document(st: DcpStoreStep, pieces: list[Piece]) -> dict:
    """The source's DCP document with the new chunks: values, planner data and torch's
    version as saved."""
    document = dict(st.stored.attrs[ATTR])
    if document.get("version") != DCP_VERSION:  # step_contents checked it
        raise CorruptCheckpointError(f"{st.url}: DCP metadata version changed while read")
    by_key: dict[str, list[dict]] = {key: [] for key in st.globals}
    for p in pieces:
        by_key[p.fqn].append({"offsets": list(p.offsets), "sizes": list(p.sizes), "piece": p.name})
    document["tensors"] = {
        key: {
            "dtype": document["tensors"][key]["dtype"],
            "shape": list(t.logical_shape),
            "chunks": sorted(by_key[key], key=lambda c: c["offsets"]),
        }
        for key, t in st.globals.items()
    }
    return document


__all__ = ["ATTR", "Box", "DcpStoreStep", "GlobalTensor", "ShardedPlan", "fsdp_plan", "is_dcp_step"]
