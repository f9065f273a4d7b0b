"""Lossless JSON encoding of ``state_dict()`` values (schedulers, samplers, group settings).

Checkpoints never hold pickles, so objects' states are stored as JSON. Plain JSON loses
three things a ``state_dict`` commonly holds; each is written as a one-key marker object:

- tensors: ``{"__zs_tensor__": {"dtype": "float32", "shape": [2, 3], "data": base64}}``
  (little-endian bytes of the contiguous CPU tensor);
- tuples: ``{"__zs_tuple__": [...]}`` (torch's schedulers and optimizers compare
  ``betas`` and friends as tuples);
- dicts with keys that are not strings, or that clash with a marker:
  ``{"__zs_items__": [[key, value], ...]}``;
- raw bytes: ``{"__zs_bytes__": base64}``, and an ``io.BytesIO`` (DCP's tests and trainers
  keep a ``torch.save``-d blob in one): ``{"__zs_bytesio__": {"data": base64, "pos": n}}``,
  its contents and position, as DCP's own pickle of it keeps them. The bytes are data: they
  come back as ``bytes`` / ``io.BytesIO``, never interpreted;
- floats JSON has no number for (infinities and NaNs, which strict JSON refuses):
  ``{"__zs_float__": "7ff0000000000000"}``, the float's eight bytes, big-endian hex, so a NaN
  keeps its sign and payload. ``ReduceLROnPlateau`` holds ``inf`` in its state from the
  start (``mode_worse``), and a loop's ``best_loss`` often begins as ``inf``;
- numpy arrays and numeric scalars (``np.random.get_state()`` holds a ``uint32`` array, and
  a loop's counters and metrics are often ``np.int64`` / ``np.float64``):
  ``{"__zs_ndarray__": {"dtype": "uint32", "shape": [624], "data": base64}}`` and
  ``{"__zs_npscalar__": {"dtype": "float64", "data": base64}}``, little-endian bytes of a
  boolean, integer or float dtype; they load as the same numpy type;
- torch dtypes, devices and sizes (a mixed-precision setting, where a state was placed, a
  shape): ``{"__zs_dtype__": "bfloat16"}``, ``{"__zs_device__": "cuda:1"}``,
  ``{"__zs_size__": [2, 3]}``.

Every key beginning ``__zs_`` is reserved: a dict holding one is stored as items, and a
one-key object with a ``__zs_`` key this version does not know is refused when read (a
newer zerostate's marker is never taken for a plain dict).

A list or dict subclass loads as a list or dict (an ``OrderedDict``, Lightning's
``AttributeDict``: the same items in the same order). Values whose loss would not show as
inequality are refused, naming their path: enum members (an ``IntEnum`` member would load as
a bare int) and named tuples (they would lose their field names).

Decoding validates every marker (known dtype, non-negative shape, byte count matching
the shape) and raises :class:`~zerostate.errors.CorruptCheckpointError` otherwise, so a
damaged or hostile checkpoint cannot produce arbitrary objects.
"""

from __future__ import annotations

import base64
import enum
import io
import math
import re
import struct
import sys
from typing import Any

import numpy as np
import torch

from zerostate.errors import ConfigError, CorruptCheckpointError

_TENSOR = "__zs_tensor__"
_TUPLE = "__zs_tuple__"
_ITEMS = "__zs_items__"
_BYTES = "__zs_bytes__"
_BYTESIO = "__zs_bytesio__"
_FLOAT = "__zs_float__"
_NDARRAY = "__zs_ndarray__"
_NPSCALAR = "__zs_npscalar__"
_DTYPE = "__zs_dtype__"
_DEVICE = "__zs_device__"
_SIZE = "__zs_size__"
_RESERVED = "__zs_"
#: numpy dtypes an array or scalar in a state may have: no objects, strings or records.
NUMPY_DTYPES = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64".split()
)
_DEVICE_TEXT = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
#: Deepest nesting of containers a state may have (a marker's body counts as one level).
#: Real states are a few levels deep; the bound keeps a hostile document from exhausting
#: the interpreter's recursion, and a save from writing what a load could not read.
MAX_DEPTH = 100
#: A BytesIO's stored position is at most this (as the store's other integers).
_MAX_POS = 1 << 62

#: dtypes a tensor in a state may have; anything else is refused on encode and decode.
DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
        torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def encode(value: Any, what: str = "state", _depth: int = 0) -> Any:
    """A JSON-able form of ``value``; raises ConfigError naming the path of anything else."""
    if _depth > MAX_DEPTH:
        shown = what if len(what) <= 120 else what[:120] + "..."
        raise ConfigError(
            f"{shown} is nested more than {MAX_DEPTH} containers deep; a checkpoint stores "
            "states of at most that depth"
        )
    deeper = _depth + 1
    if isinstance(value, enum.Enum):
        # An IntEnum or StrEnum member is an int or a str too, but would load as its bare
        # value: its type and name gone.
        raise ConfigError(
            f"{what} is the enum member {type(value).__name__}.{value.name}, which would load "
            "as its bare value; store its .value or .name in state_dict()"
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise ConfigError(
            f"{what} is a named tuple ({type(value).__name__}), which would load as a plain "
            "tuple without its field names; store tuple(...) or ._asdict() in state_dict()"
        )
    # numpy first: np.float64 is a float, and would load as a plain one.
    if isinstance(value, np.ndarray | np.bool_ | np.number):
        return _encode_numpy(value, what)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if type(value) is torch.Size:  # a tuple, which would load as a plain one
        return {_SIZE: list(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: struct.pack(">d", value).hex()}
    if isinstance(value, torch.Tensor):
        return {_TENSOR: _encode_tensor(value, what)}
    # Exact types: a subclass would come back as its base, which is not lossless.
    if type(value) is bytes:
        return {_BYTES: base64.b64encode(value).decode("ascii")}
    if type(value) is io.BytesIO:
        if value.closed:
            raise ConfigError(f"{what} is a closed io.BytesIO; its contents are gone")
        data = base64.b64encode(value.getvalue()).decode("ascii")
        return {_BYTESIO: {"data": data, "pos": value.tell()}}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, f"{what}[{i}]", deeper) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{what}[{i}]", deeper) for i, v in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(k, str) and not k.startswith(_RESERVED) for k in value)
        if plain:
            return {k: encode(v, f"{what}[{k!r}]", deeper) for k, v in value.items()}
        for k in value:
            if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                raise ConfigError(
                    f"{what} has a dict key {k!r} of type {type(k).__name__}; keys must be "
                    "str, int, float, bool, None or tuples of them"
                )
        return {
            _ITEMS: [
                [encode(k, what, deeper), encode(v, f"{what}[{k!r}]", deeper)]
                for k, v in value.items()
            ]
        }
    raise ConfigError(
        f"{what} holds a {type(value).__name__}, which a checkpoint cannot store without "
        "pickle; state_dict() values must be None, bool, int, float, str, bytes, "
        "io.BytesIO, tensors, numpy arrays and numbers, torch dtypes, devices and sizes, or "
        "lists / tuples / dicts of them"
    )


def _encode_numpy(value: Any, what: str) -> dict:
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        raise ConfigError(
            f"{what} is a {type(value).__name__} (a numpy array subclass), which would load as "
            "a plain array; store np.asarray(...) in state_dict()"
        )
    dtype = value.dtype
    if dtype.name not in NUMPY_DTYPES or dtype.fields is not None:
        raise ConfigError(
            f"{what} is a numpy {'array' if isinstance(value, np.ndarray) else 'scalar'} of "
            f"dtype {dtype}; supported: {', '.join(sorted(NUMPY_DTYPES))}"
        )
    data = np.ascontiguousarray(value, dtype=dtype.newbyteorder("<")).tobytes()
    body = {"dtype": dtype.name, "data": base64.b64encode(data).decode("ascii")}
    if isinstance(value, np.ndarray):
        return {
            _NDARRAY: {"dtype": body["dtype"], "shape": list(value.shape), "data": body["data"]}
        }
    return {_NPSCALAR: body}


def _encode_tensor(t: torch.Tensor, what: str) -> dict:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"{what} is a tensor of dtype {t.dtype}; supported: {sorted(DTYPES)}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # States are small (a sampler's position, an RNG key), so a list round trip is fine
    # and needs no numpy.
    raw = bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""
    if sys.byteorder != "little" and t.element_size() > 1:
        raise ConfigError("saving tensors in states needs a little-endian host")
    return {
        "dtype": name,
        "shape": list(t.shape),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def decode(value: Any, what: str = "state", _depth: int = 0) -> Any:
    """Inverse of :func:`encode`, validating every marker it meets."""
    if _depth > MAX_DEPTH:
        raise CorruptCheckpointError(
            f"{what[:120]}: stored state nested more than {MAX_DEPTH} containers deep"
        )
    deeper = _depth + 1
    if isinstance(value, list):
        return [decode(v, what, deeper) for v in value]
    if not isinstance(value, dict):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise CorruptCheckpointError(f"{what}: unexpected {type(value).__name__} in stored state")
    if len(value) == 1:
        ((key, body),) = value.items()
        if key == _TENSOR:
            return _decode_tensor(body, what)
        if key == _TUPLE:
            if not isinstance(body, list):
                raise CorruptCheckpointError(f"{what}: malformed tuple in stored state")
            return tuple(decode(v, what, deeper) for v in body)
        if key == _BYTES:
            return _decode_base64(body, what)
        if key == _BYTESIO:
            return _decode_bytesio(body, what)
        if key == _FLOAT:
            return _decode_float(body, what)
        if key == _ITEMS:
            if not isinstance(body, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in body
            ):
                raise CorruptCheckpointError(f"{what}: malformed dict items in stored state")
            return {
                _hashable(decode(k, what, deeper), what): decode(v, what, deeper) for k, v in body
            }
        if key == _NDARRAY:
            return _decode_numpy(body, what, scalar=False)
        if key == _NPSCALAR:
            return _decode_numpy(body, what, scalar=True)
        if key == _DTYPE:
            return _decode_dtype(body, what)
        if key == _DEVICE:
            return _decode_device(body, what)
        if key == _SIZE:
            if (
                not isinstance(body, list)
                or len(body) > 64
                or not all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62
                    for d in body
                )
            ):
                raise CorruptCheckpointError(f"{what}: {body!r:.60} is not a torch.Size")
            return torch.Size(body)
        if isinstance(key, str) and key.startswith(_RESERVED):
            raise CorruptCheckpointError(
                f"{what}: unknown marker {key[:40]!r} in stored state (written by a newer "
                "zerostate?)"
            )
    return {k: decode(v, f"{what}[{k!r}]", deeper) for k, v in value.items()}


def _hashable(key: Any, what: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise CorruptCheckpointError(f"{what}: unhashable dict key in stored state") from None
    return key


def _decode_base64(body: Any, what: str) -> bytes:
    if not isinstance(body, str):
        raise CorruptCheckpointError(f"{what}: stored bytes are not base64 text")
    try:
        return base64.b64decode(body, validate=True)
    except ValueError:
        raise CorruptCheckpointError(f"{what}: stored bytes are not valid base64") from None


def _decode_float(body: Any, what: str) -> float:
    """A non-finite float's eight bytes; a finite one is stored as a JSON number, never so."""
    try:
        if not isinstance(body, str) or len(body) != 16 or body != body.lower():
            raise ValueError
        (value,) = struct.unpack(">d", bytes.fromhex(body))
    except ValueError:
        raise CorruptCheckpointError(f"{what}: malformed float in stored state") from None
    if math.isfinite(value):
        raise CorruptCheckpointError(f"{what}: a finite float stored as a marker")
    return value


def _decode_bytesio(body: Any, what: str) -> io.BytesIO:
    if not isinstance(body, dict) or set(body) != {"data", "pos"}:
        raise CorruptCheckpointError(f"{what}: malformed BytesIO in stored state")
    pos = body["pos"]
    if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos < _MAX_POS:
        raise CorruptCheckpointError(f"{what}: BytesIO position {pos!r} is invalid")
    buffer = io.BytesIO(_decode_base64(body["data"], what))
    buffer.seek(pos)
    return buffer


def _decode_numpy(body: Any, what: str, scalar: bool) -> Any:
    keys = {"dtype", "data"} if scalar else {"dtype", "shape", "data"}
    if not isinstance(body, dict) or set(body) != keys:
        raise CorruptCheckpointError(f"{what}: malformed numpy value in stored state")
    name = body["dtype"]
    if not isinstance(name, str) or name not in NUMPY_DTYPES:
        raise CorruptCheckpointError(f"{what}: numpy dtype {name!r:.40} is not supported")
    shape = [] if scalar else body["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > 64
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape
        )
    ):
        raise CorruptCheckpointError(f"{what}: numpy shape {shape!r:.80} is invalid")
    raw = _decode_base64(body["data"], what)
    dtype = np.dtype(name)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{what}: a numpy {name} value of shape {shape} needs "
            f"{math.prod(shape) * dtype.itemsize} bytes, the stored state has {len(raw)}"
        )
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    return array[()] if scalar else array


def _decode_dtype(body: Any, what: str) -> torch.dtype:
    dtype = getattr(torch, body, None) if isinstance(body, str) and body.isidentifier() else None
    # The canonical name only (what encode writes): no alias, nothing but a dtype.
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{body}":
        raise CorruptCheckpointError(f"{what}: {body!r:.40} is not a torch dtype")
    return dtype


def _decode_device(body: Any, what: str) -> torch.device:
    if not isinstance(body, str) or not _DEVICE_TEXT.fullmatch(body):
        raise CorruptCheckpointError(f"{what}: {body!r:.40} is not a torch device")
    try:
        return torch.device(body)
    except (RuntimeError, ValueError):
        raise CorruptCheckpointError(f"{what}: {body!r:.40} is not a torch device") from None


def _decode_tensor(body: Any, what: str) -> torch.Tensor:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
        raise CorruptCheckpointError(f"{what}: malformed tensor in stored state")
    dtype = DTYPES.get(body["dtype"]) if isinstance(body["dtype"], str) else None
    shape = body["shape"]
    if dtype is None:
        raise CorruptCheckpointError(f"{what}: tensor dtype {body['dtype']!r} is not supported")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise CorruptCheckpointError(f"{what}: tensor shape {shape!r} is invalid")
    if not isinstance(body["data"], str):
        raise CorruptCheckpointError(f"{what}: tensor data is not base64 text")
    try:
        raw = base64.b64decode(body["data"], validate=True)
    except ValueError:
        raise CorruptCheckpointError(f"{what}: tensor data is not valid base64") from None
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise CorruptCheckpointError(
            f"{what}: tensor of shape {shape} and dtype {body['dtype']} needs "
            f"{numel * itemsize} bytes, the stored state has {len(raw)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()
