"""Names, paths, dtypes and JSON documents of the sharded state store (formats 1 and 2).

Pure functions, no I/O. ``docs/format.md`` is the specification; this module is its
executable half, shared by the writer and the reader so both agree byte for byte.

[Note: step layout]
Format 2 (written today) is described in ``rows.py`` ([Note: rows]) and ``format2.py``.
In format 1 (still read) a step is a zarr v3 group ``ROOT/step-<8 digits>/``::

    zarr.json                                  root group (rank 0)
    <g>/zarr.json                              every intermediate group of a tensor name (rank 0)
    <tensor>/zarr.json                         array metadata (owner of chunk 0; rank 0 if empty)
    <tensor>/c/<i>                             chunk i (its owner): raw LE bytes + crc32c (LE u32)
    _zerostate/zarr.json                       group (rank 0)
    _zerostate/manifests/zarr.json             group (rank 0)
    _zerostate/manifests/rank-<5 digits>/zarr.json   a rank's manifest (group attributes)
    _zerostate/commit/zarr.json                the commit record (group attributes), written last

Manifests and the commit record are zarr group documents so that plain zarr sees a clean
hierarchy (it warns about any object that is not a zarr node).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _escape_ascii
from typing import Any

import torch

from zerostate.errors import (
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeNameError,
)
from zerostate.layout.partition import TensorLayout

if sys.byteorder != "little":  # chunks are written straight from memory
    raise ImportError("zerostate.store supports little-endian hosts only")

#: The version the writer writes; readers also read every version in READ_VERSIONS.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2, 3)
META_DIR = "_zerostate"
COMMIT_PATH = f"{META_DIR}/commit/zarr.json"
MANIFEST_DIR = f"{META_DIR}/manifests"
#: A rank whose part of a save failed leaves a note here (best effort), so the other ranks
#: stop waiting for a commit that cannot come. Only partial steps ever hold one.
ABORT_DIR = f"{META_DIR}/aborts"
CHECKSUM_NBYTES = 4
MAX_STEP = 99_999_999
MAX_RANKS = 99_999
#: Largest JSON document (commit record, manifest) a reader parses. Parsing expands JSON
#: several-fold in memory, so a hostile or damaged record is refused by its size first.
MAX_DOCUMENT_NBYTES = 256 << 20

_COMPONENT = re.compile(r"[A-Za-z0-9_.-]+")
_STEP_DIR = re.compile(r"step-(\d{8})")
# Attribute keys the store sets on every array; caller attrs may not shadow them.
RESERVED_ARRAY_ATTRS = ("shape", "torch_dtype")

# torch dtype name -> (zarr data_type, fill value). Dtypes numpy lacks are stored as the
# unsigned integer of the same width holding the raw bits; ``torch_dtype`` says what they are.
_DTYPES: dict[str, tuple[str, Any]] = {
    "float64": ("float64", 0.0),
    "float32": ("float32", 0.0),
    "float16": ("float16", 0.0),
    "bfloat16": ("uint16", 0),
    "float8_e4m3fn": ("uint8", 0),
    "float8_e5m2": ("uint8", 0),
    "int64": ("int64", 0),
    "int32": ("int32", 0),
    "int16": ("int16", 0),
    "int8": ("int8", 0),
    "uint8": ("uint8", 0),
    "uint16": ("uint16", 0),
    "uint32": ("uint32", 0),
    "uint64": ("uint64", 0),
    "bool": ("bool", False),
}


def dtype_name(dtype: torch.dtype, tensor: str | None = None) -> str:
    """The stored name of ``dtype``; ``tensor`` names the tensor in the error a dtype the
    store cannot hold raises (a user meets it at save time and must know which one)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        what = f"tensor {tensor!r} has dtype {dtype}, which" if tensor else f"dtype {dtype}"
        hint = (
            f" (store it as its real pairs: torch.view_as_real(t) with attrs "
            f"{{{COMPLEX_ATTR!r}: {name!r}}}, see as_real_pairs)"
            if dtype in COMPLEX_DTYPES
            else ""
        )
        raise ConfigError(f"{what} is not storable; supported: {', '.join(sorted(_DTYPES))}{hint}")
    return name


# [Note: complex tensors]
# A complex tensor (a RoPE cache, torch.polar) is stored as its real pairs: the float
# tensor ``torch.view_as_real(t)`` (complex64 -> float32, complex128 -> float64, shape
# ``(*shape, 2)``, the same bytes: real and imaginary parts interleaved, as torch and
# numpy lay complex numbers out), with ``attrs[COMPLEX_ATTR]`` naming the complex dtype.
# Every reader, reshard and verify then handles it as the float tensor it is (bit for bit),
# an older zerostate reads the real pairs instead of refusing an unknown dtype, and
# ``consolidate`` turns it back into a complex tensor where safetensors has one (C64).
COMPLEX_ATTR = "complex_dtype"
#: Complex dtype -> the real dtype of its pairs.
COMPLEX_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


#: Each complex dtype by the name ``attrs[COMPLEX_ATTR]`` records.
COMPLEX_BY_NAME: dict[str, torch.dtype] = {str(c).removeprefix("torch."): c for c in COMPLEX_DTYPES}


def complex_attrs(dtype: torch.dtype) -> dict:
    """The attributes marking a stored tensor as the real pairs of complex ``dtype``."""
    return {COMPLEX_ATTR: str(dtype).removeprefix("torch.")}


def as_real_pairs(t: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``(storable tensor, attrs)``: ``t`` itself and ``{}``, or for a complex tensor its
    real-pairs view (shares memory, so a read into it fills ``t``) and the attribute
    recording its dtype ([Note: complex tensors])."""
    if t.dtype not in COMPLEX_DTYPES:
        return t, {}
    return torch.view_as_real(t), complex_attrs(t.dtype)


def complex_dtype(
    attrs: Any, dtype: torch.dtype, shape: tuple[int, ...], what: str
) -> torch.dtype | None:
    """The complex dtype a stored tensor holds as real pairs (``None``: it is what it
    says), checked against its stored dtype and shape (attrs come from storage)."""
    name = attrs.get(COMPLEX_ATTR) if isinstance(attrs, dict) else None
    if name is None:
        return None
    logical = COMPLEX_BY_NAME.get(name) if isinstance(name, str) else None
    if logical is None or COMPLEX_DTYPES[logical] != dtype or not shape or shape[-1] != 2:
        raise CorruptCheckpointError(
            f"{what}: {COMPLEX_ATTR}={name!r} does not describe a stored {dtype} tensor of "
            f"shape {tuple(shape)} (complex64 is stored as float32 and complex128 as "
            "float64, with a last dimension of 2)"
        )
    return logical


def dtype_from_name(name: Any) -> torch.dtype:
    """Torch dtype of a stored ``torch_dtype`` string (from storage: never trusted)."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise CorruptCheckpointError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"dtype {name!r} is not available in this torch build")
    return dtype


def zarr_data_type(dtype: torch.dtype) -> str:
    return _DTYPES[dtype_name(dtype)][0]


# ------------------------------------------------------------------------------ names
def validate_name(name: Any, *, what: str = "tensor name", allow_meta: bool = False) -> str:
    """Return ``name`` if it is a safe ``/``-separated relative name, else raise.

    Each component matches ``[A-Za-z0-9_.-]+`` and is not ``.``/``..``; ``zarr.json`` and
    ``*.partial`` are reserved for metadata and in-flight files, and the top-level
    ``_zerostate`` for the store's own documents.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeNameError(f"{what} must be a non-empty string, got {name!r}")
    parts = name.split("/")
    for part in parts:
        if not _COMPONENT.fullmatch(part) or part in (".", ".."):
            raise UnsafeNameError(
                f"{what} {name!r} is unsafe: each '/'-separated part must match "
                "[A-Za-z0-9_.-]+ and not be '.' or '..' (no absolute paths, no empty parts)"
            )
        if len(part.encode()) > 200:
            raise UnsafeNameError(f"{what} {name!r} has a part longer than 200 bytes")
    if not allow_meta:
        if parts[0] == META_DIR:
            raise UnsafeNameError(f"{what} {name!r}: top-level {META_DIR!r} is reserved")
        for part in parts:
            if part == "zarr.json" or part.endswith(".partial"):
                raise UnsafeNameError(
                    f"{what} {name!r}: 'zarr.json' and '*.partial' are reserved; rename it"
                )
    return name


def check_name_tree(names: list[str]) -> None:
    """Names must be unique and no name may be a group of another (``a`` and ``a/b``)."""
    seen = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"tensor name {name!r} appears twice; names must be unique")
        seen.add(name)
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in seen:
                raise ConfigError(
                    f"tensor {prefix!r} is also a group of tensor {name!r}; a zarr array "
                    "cannot contain other nodes: rename one of them"
                )


def group_paths(names: list[str]) -> list[str]:
    """Every intermediate group of the tensor names, parents first."""
    groups: set[str] = set()
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return sorted(groups, key=lambda g: (g.count("/"), g))


def step_dir(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def chunk_path(name: str, index: int) -> str:
    return f"{name}/c/{index}"


def abort_path(rank: int) -> str:
    return f"{ABORT_DIR}/rank-{rank:05d}/zarr.json"


def manifest_path(rank: int) -> str:
    return f"{MANIFEST_DIR}/rank-{rank:05d}/zarr.json"


# ------------------------------------------------------------------------------ JSON
def gc_paused(fn: Any) -> Any:
    """Run ``fn`` with Python's cyclic garbage collector paused (and resumed after).

    [Note: GC paused while parsing]
    Encoding or parsing a commit record allocates an object or more per piece (a DCP step
    at 256 ranks x 300 tensors: 76,800 pieces, a 52 MB record), and each allocation burst
    lets the collector walk the whole heap, the training process's included: in a 64-rank
    simulation the commit took 2.2 s with the collector and 1.3 s without, a rank's
    ``read_metadata`` 1.5 s and 0.5 s. Nothing these functions build holds a reference
    cycle, so pausing loses nothing; a cycle another thread makes meanwhile is collected
    once the collector resumes. Nested calls leave it to the outermost, and a collector
    that was already off stays off.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@gc_paused
def dumps(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, no NaN) so every rank and every run write equal bytes.

    [Note: canonical JSON, fast]
    The bytes are exactly ``json.dumps(obj, sort_keys=True, indent=1, allow_nan=False)``
    plus a newline (the golden checkpoints pin them). With ``indent`` set, CPython's ``json``
    runs its pure-Python encoder, and a commit record lists every piece of every rank:
    0.12 s of rank 0's commit for a 2-rank FSDP2 state of 305 tensors, growing with tensors
    x ranks, on the critical path of every save. :func:`_canonical` writes the same text with
    the C string escaper and one recursion; anything it does not handle (a non-str key, a
    type JSON refuses, a cycle) goes to ``json.dumps``, which gives its own result or error.
    """
    return (canonical_text(obj) + "\n").encode()


def canonical_text(obj: Any) -> str:
    """:func:`dumps` without the final newline, as text."""
    try:
        return _canonical(obj)
    except _Unhandled:
        return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False, default=_encoded_value)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A value together with its canonical text (:func:`canonical_text`), so that a
    document holding it is written without encoding the value again.

    [Note: a value encoded once]
    A commit record holds the step's tensor entries, which the writer has already encoded
    for its specs digest: on rank 0 of a 2-rank DCP save of a 281 MiB FSDP2 state, about
    2,000 entries, encoding them twice was the largest part of building the record. The
    canonical text of a value nested ``d`` levels down is its text at the top level with
    every newline followed by ``d`` more spaces (a string never holds a raw newline: JSON
    escapes it), so :func:`_canonical` writes the kept text with its newlines indented.
    ``text`` must be ``canonical_text(value)``: :func:`encoded` makes it so."""

    value: Any
    text: str


def encoded(value: Any) -> Encoded:
    return Encoded(value, canonical_text(value))


def _encoded_value(o: Any) -> Any:
    if isinstance(o, Encoded):
        return o.value
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


class _Unhandled(Exception):
    """A value :func:`_canonical` leaves to ``json.dumps``."""


def _canonical(obj: Any) -> str:
    out: list[str] = []
    append = out.append
    escape = _escape_ascii
    inf = math.inf

    def encode(o: Any, pad: str) -> None:
        if isinstance(o, str):
            append(escape(o))
        elif o is None:
            append("null")
        elif o is True:
            append("true")
        elif o is False:
            append("false")
        elif isinstance(o, int):
            append(int.__repr__(o))
        elif isinstance(o, float):
            if o != o or o == inf or o == -inf:
                raise _Unhandled  # json.dumps raises its ValueError
            append(float.__repr__(o))
        elif type(o) is Encoded:
            append(o.text.replace("\n", pad))
        elif isinstance(o, (dict, list, tuple)):
            is_dict = isinstance(o, dict)
            if not o:
                append("{}" if is_dict else "[]")
                return
            if is_dict:
                keys = sorted(o) if all(type(k) is str for k in o) else _unhandled()
                values = [o[k] for k in keys]
            else:
                keys, values = None, o
            inner = pad + " "
            append("{" if is_dict else "[")
            for i, value in enumerate(values):
                append(inner if not i else "," + inner)
                if keys is not None:
                    append(escape(keys[i]))
                    append(": ")
                kind = type(value)  # strings and ints inline: a call each is most of the time
                if kind is str:
                    append(escape(value))
                elif kind is int:
                    append(int.__repr__(value))
                else:
                    encode(value, inner)
            append(pad)
            append("}" if is_dict else "]")
        else:
            raise _Unhandled  # a type JSON refuses: json.dumps says which

    try:
        encode(obj, "\n")
    except RecursionError as exc:  # a cycle, or nesting too deep for one recursion
        raise _Unhandled from exc
    return "".join(out)


def _unhandled() -> list:
    raise _Unhandled


def check_json(value: Any, what: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serialisable without NaN/inf ({exc}); convert values to "
            "str/int/float/list/dict first"
        ) from exc
    return value


def group_document(attributes: dict | None = None) -> bytes:
    return dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}})


def array_document(
    shape: tuple[int, ...], dtype: torch.dtype, layout: TensorLayout, attrs: dict
) -> bytes:
    data_type, fill = _DTYPES[dtype_name(dtype)]
    attributes = {**attrs, "shape": list(shape), "torch_dtype": dtype_name(dtype)}
    return dumps(
        {
            "zarr_format": 3,
            "node_type": "array",
            "shape": [layout.numel],
            "data_type": data_type,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [layout.chunk_numel]},
            },
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "attributes": attributes,
            "storage_transformers": [],
        }
    )


@gc_paused
def parse_document(raw: bytes, key: str, where: str) -> dict:
    """The ``attributes[key]`` dict of a zarr group document read from storage."""
    if len(raw) > MAX_DOCUMENT_NBYTES:
        raise CorruptCheckpointError(
            f"{where} is {len(raw)} bytes, larger than any document zerostate writes "
            f"(limit {MAX_DOCUMENT_NBYTES}); it is damaged or not a zerostate checkpoint"
        )
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({exc})") from exc
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    body = attributes.get(key) if isinstance(attributes, dict) else None
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{where} lacks the attributes.{key} object")
    return body


# ------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One stored chunk object: its size in bytes (payload + checksum) and payload crc32c."""

    nbytes: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of a committed step, as the step-reader protocol shows it (every format).
    Each format's reader keeps its own record type, a subclass adding where the bytes
    are (:class:`ChunkedTensorInfo` here, ``format2.RowTensorInfo``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: TensorLayout
    attrs: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def nbytes(self) -> int:
        return self.layout.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ChunkedTensorInfo(TensorInfo):
    """A format-1 tensor: one object per layout chunk, each with its commit-record entry."""

    chunks: tuple[ChunkRecord, ...] = ()

    def chunk_nbytes(self) -> int:
        """Stored size of every chunk object: zarr stores the edge chunk at full size."""
        return self.layout.chunk_numel * self.dtype.itemsize + CHECKSUM_NBYTES


def spec_json(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, layout: TensorLayout, attrs: dict
) -> dict:
    return {
        "shape": list(shape),
        "dtype": dtype_name(dtype),
        "layout": layout.to_json(),
        "attrs": attrs,
    }


def specs_digest(tensors: dict[str, dict] | Encoded) -> str:
    """Fingerprint of the tensor specs; rank 0 refuses manifests written for other specs."""
    if isinstance(tensors, Encoded):
        return hashlib.sha256((tensors.text + "\n").encode()).hexdigest()
    return hashlib.sha256(dumps(tensors)).hexdigest()


def _int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < lo
        or (hi is not None and value > hi)
    ):
        raise CorruptCheckpointError(f"{what} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def check_format_version(record: dict, where: str, allowed: tuple[int, ...] = READ_VERSIONS) -> int:
    version = record.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpointError(f"{where} has no integer format_version")
    if version not in allowed:
        raise FormatVersionError(
            f"{where} is format version {version}; this zerostate reads versions "
            f"{', '.join(map(str, allowed))} only: upgrade zerostate to read it"
        )
    return version


def parse_commit_record(
    record: dict, expected_step: int, where: str
) -> tuple[int, dict, dict[str, ChunkedTensorInfo], dict[str, ChunkRecord]]:
    """Validate a commit record read from storage: ``(world_size, attrs, tensors, files)``.

    Every name and number is checked before use: the record may come from anyone.
    """
    check_format_version(record, where, (1,))
    step = _int(record.get("step"), f"{where}: step", 0, MAX_STEP)
    if step != expected_step:
        raise CorruptCheckpointError(
            f"{where} says step {step}, but it lives in step {expected_step}'s directory"
        )
    world_size = _int(record.get("world_size"), f"{where}: world_size", 1, MAX_RANKS + 1)
    attrs = record.get("attrs")
    tensors_json, files_json = record.get("tensors"), record.get("files")
    if (
        not isinstance(attrs, dict)
        or not isinstance(tensors_json, dict)
        or not isinstance(files_json, dict)
    ):
        raise CorruptCheckpointError(f"{where}: attrs, tensors and files must be objects")
    tensors: dict[str, ChunkedTensorInfo] = {}
    for name, entry in tensors_json.items():
        validate_name(name)
        tensors[name] = _parse_tensor(name, entry, world_size, f"{where}: tensor {name!r}")
    try:
        check_name_tree(list(tensors))
    except ConfigError as exc:
        raise UnsafeNameError(f"{where}: {exc}") from exc
    files: dict[str, ChunkRecord] = {}
    for path, entry in files_json.items():
        validate_name(path, what="metadata path", allow_meta=True)
        files[path] = _parse_chunk(entry, f"{where}: file {path!r}")
    return world_size, attrs, tensors, files


def _parse_chunk(entry: Any, what: str) -> ChunkRecord:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{what}: expected an object, got {entry!r}")
    return ChunkRecord(
        _int(entry.get("nbytes"), f"{what}: nbytes", 0),
        _int(entry.get("crc32c"), f"{what}: crc32c", 0, 0xFFFFFFFF),
    )


def parse_shape_dtype_layout(
    entry: dict, world_size: int, what: str, max_dim: int | None = None, max_ndim: int = 64
) -> tuple[tuple[int, ...], torch.dtype, TensorLayout]:
    """A tensor entry's logical shape, dtype and layout, checked against each other and
    the step's world size (shared by every format version)."""
    shape_json = entry.get("shape")
    if not isinstance(shape_json, list) or len(shape_json) > max_ndim:
        raise CorruptCheckpointError(f"{what}: shape must be a list of at most {max_ndim} ints")
    shape = tuple(shape_json)
    if not all(type(d) is int and 0 <= d and (max_dim is None or d <= max_dim) for d in shape):
        shape = tuple(_int(d, f"{what}: shape", 0, max_dim) for d in shape)  # names the bad one
    dtype = dtype_from_name(entry.get("dtype"))
    try:
        layout = TensorLayout.from_json(entry.get("layout"))
    except (ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{what}: bad layout ({exc})") from exc
    if layout.numel != math.prod(shape) or layout.world_size != world_size:
        raise CorruptCheckpointError(
            f"{what}: layout {layout} does not match shape {shape} / world_size {world_size}"
        )
    return shape, dtype, layout


def _parse_tensor(name: str, entry: Any, world_size: int, what: str) -> ChunkedTensorInfo:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{what}: expected an object")
    shape, dtype, layout = parse_shape_dtype_layout(entry, world_size, what)
    attrs = entry.get("attrs", {})
    chunks_json = entry.get("chunks")
    if not isinstance(attrs, dict) or not isinstance(chunks_json, list):
        raise CorruptCheckpointError(f"{what}: attrs must be an object and chunks a list")
    chunks = tuple(_parse_chunk(c, f"{what}: chunk {i}") for i, c in enumerate(chunks_json))
    info = ChunkedTensorInfo(name, shape, dtype, layout, attrs, chunks)
    if len(chunks) != layout.num_chunks:
        raise CorruptCheckpointError(
            f"{what}: {len(chunks)} chunk records for {layout.num_chunks} chunks"
        )
    for i, chunk in enumerate(chunks):
        if chunk.nbytes != info.chunk_nbytes():
            raise CorruptCheckpointError(
                f"{what}: chunk {i} recorded as {chunk.nbytes} bytes, expected "
                f"{info.chunk_nbytes()}"
            )
    return info
