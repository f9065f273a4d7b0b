"""The DCP storage reader: the step's metadata parsed and validated, chunks read and checked
([Note: DCP steps] in zerostate.dcp)."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from zerostate import jsonstate
from zerostate.dcp.common import (
    ATTR,
    DCP_VERSION,
    GROUP,
    MAX_DIMS,
    READ_BATCH_NBYTES,
    GcHold,
    _check_fqn,
    _check_step,
    _ints,
    _planner_data,
    _root_text,
    check_boxes,
    document_dtype,
    document_dtype_name,
    stored_as,
)
from zerostate.dcp.writer import StorageWriter
from zerostate.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedMismatchError,
)
from zerostate.store import format as fmt
from zerostate.store.root import CheckpointRoot


@dataclasses.dataclass(frozen=True)
class _Step:
    """A validated DCP step: torch's metadata, and where each chunk's bytes are."""

    step: int
    metadata: Metadata
    pieces: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]  # -> name, sizes
    values: dict[str, Any]


class StorageReader(dcp_storage.StorageReader):
    """DCP's storage reader of a zerostate checkpoint root (a path or fsspec URL).

    ``step`` None reads the newest committed step (the same one on every rank: checked
    when the ranks' plans meet). ``checkpoint_id`` given to ``dcp.load`` replaces the root.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        step: int | None = None,
        *,
        storage_options: dict | None = None,
        num_threads: int = 8,
    ) -> None:
        super().__init__()
        self.root = _root_text(root)
        self.requested_step = _check_step(step)
        self.storage_options = dict(storage_options or {})
        self.num_threads = int(num_threads)
        #: The step the last ``read_metadata`` opened.
        self.step: int | None = None
        self._state: _Step | None = None
        self._reader: Any = None
        self._gc = GcHold()  # [Note: the heap held out of collections] in zerostate.dcp.common

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_state=None, _reader=None, _gc=GcHold())
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.root = _root_text(checkpoint_id)
        self.close()
        self._state = None

    def close(self) -> None:
        self._gc.release()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:
        self.close()
        root = CheckpointRoot.open(
            self.root, self.storage_options or None, num_threads=self.num_threads
        )
        reader = root.step(self.requested_step)
        try:
            self._state = _parse_step(reader)
        except BaseException:
            reader.close()
            raise
        self._reader, self.step = reader, reader.step
        return self._state.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._state is None or metadata is not self._state.metadata:
            raise CheckpointError(
                "zerostate.dcp.StorageReader reads the metadata it parsed itself; call "
                "read_metadata() on this reader first"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self._gc.hold()  # until read_data's close, or the next reset
        # The step each rank opened travels with its plan: ranks that resolved "newest"
        # across a concurrent commit must not mix two steps.
        return dataclasses.replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) != 1:
            self._gc.release()
            raise DistributedMismatchError(
                f"ranks opened different steps of {self.root} ({steps}): a step was committed "
                "while they read; pass step= to StorageReader to load one step on every rank"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        state, reader = self._state, self._reader
        if state is None or reader is None:
            raise CheckpointError("internal: read_data() before read_metadata()")
        tensors: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                fqn = item.storage_index.fqn
                if fqn not in state.values:
                    raise CorruptCheckpointError(f"step {state.step}: no value stored for {fqn!r}")
                _load_value(planner, item, state.values[fqn])
            else:
                tensors.append(item)
        try:
            batch: list[tuple[ReadItem, str, tuple[int, ...], int, int, int]] = []
            nbytes = 0
            for item in tensors:
                request = _read_request(state, item)
                batch.append(request)
                nbytes += (request[4] - request[3]) * reader.info(request[1]).dtype.itemsize
                if nbytes >= READ_BATCH_NBYTES:
                    _read_batch(reader, state, batch, planner)
                    batch, nbytes = [], 0
            if batch:
                _read_batch(reader, state, batch, planner)
        finally:
            # DCP never closes a reader: release the step's read threads once read.
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _load_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand a decoded non-tensor value to the planner without any unpickling.

    DCP's ``DefaultLoadPlanner.load_bytes`` would ``torch.load(weights_only=False)`` the
    bytes it is given; for it (and subclasses that keep its ``load_bytes``) the value goes
    where that method would put it, as the object decoded from the validated JSON. A planner
    with a ``load_bytes`` of its own gets bytes this module serialised from that object
    (dicts, lists, tuples, strings, numbers, bytes, BytesIO buffers and tensors, never bytes
    read from storage), as DCP's contract requires."""
    value = copy.deepcopy(value)  # the parsed step may serve another load
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        fqn = item.dest_index.fqn
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)


def _read_request(
    state: _Step, item: ReadItem
) -> tuple[ReadItem, str, tuple[int, ...], int, int, int]:
    """``(item, piece, box sizes, start, stop, per)``: the flat element range of the piece
    that holds the rows (first dimension) the item needs, in stored elements, ``per`` of
    them to an element of the box (2: a complex box's real pairs)."""
    index = item.storage_index
    key = (index.fqn, tuple(int(o) for o in (index.offset or ())))
    found = state.pieces.get(key)
    if found is None:
        raise CorruptCheckpointError(
            f"step {state.step}: {index.fqn} has no chunk at offsets {list(key[1])}"
        )
    name, sizes = found
    offsets = [int(o) for o in item.storage_offsets]
    lengths = [int(n) for n in item.lengths]
    if len(offsets) != len(sizes) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes, strict=True)
    ):
        raise ConfigError(
            f"{index.fqn}: the load plan asks for {lengths} at {offsets} of a chunk of "
            f"{list(sizes)}"
        )
    # Elements of the stored piece: a complex box's are its real pairs, two per element
    # ([Note: complex chunks] in zerostate.dcp.common).
    per = 2 if _tensor_dtype(state, index.fqn) in fmt.COMPLEX_DTYPES else 1
    if not sizes:  # a scalar
        return item, name, sizes, 0, per, per
    row = math.prod(sizes[1:]) * per
    return item, name, sizes, offsets[0] * row, (offsets[0] + lengths[0]) * row, per


def _tensor_dtype(state: _Step, fqn: str) -> torch.dtype | None:
    entry = state.metadata.state_dict_metadata.get(fqn)
    return entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else None


def _read_batch(reader: Any, state: _Step, batch: list[tuple], planner: LoadPlanner) -> None:
    """Read the batch's ranges in one pass (checksummed), then hand each box to the planner."""
    requests = [(name, start, stop, None) for _, name, _, start, stop, _ in batch]
    try:
        datas = reader.read_many(requests)
    except CorruptCheckpointError:
        # Name the tensors: read each range on its own to find which ones are damaged.
        for item, name, _, start, stop, _ in batch:
            try:
                reader.read_many([(name, start, stop, None)])
            except CorruptCheckpointError as exc:
                fqn = item.storage_index.fqn
                raise CorruptCheckpointError(
                    f"{fqn} (chunk at {list(item.storage_index.offset or ())}) in step "
                    f"{state.step} is damaged: {exc}"
                ) from exc
        raise
    for (item, _, sizes, _, _, per), data in zip(batch, datas, strict=True):
        pairs = (2,) if per == 2 else ()
        if sizes:
            data = data.view(int(item.lengths[0]), *sizes[1:], *pairs)
            for dim in range(1, len(sizes)):
                data = data.narrow(dim, int(item.storage_offsets[dim]), int(item.lengths[dim]))
        else:
            data = data.view(pairs)
        target = planner.resolve_tensor(item).detach()
        dest = target
        if pairs:
            # The real pairs go into the complex target's own memory, bit for bit ([Note:
            # complex chunks] in zerostate.dcp.common).
            if target.dtype not in fmt.COMPLEX_DTYPES:
                raise ConfigError(
                    f"{item.dest_index.fqn}: the step holds a complex tensor, the planner's "
                    f"target is {target.dtype}"
                )
            dest = torch.view_as_real(target)
        if tuple(dest.shape) != tuple(data.shape):
            raise ConfigError(
                f"{item.dest_index.fqn}: the planner's target has shape {list(target.shape)}, "
                f"the stored box {list(data.shape)[: data.dim() - len(pairs)]}"
            )
        dest.copy_(data)
        planner.commit_tensor(item, target)


# ----------------------------------------------------------------- parsing a step
def describe_step(reader: Any) -> list[dict[str, Any]] | None:
    """The DCP tensors and values of an open step, validated, for tools (``zerostate
    inspect``): ``{"key", "kind": "tensor", "shape", "dtype", "chunks": [{"offsets", "sizes",
    "piece", "rank"}]}`` or ``{"key", "kind": "value"}``; None for a step not written
    through this module."""
    if not isinstance(reader.format_version, int):
        return None  # a foreign checkpoint (DeepSpeed, torch's own DCP files), not a step
    if not isinstance(reader.attrs, dict) or ATTR not in reader.attrs:
        return None
    state = _parse_step(reader)
    out: list[dict[str, Any]] = []
    for key, entry in state.metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            out.append({"key": key, "kind": "value"})
            continue
        chunks = []
        for chunk in entry.chunks:
            name, _ = state.pieces[(key, tuple(chunk.offsets))]
            rank = reader.tensors[name].layout.first_owner
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "piece": name,
                    "rank": rank,
                }
            )
        out.append(
            {
                "key": key,
                "kind": "tensor",
                "shape": list(entry.size),
                "dtype": document_dtype_name(entry.properties.dtype),
                "chunks": chunks,
            }
        )
    return out


def step_contents(
    reader: Any,
) -> tuple[Metadata, dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]], dict]:
    """``(metadata, pieces, values)`` of an open step written through this module, validated
    as a load validates it: torch's metadata, ``{(key, box offsets): (piece, box sizes)}``
    and each non-tensor value decoded from its JSON. For the store's commands, which read
    such a step as global tensors (``zerostate.store.dcp_steps``)."""
    state = _parse_step(reader)
    return state.metadata, dict(state.pieces), dict(state.values)


@fmt.gc_paused  # [Note: GC paused while parsing] in zerostate.store.format
def _parse_step(reader: Any) -> _Step:
    """Validate a committed step's DCP document against its pieces; see [Note: DCP steps]."""
    where = f"step {reader.step} at {reader.url}"
    doc = reader.attrs.get(ATTR) if isinstance(reader.attrs, dict) else None
    if doc is None:
        raise CheckpointError(
            f"{where} was not written through zerostate.dcp (its commit record has no DCP "
            "metadata); load it with zerostate.Engine.load or read it with the CLI"
        )
    if not isinstance(doc, dict) or doc.get("version") != DCP_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise CorruptCheckpointError(
            f"{where}: DCP metadata version {version!r} is not {DCP_VERSION} (damaged, or "
            "written by a newer zerostate)"
        )
    tensors, values = doc.get("tensors"), doc.get("values")
    if not isinstance(tensors, dict) or not isinstance(values, dict):
        raise CorruptCheckpointError(f"{where}: DCP metadata lacks 'tensors' or 'values'")
    state_dict_metadata: dict[str, Any] = {}
    pieces: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}
    used: set[str] = set()
    for fqn, entry in tensors.items():
        what = f"{where}: tensor {fqn!r}"
        _check_fqn(fqn, where)
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{what}: entry is not an object")
        dtype = document_dtype(entry.get("dtype"))
        shape = _ints(entry.get("shape"), f"{what}: shape", MAX_DIMS)
        chunks = entry.get("chunks")
        if not isinstance(chunks, list):
            raise CorruptCheckpointError(f"{what}: chunks is not a list")
        boxes = []
        for i, chunk in enumerate(chunks):
            cwhere = f"{what}: chunk {i}"
            if not isinstance(chunk, dict):
                raise CorruptCheckpointError(f"{cwhere} is not an object")
            offsets = _ints(chunk.get("offsets"), f"{cwhere}: offsets", MAX_DIMS)
            sizes = _ints(chunk.get("sizes"), f"{cwhere}: sizes", MAX_DIMS)
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise CorruptCheckpointError(
                    f"{cwhere}: offsets {list(offsets)} / sizes {list(sizes)} do not have the "
                    f"{len(shape)} dimensions of shape {list(shape)}"
                )
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
                raise CorruptCheckpointError(
                    f"{cwhere}: box at {list(offsets)} of {list(sizes)} lies outside the "
                    f"tensor's shape {list(shape)}"
                )
            name = chunk.get("piece")
            fmt.validate_name(name, what=f"{cwhere}: piece")
            info = reader.tensors.get(name)
            if info is None or not name.startswith(f"{GROUP}/"):
                raise CorruptCheckpointError(f"{cwhere}: piece {name!r} is not in the step")
            if name in used:
                raise CorruptCheckpointError(f"{cwhere}: piece {name!r} serves two chunks")
            # A complex box is stored as its real pairs ([Note: complex chunks] in
            # zerostate.dcp.common), and only such a piece names a complex dtype.
            want_sizes, want_dtype, _ = stored_as(sizes, dtype)
            if tuple(info.shape) != want_sizes or info.dtype != want_dtype:
                pairs = (
                    f" (the real pairs of {document_dtype_name(dtype)})"
                    if want_dtype != dtype
                    else ""
                )
                raise CorruptCheckpointError(
                    f"{cwhere}: piece {name!r} holds {fmt.dtype_name(info.dtype)} "
                    f"{list(info.shape)}, the box needs {fmt.dtype_name(want_dtype)} "
                    f"{list(want_sizes)}{pairs}"
                )
            held = fmt.complex_dtype(info.attrs, info.dtype, info.shape, f"{cwhere}: piece")
            if held != (dtype if want_dtype != dtype else None):
                raise CorruptCheckpointError(
                    f"{cwhere}: piece {name!r} is marked "
                    f"{document_dtype_name(held) if held else 'real'}, the tensor is "
                    f"{document_dtype_name(dtype)}"
                )
            if (fqn, offsets) in pieces:
                raise CorruptCheckpointError(f"{cwhere}: two chunks at offsets {list(offsets)}")
            used.add(name)
            pieces[(fqn, offsets)] = (name, sizes)
            boxes.append((offsets, sizes))
        check_boxes(shape, boxes, what)
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes],
        )
    decoded: dict[str, Any] = {}
    for fqn, value in values.items():
        _check_fqn(fqn, where)
        if fqn in state_dict_metadata:
            raise CorruptCheckpointError(f"{where}: {fqn!r} is both a tensor and a value")
        decoded[fqn] = jsonstate.decode(value, f"{where}: value {fqn!r}")
        state_dict_metadata[fqn] = BytesStorageMetadata()
    planner_data = doc.get("planner_data")
    if planner_data is not None:
        planner_data = _planner_data(
            jsonstate.decode(planner_data, f"{where}: planner data"), where
        )
    version = doc.get("dcp_version")
    if version is not None and not isinstance(version, str):
        raise CorruptCheckpointError(f"{where}: dcp_version is not a string")
    modules = doc.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise CorruptCheckpointError(f"{where}: modules is not a list of strings")
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_meta=StorageMeta(checkpoint_id=reader.url, modules=list(modules)),
        version=version,
    )
    return _Step(reader.step, metadata, pieces, decoded)
