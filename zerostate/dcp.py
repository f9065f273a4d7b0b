"""torch.distributed.checkpoint (DCP) storage plug-ins that write and read zerostate's store.

``dcp.save(state, storage_writer=StorageWriter(root))`` and
``dcp.load(state, storage_reader=StorageReader(root))`` keep torch's planners (what is
saved, deduplication of replicated tensors, resharding on load) and replace only the
storage: a step of the store (``docs/format.md``, version 2) instead of ``.distcp`` files
and a pickled ``.metadata``. ``docs/dcp.md`` describes the mapping.

[Note: DCP steps]
Every chunk DCP plans (an N-D box of a global tensor, written by one rank) is one *piece*:
a tensor of the step, in the group ``dcp``, of the box's shape, owned whole by the rank that
writes it (layout ``chunk_numel = numel``, ``first_owner = rank``). Piece names start with
the writing rank (``dcp/r<rank>.<seq>.<fqn>``), so each rank's pieces lie back to back in
its row and each rank writes one checksummed row object. The commit record's
``attrs["dcp"]`` holds DCP's metadata as JSON: for each tensor its global shape, dtype and
chunk boxes with the piece holding each; each non-tensor value (DCP's ``BYTE_IO`` items:
an optimizer's ``param_groups``, a scheduler's state) in ``zerostate.jsonstate``'s lossless
encoding; the planner's key mapping. Nothing is pickled: a value JSON cannot hold is
refused at save time, naming its key.

Commit: every rank writes its row and manifest in ``write_data``; DCP then gathers the
results on the coordinator, whose ``finish`` writes the commit record (with the metadata)
last, so the step is invisible until every rank's writes are durable.

On load, the metadata is validated before use (names, dtypes, shapes; the boxes of each
tensor lie inside it, do not overlap and tile it; each box's piece exists with the box's
shape and dtype), every byte read is checked against its crc32c, and non-tensor values
reach the planner as bytes this module serialised from the validated JSON, never as bytes
read from storage.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import uuid
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import storage as dcp_storage
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
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zerostate import jsonstate
from zerostate.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedMismatchError,
)
from zerostate.partition import TensorLayout
from zerostate.store import format as fmt
from zerostate.store.root import CheckpointRoot
from zerostate.store.writer import StepExistsError, StepWriter, TensorSpec

__all__ = ["GROUP", "StorageReader", "StorageWriter", "check_boxes", "describe_step"]

#: The state group holding every piece of a DCP step.
GROUP = "dcp"
#: Key of the DCP document in the commit record's ``attrs``, and its version.
ATTR = "dcp"
DCP_VERSION = 1
#: At most this many dimensions in a tensor (as the store's shapes).
MAX_DIMS = 64
#: Bytes of pieces one read batch holds in memory at once.
READ_BATCH_NBYTES = 256 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _piece_name(rank: int, seq: int, fqn: str) -> str:
    """A valid store name for piece ``seq`` of ``rank`` that still shows the FQN: the rank
    first, so each rank's pieces are adjacent in name (slot) order."""
    readable = _UNSAFE.sub("_", fqn)[:150]
    name = f"r{rank:05d}.{seq:07d}.{readable}"
    if name.endswith(".partial"):  # reserved for files being written
        name += "_"
    return f"{GROUP}/{name}"


@dataclasses.dataclass(frozen=True)
class _Piece:
    name: str
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    owner: int  # the store rank that writes it

    def spec(self, world_size: int) -> TensorSpec:
        numel = math.prod(self.sizes)
        layout = TensorLayout(numel, world_size, max(1, numel), self.owner)
        return TensorSpec(self.name, self.sizes, self.dtype, layout)


@dataclasses.dataclass(frozen=True)
class _GlobalPlan:
    """What the coordinator decides for the whole save; sent to every rank in its plan."""

    step: int
    save_id: str
    world_size: int
    coordinator: int
    pieces: tuple[_Piece, ...]

    def store_rank(self, rank: int) -> int:
        """The store rank of a DCP rank: the coordinator is the store's rank 0 (it commits)."""
        return (rank - self.coordinator) % self.world_size


def _rank_of_caller(kwargs: dict) -> int:
    rank = kwargs.get("rank")
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return int(rank)


def _root_text(root: Any) -> str:
    if isinstance(root, (str, os.PathLike)):
        text = os.fspath(root)
        if isinstance(text, str) and text:
            return text
    raise ConfigError(f"a checkpoint root must be a path or URL, got {root!r}")


def _check_step(step: Any) -> int | None:
    if step is None:
        return None
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= fmt.MAX_STEP:
        raise ConfigError(f"step must be an int in [0, {fmt.MAX_STEP}] or None, got {step!r}")
    return step


# ============================================================================ writer
class StorageWriter(dcp_storage.StorageWriter):
    """DCP's storage writer into a zerostate checkpoint root (a path or fsspec URL).

    ``step`` None saves the step after the newest committed one (0 in an empty root); a
    committed step is never overwritten (:class:`~zerostate.store.StepExistsError`).
    ``keep_last`` keeps only the newest that many committed steps after each save.
    ``checkpoint_id`` given to ``dcp.save`` replaces the root. The object is plain data
    until a save starts, so ``async_save`` may hand it to a staging process.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        step: int | None = None,
        keep_last: int | None = None,
        *,
        storage_options: dict | None = None,
        timeout_s: float = 600.0,
        num_threads: int = 8,
    ) -> None:
        super().__init__()
        self.root = _root_text(root)
        self.requested_step = _check_step(step)
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.timeout_s, self.num_threads = float(timeout_s), int(num_threads)
        #: The step the last save wrote (set on every rank once its plan arrives).
        self.step: int | None = None
        self._reset_save()

    def _reset_save(self) -> None:
        self._rank = 0
        self._is_coordinator = False
        self._plan: _GlobalPlan | None = None
        self._writer: StepWriter | None = None
        self._root: CheckpointRoot | None = None

    def __getstate__(self) -> dict:
        # Staging processes get the configuration only; a save opens what it needs.
        state = dict(self.__dict__)
        state.update(_plan=None, _writer=None, _root=None)
        return state

    def _open_root(self) -> CheckpointRoot:
        if self._root is None:
            self._root = CheckpointRoot.open(
                self.root, self.storage_options or None, num_threads=self.num_threads
            )
        return self._root

    # ------------------------------------------------------------- DCP interface
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.root = _root_text(checkpoint_id)
        self._reset_save()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _root_text(checkpoint_id)
        except ConfigError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "zerostate.dcp.StorageWriter needs use_collectives=True: a step is committed "
                "once, by one rank, after every rank's writes are durable"
            )
        self._is_coordinator = bool(is_coordinator)
        self._rank = _rank_of_caller(kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The rank travels with the plan so the coordinator knows who it is.
        return dataclasses.replace(plan, storage_data=self._rank)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world_size = len(plans)
        coordinator = self._rank
        if world_size > fmt.MAX_RANKS + 1:
            raise ConfigError(f"{world_size} ranks exceed the store's {fmt.MAX_RANKS + 1}")
        pieces: list[_Piece] = []
        for index, plan in enumerate(plans):
            store_rank = (index - coordinator) % world_size
            seq = 0
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                td = item.tensor_data
                if td is None:
                    raise ConfigError(f"{item.index.fqn}: a tensor item without tensor data")
                try:
                    fmt.dtype_name(td.properties.dtype)
                except ConfigError as exc:
                    raise ConfigError(f"{item.index.fqn}: {exc}") from None
                pieces.append(
                    _Piece(
                        _piece_name(store_rank, seq, item.index.fqn),
                        item.index.fqn,
                        tuple(int(o) for o in td.chunk.offsets),
                        tuple(int(s) for s in td.chunk.sizes),
                        td.properties.dtype,
                        store_rank,
                    )
                )
                seq += 1
        root = self._open_root()
        step = self.requested_step
        if step is None:
            committed = root.steps()
            step = committed[-1] + 1 if committed else 0
        check = root.check_save(step)  # also clears a crashed save's partial step
        if check.exists:
            raise StepExistsError(
                f"step {step} is already committed at {root.url}; save under another step "
                "(step=None takes the next one) or delete it first"
            )
        glob = _GlobalPlan(step, uuid.uuid4().hex, world_size, coordinator, tuple(pieces))
        # Every rank gets the whole piece list: its StepWriter places its row from all the
        # specs, and rank 0 checks at commit that every rank planned the same step.
        return [dataclasses.replace(plan, storage_data=glob) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        glob = plan.storage_data
        if not isinstance(glob, _GlobalPlan):
            raise CheckpointError("internal: the save plan lacks zerostate's global plan")
        self._plan, self.step = glob, glob.step
        me = glob.store_rank(self._rank)
        mine = {(p.fqn, p.offsets): p for p in glob.pieces if p.owner == me}
        results: list[WriteResult] = []
        shards: dict[str, torch.Tensor] = {}
        # Non-tensor values first: one that cannot be stored fails the save before this
        # rank writes anything.
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = _encode_value(item, planner)
                results.append(WriteResult(item.index, len(fmt.dumps(value)), ("value", value)))
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            offsets = tuple(int(o) for o in item.tensor_data.chunk.offsets)  # type: ignore[union-attr]
            piece = mine.get((item.index.fqn, offsets))
            if piece is None:
                raise CheckpointError(f"internal: no piece planned for {item.index.fqn}")
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise ConfigError(f"{item.index.fqn}: the planner gave {type(data).__name__}")
            data = data.detach()
            if tuple(data.shape) != piece.sizes or data.dtype != piece.dtype:
                raise ConfigError(
                    f"{item.index.fqn}: the planner gave a {data.dtype} tensor of shape "
                    f"{list(data.shape)} for a chunk of {piece.dtype} {list(piece.sizes)}"
                )
            # The store writes a byte view of a contiguous CPU tensor, without a copy.
            shards[piece.name] = data.to("cpu").contiguous().reshape(-1)
            results.append(
                WriteResult(item.index, data.numel() * data.element_size(), ("piece", piece.name))
            )
        self._writer = StepWriter(
            self._open_root().storage,
            glob.step,
            rank=me,
            world_size=glob.world_size,
            specs=[p.spec(glob.world_size) for p in glob.pieces],
            timeout_s=self.timeout_s,
            num_threads=self.num_threads,
            save_id=glob.save_id,
        )
        try:
            self._writer.write(shards)  # every row of this rank, then its manifest
        except BaseException as exc:
            self._writer.abort(exc)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        glob, writer = self._plan, self._writer
        if glob is None or writer is None:
            raise CheckpointError("internal: finish() before write_data()")
        values: dict[str, Any] = {}
        for rank_results in results:
            for result in rank_results:
                kind, payload = result.storage_data
                if kind == "value":
                    values[result.index.fqn] = payload
        document = _metadata_json(metadata, glob, values)
        writer.commit(attrs={ATTR: document})
        if self.keep_last is not None:
            self._open_root().prune(keep_last=self.keep_last, partial_below=None)


def _encode_value(item: WriteItem, planner: SavePlanner) -> Any:
    """A non-tensor value as JSON (``zerostate.jsonstate``), looked up in the state the
    planner holds; a value that JSON cannot hold raises ConfigError naming its key."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        obj = lookup(item.index)
    else:  # a planner without the default's lookup: undo its torch.save of our own value
        buffer = planner.resolve_data(item)
        buffer.seek(0)  # type: ignore[union-attr]
        try:
            obj = torch.load(buffer, weights_only=True)  # type: ignore[arg-type]
        except Exception as exc:
            raise ConfigError(
                f"non-tensor value {fqn!r} holds objects a checkpoint cannot store without "
                f"pickle ({exc})"
            ) from exc
    what = f"non-tensor value {fqn!r}"
    value = jsonstate.encode(obj, what)
    fmt.check_json(value, what)
    return value


def _metadata_json(metadata: Metadata, glob: _GlobalPlan, values: dict[str, Any]) -> dict:
    """DCP's metadata as the JSON document of a step (see [Note: DCP steps])."""
    by_chunk = {(p.fqn, p.offsets): p for p in glob.pieces}
    tensors: dict[str, dict] = {}
    non_tensors: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if fqn not in values:
                raise CheckpointError(f"internal: no rank wrote the value of {fqn!r}")
            non_tensors[fqn] = values[fqn]
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError(f"{fqn}: DCP metadata of type {type(entry).__name__}")
        chunks = []
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            piece = by_chunk.get((fqn, offsets))
            if piece is None or piece.sizes != tuple(int(s) for s in chunk.sizes):
                raise CheckpointError(f"internal: chunk {list(offsets)} of {fqn} has no piece")
            chunks.append(
                {"offsets": list(offsets), "sizes": list(piece.sizes), "piece": piece.name}
            )
        tensors[fqn] = {
            "dtype": fmt.dtype_name(entry.properties.dtype),
            "shape": [int(d) for d in entry.size],
            "chunks": chunks,
        }
    planner_data = None
    if metadata.planner_data is not None:
        planner_data = jsonstate.encode(metadata.planner_data, "DCP planner data")
        fmt.check_json(planner_data, "DCP planner data")
    meta = metadata.storage_meta
    return {
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "values": non_tensors,
        "planner_data": planner_data,
        "modules": [str(m) for m in (meta.modules if meta is not None else [])],
    }


# ============================================================================ reader
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

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_state=None, _reader=None)
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.root = _root_text(checkpoint_id)
        self.close()
        self._state = None

    def close(self) -> None:
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
        # The step each rank opened travels with its plan: ranks that resolved "newest"
        # across a concurrent commit must not mix two steps.
        return dataclasses.replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) != 1:
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
                # Bytes this module serialises from the validated JSON: whatever the planner
                # does with them (DefaultLoadPlanner calls torch.load(weights_only=False)),
                # they hold only dicts, lists, tuples, strings, numbers and tensors.
                buffer = io.BytesIO()
                torch.save(state.values[fqn], buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
            else:
                tensors.append(item)
        try:
            batch: list[tuple[ReadItem, str, tuple[int, ...], int, int]] = []
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


def _read_request(state: _Step, item: ReadItem) -> tuple[ReadItem, str, tuple[int, ...], int, int]:
    """``(item, piece, piece sizes, start, stop)``: the flat element range of the piece that
    holds the rows (first dimension) the item needs."""
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
    if not sizes:  # a scalar
        return item, name, sizes, 0, 1
    row = math.prod(sizes[1:])
    return item, name, sizes, offsets[0] * row, (offsets[0] + lengths[0]) * row


def _read_batch(reader: Any, state: _Step, batch: list[tuple], planner: LoadPlanner) -> None:
    """Read the batch's ranges in one pass (checksummed), then hand each box to the planner."""
    requests = [(name, start, stop, None) for _, name, _, start, stop in batch]
    try:
        datas = reader.read_many(requests)
    except CorruptCheckpointError:
        # Name the tensors: read each range on its own to find which ones are damaged.
        for item, name, _, start, stop in batch:
            try:
                reader.read_many([(name, start, stop, None)])
            except CorruptCheckpointError as exc:
                fqn = item.storage_index.fqn
                raise CorruptCheckpointError(
                    f"{fqn} (chunk at {list(item.storage_index.offset or ())}) in step "
                    f"{state.step} is damaged: {exc}"
                ) from exc
        raise
    for (item, _, sizes, _, _), data in zip(batch, datas, strict=True):
        if sizes:
            data = data.view(int(item.lengths[0]), *sizes[1:])
            for dim in range(1, len(sizes)):
                data = data.narrow(dim, int(item.storage_offsets[dim]), int(item.lengths[dim]))
        else:
            data = data.view(())
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(data.shape):
            raise ConfigError(
                f"{item.dest_index.fqn}: the planner's target has shape {list(target.shape)}, "
                f"the stored box {list(data.shape)}"
            )
        target.copy_(data)
        planner.commit_tensor(item, target)


# ----------------------------------------------------------------- parsing a step
def describe_step(reader: Any) -> list[dict[str, Any]] | None:
    """The DCP tensors and values of an open step, validated, for tools (``zerostate
    inspect``): ``{"key", "kind": "tensor", "shape", "dtype", "chunks": [{"offsets", "sizes",
    "piece", "rank"}]}`` or ``{"key", "kind": "value"}``; None for a step not written
    through this module."""
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
                "dtype": fmt.dtype_name(entry.properties.dtype),
                "chunks": chunks,
            }
        )
    return out


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
        dtype = fmt.dtype_from_name(entry.get("dtype"))
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
            if tuple(info.shape) != sizes or info.dtype != dtype:
                raise CorruptCheckpointError(
                    f"{cwhere}: piece {name!r} holds {fmt.dtype_name(info.dtype)} "
                    f"{list(info.shape)}, the box needs {fmt.dtype_name(dtype)} {list(sizes)}"
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


def _check_fqn(fqn: Any, where: str) -> None:
    if not isinstance(fqn, str) or not fqn or len(fqn) > 4096:
        raise CorruptCheckpointError(f"{where}: key {str(fqn)[:80]!r} is not a valid state key")


def _ints(value: Any, what: str, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > max_len:
        raise CorruptCheckpointError(f"{what} is not a list of at most {max_len} integers")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
            raise CorruptCheckpointError(f"{what}: {v!r} is not a non-negative integer")
        out.append(v)
    return tuple(out)


def _planner_data(data: Any, where: str) -> dict[str, tuple]:
    """DCP's default planners keep ``{flat key: path}`` with paths of strings and ints."""
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: planner data is not a mapping")
    out = {}
    for key, path in data.items():
        ok = isinstance(key, str) and isinstance(path, (list, tuple))
        if not ok or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
            raise CorruptCheckpointError(
                f"{where}: planner data entry {str(key)[:80]!r} is malformed"
            )
        out[key] = tuple(path)
    return out


def check_boxes(
    shape: tuple[int, ...], boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]], what: str
) -> None:
    """Boxes ``(offsets, sizes)`` lie inside ``shape`` (checked by the caller), do not
    overlap and together cover it: else CorruptCheckpointError naming ``what``.

    Disjointness by a sweep along the dimension where offsets vary most: each box is
    compared only with the boxes whose extent on that dimension it meets, which for the
    grid-like layouts DCP plans is a handful, not all of them."""
    solid = [(o, s) for o, s in boxes if all(s)]
    numel = math.prod(shape)
    covered = sum(math.prod(s) for _, s in solid)
    if not shape:
        if len(solid) != 1:
            raise CorruptCheckpointError(f"{what}: a scalar needs one chunk, found {len(solid)}")
        return
    dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in solid}))
    solid.sort(key=lambda box: box[0][dim])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, size in solid:
        start = off[dim]
        active = [b for b in active if b[0][dim] + b[1][dim] > start]
        for o2, s2 in active:
            if all(
                a < b2 + n2 and b2 < a + n for a, n, b2, n2 in zip(off, size, o2, s2, strict=True)
            ):
                raise CorruptCheckpointError(
                    f"{what}: chunks at {list(o2)} (sizes {list(s2)}) and {list(off)} (sizes "
                    f"{list(size)}) overlap"
                )
        active.append((off, size))
    if covered != numel:
        raise CorruptCheckpointError(
            f"{what}: chunks cover {covered} of the tensor's {numel} elements (shape "
            f"{list(shape)}); the step is damaged or incomplete"
        )
