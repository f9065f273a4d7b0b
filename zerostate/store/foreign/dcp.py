"""torch.distributed.checkpoint (DCP) directories behind the step-reader protocol.

A DCP directory holds ``.metadata`` (a pickled ``Metadata``: every flattened key's tensor
chunks or byte item, where each lies, and ``planner_data`` mapping a flat key back to its
path in the nested state dict) and ``__<rank>_<n>.distcp`` files of ``torch.save`` items
at byte offsets. ``.metadata`` goes through the restricted unpickler with the DCP metadata
stand-ins only; every item through the torch one. Items are read by byte range.

Two safetensors item formats are read as well (see [Note: DCP safetensors]).

Names (see [Note: DCP names]) follow what ``get_state_dict`` and torchtitan write: a
``{"model": ..., "optimizer": ...}`` dict, a bare model state dict, and the optimizer
layouts keyed by parameter FQN (nested ``state`` / ``param_groups``, or torchtitan's
flattened ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>``).

[Note: DCP names]
``model.<fqn>`` (or a bare top-level tensor ``<fqn>``) becomes ``model/<fqn>``; DCP does
not tell parameters from buffers, so buffers are ``model/<name>`` too (an export treats
both alike; a load looks a buffer up there). Optimizer state ``state.<fqn>.<key>``
becomes ``optim/<key>/<fqn>`` when it has the parameter's shape and a scalar (``step``)
otherwise; ``param_groups`` give the group hyperparameters and membership.

[Note: DCP safetensors]
torch writes DCP tensors as safetensors two ways. ``FileSystemWriter(serialization_format=
SAFETENSORS)`` keeps ``.metadata`` and the ``.distcp`` files, but each file holds its byte
items (``torch.save`` objects, as usual) followed by one safetensors blob of all its tensor
chunks, keyed by the flattened key; every tensor's ``_StorageInfo`` points at the start of
that blob. ``HuggingFaceStorageWriter`` writes no pickle at all: ``model-<i>-of-<n>
.safetensors`` (with a ``model.safetensors.index.json``) from a full state dict, or with
``save_distributed`` one ``shard-<rank>-model-<i>-of-<n>.safetensors`` per rank, whose header
metadata ``DCP_SHARDING_INFO`` (JSON) gives each chunk's ``saved_offsets`` in the full
tensor; the full shape is the largest offset plus size, as torch's reader computes it.
Both are read from the safetensors header (JSON: dtype, shape, data offsets), checked to
tile the data exactly and to lie inside the file. safetensors has no checksum: ``verify``
reads every byte, re-reads each header and checks it is unchanged, and checks every size
and offset against the file; a flipped byte inside tensor data is not detectable.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import Any

import torch

from zerostate.errors import CheckpointNotFoundError, CorruptCheckpointError
from zerostate.safetensors_io import DTYPES, MAX_HEADER_BYTES
from zerostate.store.foreign.base import (
    ForeignStep,
    ForeignTensor,
    Segment,
    foreign_engine_state,
)
from zerostate.store.foreign.detect import DCP_METADATA, HF_FILE, HF_SHARD_FILE
from zerostate.store.format import validate_name
from zerostate.store.safe_unpickle import (
    DCP_GLOBALS,
    MAX_PICKLE_NBYTES,
    TORCH_GLOBALS,
    Record,
    StoredTensor,
    TorchArchive,
    object_size,
    restricted_loads,
)
from zerostate.store.storage import Storage

METADATA = DCP_METADATA
METADATA_ALLOWED = {**TORCH_GLOBALS, **DCP_GLOBALS}
_RANK_FILE = re.compile(r"__(\d{1,6})_\d{1,6}\.distcp")
#: Largest safetensors header read into memory, and the dtypes: as for Hugging Face files.
MAX_HEADER_NBYTES = MAX_HEADER_BYTES
SAFETENSORS_DTYPES = DTYPES
SHARDING_KEY = "DCP_SHARDING_INFO"


class DcpCheckpoint:
    """A DCP directory: one step, numbered by the optimizer's step count (0 if none)."""

    format_name = "dcp"

    def __init__(self, storage: Storage, num_threads: int = 8) -> None:
        self._storage, self._num_threads = storage, num_threads
        self._step: DcpStep | None = None

    @property
    def url(self) -> str:
        return self._storage.url

    def _open(self) -> DcpStep:
        if self._step is None:
            if self._storage.exists(METADATA):
                self._step = open_dcp(self._storage, self._num_threads)
            else:
                self._step = open_hf_safetensors(self._storage, self._num_threads)
        return self._step

    def steps(self) -> list[int]:
        return [self._open().step]

    def scan(self) -> tuple[list[int], list[int]]:
        return self.steps(), []

    def step(self, step: int | None = None) -> DcpStep:
        st = self._open()
        if step is not None and step != st.step:
            raise CheckpointNotFoundError(
                f"{self.url} is a DCP checkpoint of step {st.step}, not {step}"
            )
        return st


class DcpStep(ForeignStep):
    format_version = "dcp"


def _fields(obj: Any, kind: str, where: str) -> dict:
    if not isinstance(obj, Record) or obj.kind != kind:
        raise CorruptCheckpointError(f"{where}: expected a DCP {kind}, got {type(obj).__name__}")
    return obj.fields


def _dtype_of(props: Any, where: str) -> torch.dtype:
    fields = _fields(props, "TensorProperties", where)
    dtype = fields.get("dtype")
    state = fields.get("__state__")
    if dtype is None and isinstance(state, tuple) and state:
        dtype = state[0]
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: a tensor has no dtype")
    return dtype


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CorruptCheckpointError(f"{where}: malformed sizes {value!r:.80}")
    return tuple(value)


def open_dcp(storage: Storage, num_threads: int = 8) -> DcpStep:
    url = storage.url
    where = storage.url_of(METADATA)
    try:
        size = object_size(storage, METADATA)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{url} has no {METADATA}: not a DCP checkpoint") from None
    if size > MAX_PICKLE_NBYTES:
        raise CorruptCheckpointError(f"{where} is {size} bytes, too large to be metadata")
    meta = _fields(
        restricted_loads(storage.read(METADATA), METADATA_ALLOWED, where), "Metadata", where
    )
    entries = meta.get("state_dict_metadata")
    storage_data = meta.get("storage_data")
    planner = meta.get("planner_data") or {}
    if not isinstance(entries, dict) or not isinstance(storage_data, dict):
        raise CorruptCheckpointError(f"{where}: no state_dict_metadata / storage_data")
    locations: dict[tuple[str, tuple[int, ...]], dict] = {}
    files: set[str] = set()
    for index, info in storage_data.items():
        idx = _fields(index, "MetadataIndex", where)
        loc = _fields(info, "_StorageInfo", where)
        path = validate_name(loc.get("relative_path"), what="DCP file name")
        if "/" in path or not all(isinstance(loc.get(k), int) for k in ("offset", "length")):
            raise CorruptCheckpointError(f"{where}: malformed storage location {loc!r:.120}")
        if loc.get("transform_descriptors"):
            raise CorruptCheckpointError(
                f"{where}: item {idx.get('fqn')!r} is stored with transforms "
                f"{loc['transform_descriptors']!r:.80}, which zerostate does not read"
            )
        files.add(path)
        offset = idx.get("offset")
        key = (str(idx.get("fqn")), tuple(offset) if isinstance(offset, tuple | list) else ())
        locations[key] = loc
    archives: dict[tuple[str, int], TorchArchive | SafetensorsBlob] = {}

    def item(fqn: str, offset: tuple[int, ...]) -> TorchArchive | SafetensorsBlob:
        loc = locations.get((fqn, offset))
        if loc is None:
            raise CorruptCheckpointError(f"{where}: no stored item for {fqn!r} at {offset}")
        path, base = loc["relative_path"], loc["offset"]
        key = (path, base)
        if key not in archives:
            if _is_safetensors(storage, path, base):  # the blob of a file's tensor items
                archives[key] = SafetensorsBlob(storage, path, base)
            else:
                archives[key] = TorchArchive(
                    storage, path, TORCH_GLOBALS, base=base, size=loc["length"]
                )
        return archives[key]

    builder = DcpNames()
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: a key is not a string")
        path = planner.get(fqn, (fqn,))
        path = tuple(str(p) for p in path) if isinstance(path, tuple | list) else (fqn,)
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
            archive = item(fqn, ())
            if not isinstance(archive, TorchArchive):
                raise CorruptCheckpointError(f"{where}: object {fqn!r} is not a torch.save item")
            value = archive.load()
            builder.add_object(path, value)
            continue
        fields = _fields(entry, "TensorStorageMetadata", where)
        shape = _ints(fields.get("size"), where)
        dtype = _dtype_of(fields.get("properties"), where)
        segments = []
        for chunk in fields.get("chunks") or []:
            c = _fields(chunk, "ChunkStorageMetadata", where)
            offsets, sizes = _ints(c.get("offsets"), where), _ints(c.get("sizes"), where)
            archive = item(fqn, offsets)
            if isinstance(archive, SafetensorsBlob):
                stored = archive.chunk(fqn, offsets)
            else:
                stored = archive.load()
            if not isinstance(stored, StoredTensor) or stored.shape != sizes:
                raise CorruptCheckpointError(f"{archive.url}: not the {sizes} chunk of {fqn!r}")
            segments += _chunk_segments(shape, offsets, sizes, archive, stored, where)
        builder.add_tensor(path, ForeignTensor(fqn, shape, dtype, tuple(segments)))
    ranks = {int(m.group(1)) for f in files if (m := _RANK_FILE.fullmatch(f))}
    return builder.build(url, max(len(ranks), 1), list(archives.values()), num_threads)


def _chunk_segments(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
    archive: TorchArchive, stored: StoredTensor, where: str,
) -> list[Segment]:  # fmt: skip
    """Flat runs of one N-d chunk: the trailing dimensions the chunk spans whole are one
    run, repeated over the leading indices."""
    if (
        len(offsets) != len(shape)
        or len(sizes) != len(shape)
        or any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True))
    ):
        raise CorruptCheckpointError(f"{where}: a chunk lies outside its tensor {shape}")
    if not shape:
        return [Segment(0, 1, archive, stored)]
    k = len(shape) - 1  # dims after k are whole in the chunk; a run spans dims k..
    while k > 0 and sizes[k] == shape[k] and offsets[k] == 0:
        k -= 1
    run = 1
    for s in sizes[k:]:
        run *= s
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    lead = sizes[:k]
    count = 1
    for s in lead:
        count *= s
    segs = []
    for n in range(count if run else 0):
        idx, rem = [], n
        for s in reversed(lead):
            idx.append(rem % s)
            rem //= s
        idx.reverse()
        flat = sum((offsets[i] + idx[i]) * strides[i] for i in range(k)) + offsets[k] * strides[k]
        segs.append(Segment(flat, run, archive, stored, n * run))
    return segs


class DcpNames:
    """Sorts DCP keys into model tensors, optimizer state and other objects ([Note: DCP
    names]). Tensors are any objects with ``shape`` and ``dtype``: this module's
    :class:`ForeignTensor` and the global tensors of a step written through
    ``zerostate.dcp`` (``zerostate.store.dcp_steps``) share the naming."""

    def __init__(self) -> None:
        self.model: dict[str, Any] = {}
        self.optim: dict[str, dict[str, Any]] = {}  # fqn -> key -> tensor or value
        self.groups: dict[int, dict[str, Any]] = {}
        self.param_hyper: dict[str, dict[str, Any]] = {}
        self.objects: list[str] = []

    def add_tensor(self, path: tuple[str, ...], tensor: Any) -> None:
        if path[0] == "optimizer" or path[0] == "optim":
            self._optim(path[1:], tensor)
        elif path[0] == "model" and len(path) > 1:
            self.model[".".join(path[1:])] = tensor
        elif len(path) == 1:
            self.model[path[0]] = tensor
        else:
            self.objects.append(".".join(path))

    def add_object(self, path: tuple[str, ...], value: Any) -> None:
        if path[0] in ("optimizer", "optim"):
            self._optim(path[1:], value)
        else:
            self.objects.append(".".join(path))

    def _optim(self, path: tuple[str, ...], value: Any) -> None:
        if len(path) == 1:  # torchtitan: flattened "state.<fqn>.<key>" in one component
            head, _, rest = path[0].partition(".")
            fqn, _, key = rest.rpartition(".")
            path = (head, fqn, key)
        if len(path) == 3 and path[0] == "state":
            self.optim.setdefault(path[1], {})[path[2]] = value
        elif len(path) == 3 and path[0] == "param_groups" and path[1].isdigit():
            self.groups.setdefault(int(path[1]), {})[path[2]] = value
        elif len(path) == 3 and path[0] == "param_groups":
            self.param_hyper.setdefault(path[1], {})[path[2]] = value
        else:
            self.objects.append("optimizer." + ".".join(path))

    def engine_view(
        self, world_size: int, read_whole: Callable[[Any], torch.Tensor], is_tensor: type
    ) -> tuple[int, dict[str, Any], dict]:
        """``(optimizer step, {zerostate name: tensor}, attrs)``: the tensors under the
        names zerostate gives them (``model/<fqn>``, ``optim/<key>/<fqn>``) and the engine
        state a load restores. Optimizer state of another shape than its parameter (the
        ``step`` counts) is read whole with ``read_whole`` and kept as a scalar."""
        tensors: dict[str, Any] = {f"model/{fqn}": t for fqn, t in self.model.items()}
        moments: dict[str, list[str]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for fqn, state in self.optim.items():
            param = self.model.get(fqn)
            keys = []
            for key, value in state.items():
                if (
                    isinstance(value, is_tensor)
                    and param is not None
                    and value.shape == param.shape
                ):
                    tensors[f"optim/{key}/{fqn}"] = value
                    keys.append(key)
                elif isinstance(value, is_tensor):
                    scalars.setdefault(fqn, {})[key] = read_whole(value)
                elif isinstance(value, int | float | bool):
                    scalars.setdefault(fqn, {})[key] = value
            moments[fqn] = sorted(keys)
        group_params, hyper = self._groups()
        steps = [
            float(s["step"]) for s in scalars.values() if isinstance(s.get("step"), torch.Tensor)
        ]
        step = int(max(steps)) if steps else 0
        attrs = {
            "engine": foreign_engine_state(
                step=step,
                stage=None,
                precision=None,
                world_size=world_size,
                tied=None,
                frozen=[],
                optimizer_class=None,
                group_params=group_params,
                param_groups=hyper,
                scalars=scalars,
                moments=moments,
                source="dcp",
            ),
            "client_state": None,
            "dcp": {"other_keys": sorted(self.objects)},
        }
        return step, tensors, attrs

    def build(
        self, url: str, world_size: int, archives: list[TorchArchive], num_threads: int
    ) -> DcpStep:
        probe = ForeignStep(url, 0, world_size, {}, [], [], 1)
        step, named, attrs = self.engine_view(
            world_size, lambda t: _read_whole(probe, t), ForeignTensor
        )
        tensors = [ForeignTensor(name, t.shape, t.dtype, t.segments) for name, t in named.items()]
        return DcpStep(url, step, world_size, attrs, tensors, archives, num_threads)

    def _groups(self) -> tuple[list[list[str]], list[dict]]:
        if self.groups:
            names, hyper = [], []
            for i in sorted(self.groups):
                g = dict(self.groups[i])
                params = g.pop("params", [])
                names.append([str(p) for p in params] if isinstance(params, list) else [])
                hyper.append(g)
            return names, hyper
        # Flattened: per-parameter hyperparameters; equal ones form one group, in order.
        names, hyper = [], []
        for fqn, h in self.param_hyper.items():
            if hyper and hyper[-1] == h:
                names[-1].append(fqn)
            else:
                names.append([fqn])
                hyper.append(h)
        return names, hyper


def _read_whole(step: ForeignStep, tensor: ForeignTensor) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    flat = out.view(-1)
    for seg in tensor.segments:
        dest = flat[seg.dst : seg.dst + seg.numel]
        dest.copy_(seg.archive.read(seg.tensor, seg.src, seg.src + seg.numel))
    return out


# ------------------------------------------------------------------ safetensors items
def _is_safetensors(storage: Storage, path: str, base: int) -> bool:
    """Whether the item at ``base`` is a safetensors blob (an 8-byte header length, then
    the JSON header) rather than a ``torch.save`` zip."""
    head = memoryview(bytearray(9))
    got = storage.read_range_into(path, base, [head])
    return got == 9 and bytes(head[:4]) != b"PK\x03\x04" and head[8] == ord("{")


class SafetensorsBlob:
    """One safetensors blob (a whole file, or the tensor items of a DCP file at ``base``):
    its JSON header validated once, its tensors read by byte range (see [Note: DCP
    safetensors])."""

    def __init__(self, storage: Storage, path: str, base: int = 0) -> None:
        self._storage, self._path, self._base = storage, path, base
        self.url = storage.url_of(path) + (f" (bytes from {base})" if base else "")
        self._file_size = object_size(storage, path)
        self._header = self._read_header()
        self.tensors, self._starts, self.metadata, self._nbytes = self._parse(self._header)

    def _read_header(self) -> bytes:
        head = memoryview(bytearray(8))
        if self._storage.read_range_into(self._path, self._base, [head]) != 8:
            raise CorruptCheckpointError(f"{self.url}: too short for a safetensors header")
        if self._base == 0 and bytes(head[:4]) == b"PK\x03\x04":
            # HuggingFaceStorageWriter given non-tensor state (an optimizer's param_groups)
            # writes it as torch.save items ahead of the safetensors header and records
            # nowhere where they end: no reader, torch's own included, can read the file.
            raise CorruptCheckpointError(
                f"{self.url}: starts with a torch.save archive, not a safetensors header "
                "(HuggingFaceStorageWriter given non-tensor state such as an optimizer's "
                "param_groups writes files no reader can open; save the model state dict "
                "alone with it, or use FileSystemWriter for model and optimizer)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_NBYTES or self._base + 8 + n > self._file_size:
            raise CorruptCheckpointError(
                f"{self.url}: safetensors header length {n} runs past the end of the file"
            )
        raw = memoryview(bytearray(n))
        if self._storage.read_range_into(self._path, self._base + 8, [raw]) != n:
            raise CorruptCheckpointError(f"{self.url}: the safetensors header ends early")
        return bytes(raw)

    def _parse(self, raw: bytes) -> tuple[dict[str, StoredTensor], dict[str, int], dict, int]:
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{self.url}: the safetensors header is not JSON ({exc})"
            ) from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{self.url}: the safetensors header is not an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CorruptCheckpointError(f"{self.url}: malformed safetensors __metadata__")
        tensors, starts, spans = {}, {}, []
        for name, e in header.items():
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                raise CorruptCheckpointError(f"{self.url}: malformed entry for {name!r:.80}")
            dtype = SAFETENSORS_DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
            if dtype is None:
                raise CorruptCheckpointError(
                    f"{self.url}: tensor {name!r:.80} has dtype {e['dtype']!r:.40}, "
                    "which zerostate does not know"
                )
            shape = _ints(e["shape"], self.url)
            offsets = _ints(e["data_offsets"], self.url)
            numel = 1
            for d in shape:
                numel *= d
            if len(offsets) != 2 or offsets[1] - offsets[0] != numel * dtype.itemsize:
                raise CorruptCheckpointError(
                    f"{self.url}: tensor {name!r:.80} data_offsets {list(offsets)} do not hold "
                    f"its {list(shape)} {e['dtype']} elements"
                )
            tensors[name] = StoredTensor(name, dtype, numel, 0, shape)
            starts[name] = offsets[0]
            spans.append((offsets[0], offsets[1], name))
        at = 0
        for lo, hi, name in sorted(spans):
            if lo != at:
                raise CorruptCheckpointError(
                    f"{self.url}: tensor {name!r:.80} starts at {lo}, expected {at}: the data "
                    "has gaps or overlaps"
                )
            at = hi
        end = self._base + 8 + len(raw) + at
        if end > self._file_size:
            raise CorruptCheckpointError(
                f"{self.url}: tensor data runs to byte {end}, past the end of the file "
                f"({self._file_size} bytes)"
            )
        return tensors, starts, meta, at

    def sharding(self) -> dict[str, tuple[int, ...]]:
        """``saved_offsets`` of each tensor from ``DCP_SHARDING_INFO`` (empty without)."""
        text = self.metadata.get(SHARDING_KEY)
        if text is None:
            return {}
        try:
            info = json.loads(text)
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{self.url}: malformed {SHARDING_KEY}")
        out = {}
        for name, entry in info.items():
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"{self.url}: malformed {SHARDING_KEY}")
            out[name] = _ints(entry.get("saved_offsets"), self.url)
        return out

    def chunk(self, fqn: str, offsets: tuple[int, ...]) -> StoredTensor:
        """The tensor stored for the DCP chunk of ``fqn`` at ``offsets``."""
        stored = self.tensors.get(fqn)
        saved = self.sharding().get(fqn)
        if stored is None or (saved is not None and saved != offsets):
            raise CorruptCheckpointError(f"{self.url}: no chunk of {fqn!r} at {list(offsets)}")
        return stored

    def read(
        self, tensor: StoredTensor, start: int = 0, stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        stop = tensor.numel if stop is None else stop
        if not 0 <= start <= stop <= tensor.numel or self.tensors.get(tensor.key) != tensor:
            raise CorruptCheckpointError(f"{self.url}: range [{start}, {stop}) out of bounds")
        if out is None:
            out = torch.empty(stop - start, dtype=tensor.dtype)
        if stop == start:
            return out
        size = tensor.dtype.itemsize
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        at = self._base + 8 + len(self._header) + self._starts[tensor.key] + start * size
        if self._storage.read_range_into(self._path, at, [view]) != view.nbytes:
            raise CorruptCheckpointError(f"{self.url}: tensor {tensor.key!r} ends early")
        return out

    def verify(self, progress: Callable[[int], Any] | None = None) -> int:
        """Re-read the header (it must be unchanged and still valid) and every data byte;
        safetensors has no checksum, so damage inside tensor data goes unseen."""
        self._file_size = object_size(self._storage, self._path)
        header = self._read_header()
        if header != self._header:
            raise CorruptCheckpointError(f"{self.url}: the safetensors header changed")
        self._parse(header)
        start, total = self._base + 8 + len(header), 8 + len(header)
        block = 16 << 20
        for at in range(0, self._nbytes, block):
            n = min(block, self._nbytes - at)
            buf = memoryview(bytearray(n))
            if self._storage.read_range_into(self._path, start + at, [buf]) != n:
                raise CorruptCheckpointError(f"{self.url}: the tensor data ends early")
            total += n
            if progress is not None:
                progress(n)
        return total


def open_hf_safetensors(storage: Storage, num_threads: int = 8) -> DcpStep:
    """A directory of ``HuggingFaceStorageWriter`` files (see [Note: DCP safetensors]):
    the per-rank ``shard-*`` files if there are any, else the ``model-*`` files."""
    names = storage.list_dir("")
    files = sorted(n for n in names if HF_SHARD_FILE.fullmatch(n))
    world_size = len(files)
    if not files:
        files = sorted(n for n in names if HF_FILE.fullmatch(n))
        world_size = 1
    if not files:
        raise CheckpointNotFoundError(
            f"{storage.url} has no {METADATA} and no DCP safetensors files: not a DCP checkpoint"
        )
    chunks: dict[str, list[tuple[tuple[int, ...], SafetensorsBlob, StoredTensor]]] = {}
    blobs = [SafetensorsBlob(storage, f) for f in files]
    for blob in blobs:
        saved = blob.sharding()
        for name, stored in blob.tensors.items():
            validate_name(f"model/{name}", what="DCP tensor name")
            offsets = saved.get(name, (0,) * len(stored.shape))
            if len(offsets) != len(stored.shape):
                raise CorruptCheckpointError(
                    f"{blob.url}: saved_offsets of {name!r} do not match its shape"
                )
            chunks.setdefault(name, []).append((offsets, blob, stored))
    builder = DcpNames()
    for name, parts in chunks.items():
        dtypes = {stored.dtype for _, _, stored in parts}
        if len(dtypes) != 1:
            raise CorruptCheckpointError(f"{storage.url}: the chunks of {name!r} differ in dtype")
        shape = tuple(
            max(o[i] + st.shape[i] for o, _, st in parts) for i in range(len(parts[0][0]))
        )
        segments = []
        for offsets, blob, stored in parts:
            segments += _chunk_segments(shape, offsets, stored.shape, blob, stored, blob.url)
        builder.add_tensor((name,), ForeignTensor(name, shape, dtypes.pop(), tuple(segments)))
    return builder.build(storage.url, max(world_size, 1), blobs, num_threads)
