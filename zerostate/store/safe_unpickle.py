"""Reading the peers' pickles without running them.

DeepSpeed's ``.pt`` files and DCP's items are ``torch.save`` zip archives; DCP's
``.metadata`` is a bare pickle. A pickle is a program: every global it names is imported
and may be called. So this module unpickles with :class:`RestrictedUnpickler`, whose
``find_class`` hands out only stand-ins from an allow list (:data:`TORCH_GLOBALS`,
:data:`DEEPSPEED_GLOBALS`, :data:`DCP_GLOBALS`): plain containers, records that keep their
fields in a dict, dtype markers, and a tensor rebuild that makes no tensor at all but a
:class:`StoredTensor` naming where the bytes lie in the archive. Any other global (``os
system``, ``builtins eval``, a class of the writer's code) is refused with
:class:`UnsafePickleError`, one line naming it, before anything runs. Nothing of deepspeed
or of the DCP modules is imported.

Tensor bytes are then read by byte range (:meth:`TorchArchive.read`), so a reader holds
one parameter's slice at a time, never a whole ``.pt`` file.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.errors import CorruptCheckpointError
from zerostate.store.storage import Storage

#: Largest pickle (``data.pkl``, ``.metadata``) read into memory.
MAX_PICKLE_NBYTES = 1 << 30


class UnsafePickleError(CorruptCheckpointError):
    """A pickle names a global that could run code; nothing of it was run."""


class Record:
    """Stand-in for an allowed class: keeps constructor args and pickled state as data."""

    kind = "record"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.fields = args, dict(kwargs)

    def __setstate__(self, state: Any) -> None:
        # Plain __dict__ state, or (dict, slots dict) for classes with __slots__.
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if isinstance(part, dict):
                    self.fields.update(part)
        elif isinstance(state, dict):
            self.fields.update(state)
        else:
            self.fields["__state__"] = state

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def __repr__(self) -> str:
        return f"{self.kind}({self.fields!r})"


def _record_class(kind: str) -> type[Record]:
    def new(cls: type, *args: Any, **kwargs: Any) -> Record:
        obj = object.__new__(cls)
        obj.args, obj.fields = args, dict(kwargs)
        return obj

    return type(kind, (Record,), {"kind": kind, "__new__": new})


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor of a ``torch.save`` archive, not read: storage key, offset, shape."""

    key: str
    dtype: torch.dtype
    storage_numel: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True, slots=True)
class _DtypeMarker:
    dtype: torch.dtype


class _TensorMarker:
    """``torch.Tensor`` named as the type of a rebuilt tensor (never instantiated)."""


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


def _check_ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CorruptCheckpointError(f"{what} must be a tuple of non-negative ints: {value!r:.80}")
    return tuple(value)


def _size(dims: Any = ()) -> tuple[int, ...]:
    return _check_ints(dims, "torch.Size")


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> StoredTensor:
    if not isinstance(storage, _StorageRef) or not isinstance(offset, int):
        raise CorruptCheckpointError("a tensor in the pickle has no valid storage reference")
    shape, strides = _check_ints(size, "tensor size"), _check_ints(stride, "tensor stride")
    expect, acc = [], 1
    for d in reversed(shape):
        expect.append(acc)
        acc *= d
    if tuple(reversed(expect)) != strides and acc > 1:
        raise CorruptCheckpointError(f"tensor of shape {shape} is not contiguous ({strides})")
    tensor = StoredTensor(storage.key, storage.dtype, storage.numel, offset, shape)
    if offset < 0 or offset + tensor.numel > storage.numel:
        raise CorruptCheckpointError(f"tensor of shape {shape} lies outside its storage")
    return tensor


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is not _rebuild_tensor or new_type is not _TensorMarker:
        raise UnsafePickleError("the pickle rebuilds a tensor subclass; refused")
    return func(*args)


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding != "latin1":
        raise UnsafePickleError(f"_codecs.encode({encoding!r}) refused")
    return text.encode("latin1")


def _enum_value(value: Any) -> Any:
    return value


def _layout_name(name: Any) -> str:
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"tensor layout {name!r:.40} is not a name")
    return name


def _path_text(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpointError("a pickled path has non-text parts")
    return "/".join(parts)


_DTYPE_NAMES = (
    "float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool float "
    "double half long int short complex64 complex128 cfloat cdouble"
).split()

TORCH_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): _size,
    ("torch", "Tensor"): _TensorMarker,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("_codecs", "encode"): _codecs_encode,
    **{("torch", name): _DtypeMarker(dtype) for name, dtype in _STORAGE_DTYPES.items()},
    **{("torch", name): getattr(torch, name) for name in _DTYPE_NAMES},
    ("torch", "strided"): "strided",
    ("torch", "contiguous_format"): "contiguous_format",
    ("torch", "preserve_format"): "preserve_format",
}

DEEPSPEED_GLOBALS: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _record_class("LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _record_class("DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _enum_value,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _record_class("fragment_address"),
}

_DCP = "torch.distributed.checkpoint"
DCP_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        (f"{_DCP}.metadata", name): _record_class(name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    },
    (f"{_DCP}.filesystem", "_StorageInfo"): _record_class("_StorageInfo"),
    # Megatron-Core's torch_dist keeps every rank's save plan in the metadata
    # (``all_local_plans``, to reuse them on the next save): records, never read.
    **{
        (f"{_DCP}.planner", name): _record_class(name)
        for name in ("SavePlan", "WriteItem", "TensorWriteData")
    },
    (f"{_DCP}.planner", "WriteItemType"): _enum_value,
    (f"{_DCP}._extension", "StreamTransformExtension"): _record_class("Extension"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _enum_value,
    ("torch.serialization", "_get_layout"): _layout_name,
    # StorageMeta.checkpoint_id: the path it was saved to, kept as text.
    ("pathlib", "PosixPath"): _path_text,
    ("pathlib", "WindowsPath"): _path_text,
}


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that resolves only the globals of ``allowed``; see the module doc.

    The pure-Python unpickler, so that BUILD (which sets attributes) can be limited to the
    stand-in records: no pickle can change an attribute of an allowed function or class.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def _load_build(self) -> None:
        if not isinstance(self.stack[-2], Record | OrderedDict):
            raise UnsafePickleError(
                f"{self._where}: refused to set state on {type(self.stack[-2]).__name__}"
            )
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed, self._where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise UnsafePickleError(
                f"{self._where}: refused to unpickle global {module}.{name} (it could run "
                "code; zerostate reads only tensors and plain data)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        # torch.save: ('storage', <FloatStorage>, key, location, numel)
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _DtypeMarker)
            and isinstance(pid[2], str)
            and pid[2].isalnum()
            and isinstance(pid[4], int)
            and pid[4] >= 0
        ):
            return _StorageRef(pid[2], pid[1].dtype, pid[4])
        raise UnsafePickleError(f"{self._where}: refused persistent id {pid!r:.80}")


def restricted_loads(data: bytes, allowed: dict[tuple[str, str], Any], where: str) -> Any:
    """Unpickle ``data`` resolving only the globals of ``allowed``."""
    try:
        return RestrictedUnpickler(data, allowed, where).load()
    except UnsafePickleError:
        raise
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is a damaged checkpoint
        raise CorruptCheckpointError(
            f"{where}: not a readable pickle ({type(exc).__name__}: {exc})"
        ) from None


# ------------------------------------------------------------------------- archives
def object_size(storage: Storage, path: str) -> int:
    """Bytes of object ``path``: a stat where the backend has one, else probed by reads."""
    return storage.size(path)


class _RangeFile(io.RawIOBase):
    """Bytes ``[base, base + size)`` of a stored object as a seekable file (for zipfile)."""

    def __init__(self, storage: Storage, path: str, base: int, size: int) -> None:
        self._storage, self._path, self._base, self._size, self._pos = (
            storage, path, base, size, 0,
        )  # fmt: skip

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(view.nbytes, self._size - self._pos))
        if n == 0:
            return 0
        got = self._storage.read_range_into(self._path, self._base + self._pos, [view[:n]])
        self._pos += got
        return got


class TorchArchive:
    """One ``torch.save`` zip archive (a whole ``.pt`` object, or an item inside a DCP
    file at ``base``): its pickle through the restricted unpickler, its tensors by range."""

    def __init__(
        self,
        storage: Storage,
        path: str,
        allowed: dict[tuple[str, str], Any],
        *,
        base: int = 0,
        size: int | None = None,
    ) -> None:
        self._storage, self._path, self._base = storage, path, base
        self.url = storage.url_of(path) + (f" (bytes from {base})" if base else "")
        if size is None:
            size = object_size(storage, path) - base
        self._size = size
        self._allowed = allowed
        self._offsets: dict[str, tuple[int, int]] = {}
        try:
            with zipfile.ZipFile(_RangeFile(storage, path, base, size)) as zf:
                infos = zf.infolist()
                pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
                if len(pickles) != 1:
                    raise CorruptCheckpointError(f"{self.url}: not a torch.save archive")
                self._prefix = pickles[0].filename[: -len("data.pkl")]
                if pickles[0].file_size > MAX_PICKLE_NBYTES:
                    raise CorruptCheckpointError(f"{self.url}: its pickle is too large")
                self._pickle = zf.read(pickles[0])
                header = memoryview(bytearray(30))
                for info in infos:
                    name = info.filename
                    if not name.startswith(self._prefix + "data/"):
                        continue
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise CorruptCheckpointError(f"{self.url}: {name} is compressed")
                    got = storage.read_range_into(path, base + info.header_offset, [header])
                    if got != 30 or bytes(header[:4]) != b"PK\x03\x04":
                        raise CorruptCheckpointError(f"{self.url}: bad zip entry {name}")
                    name_len, extra_len = struct.unpack_from("<HH", header, 26)
                    start = info.header_offset + 30 + name_len + extra_len
                    self._offsets[name.rsplit("/", 1)[1]] = (start, info.file_size)
        except CorruptCheckpointError:
            raise
        except (zipfile.BadZipFile, ValueError, EOFError, struct.error, KeyError) as exc:
            # UnicodeDecodeError among them: a damaged entry name.
            raise CorruptCheckpointError(
                f"{self.url}: not a readable torch.save archive ({type(exc).__name__}: {exc})"
            ) from None

    def load(self) -> Any:
        """The pickled object, with :class:`StoredTensor` in place of every tensor."""
        return restricted_loads(self._pickle, self._allowed, self.url)

    def read(
        self, tensor: StoredTensor, start: int = 0, stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Elements ``[start, stop)`` of ``tensor`` (flat), read by range, as a new or
        the given 1-D tensor."""
        stop = tensor.numel if stop is None else stop
        if not 0 <= start <= stop <= tensor.numel:
            raise CorruptCheckpointError(f"{self.url}: range [{start}, {stop}) out of bounds")
        where = self._offsets.get(tensor.key)
        size = tensor.dtype.itemsize
        if where is None or where[1] < tensor.storage_numel * size:
            raise CorruptCheckpointError(f"{self.url}: storage {tensor.key!r} is missing or short")
        if out is None:
            out = torch.empty(stop - start, dtype=tensor.dtype)
        if stop == start:
            return out
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        at = self._base + where[0] + (tensor.offset + start) * size
        got = self._storage.read_range_into(self._path, at, [view])
        if got != view.nbytes:
            raise CorruptCheckpointError(f"{self.url}: storage {tensor.key!r} ends early")
        return out

    def verify(self, progress: Callable[[int], Any] | None = None) -> int:
        """Read every byte and check every zip entry's CRC-32; returns bytes read."""
        total = 0
        try:
            with zipfile.ZipFile(
                _RangeFile(self._storage, self._path, self._base, self._size)
            ) as zf:
                for info in zf.infolist():
                    with zf.open(info) as f:  # zipfile checks the CRC at the end
                        while block := f.read(16 << 20):
                            total += len(block)
                            if progress is not None:
                                progress(len(block))
        except (zipfile.BadZipFile, ValueError, EOFError, struct.error, KeyError) as exc:
            raise CorruptCheckpointError(
                f"{self.url}: damaged ({type(exc).__name__}: {exc})"
            ) from None
        return total
