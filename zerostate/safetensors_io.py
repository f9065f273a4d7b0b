"""Hugging Face safetensors checkpoints read by byte range, with every header field checked.

[Note: safetensors layout]
A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON,
then the data. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the first data byte, row-major little-endian elements)
plus an optional ``"__metadata__"`` map of strings. A sharded checkpoint adds
``model.safetensors.index.json`` whose ``"weight_map"`` names the file holding each tensor.

Nothing here trusts the file: the header length is capped before anything is allocated,
the JSON may not repeat a key, each entry's dtype must be known, its shape a list of
non-negative integers, its byte range exactly ``numel * itemsize`` long, inside the file,
and disjoint from every other entry's; index file names must be plain names beside the
index (no directories, no ``..``). A rank then reads only the ranges it owns
(:meth:`SafetensorsSource.read_elements`), so no rank ever holds a whole file.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from zerostate.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UnsafeNameError,
)

#: The safetensors library refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_BYTES = 100 << 20
#: Index files are small JSON maps; anything far bigger is not one.
MAX_INDEX_BYTES = 64 << 20
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Bytes read and converted at a time, bounding the temporary memory of one tensor's read.
READ_PIECE_BYTES = 32 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _load_json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}") from None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(
    raw: bytes, *, file: str, data_start: int, file_size: int
) -> dict[str, TensorEntry]:
    """Validate a safetensors JSON header; entries carry absolute file offsets."""
    header = _load_json(raw, f"the header of {file}")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"the header of {file} is not a JSON object")
    data_size = file_size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        where = f"{file}: tensor {name!r}"
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in info.items()
            ):
                raise CorruptCheckpointError(f"{file}: __metadata__ must map strings to strings")
            continue
        if not name or "\x00" in name:
            raise CorruptCheckpointError(f"{file}: empty or NUL-containing tensor name {name!r}")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CorruptCheckpointError(
                f"{where} must be an object with exactly dtype, shape and data_offsets"
            )
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise CorruptCheckpointError(
                f"{where} has dtype {info['dtype']!r}; supported: {', '.join(DTYPES)}"
            )
        shape = info["shape"]
        if not isinstance(shape, list) or len(shape) > 64 or not all(map(_is_index, shape)):
            raise CorruptCheckpointError(f"{where} has shape {shape!r}; need non-negative ints")
        offsets = info["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(map(_is_index, offsets))
            or offsets[0] > offsets[1]
        ):
            raise CorruptCheckpointError(f"{where} has data_offsets {offsets!r}; need [begin, end]")
        entry = TensorEntry(name, file, dtype, tuple(shape), data_start + offsets[0],
                            data_start + offsets[1])  # fmt: skip
        if offsets[1] > data_size:
            raise CorruptCheckpointError(
                f"{where} ends at data byte {offsets[1]} but the file holds only {data_size} "
                "data bytes (truncated or forged header)"
            )
        if entry.end - entry.begin != entry.numel * dtype.itemsize:
            raise CorruptCheckpointError(
                f"{where}: {entry.end - entry.begin} bytes for shape {list(shape)} of "
                f"{info['dtype']} (needs {entry.numel * dtype.itemsize})"
            )
        entries[name] = entry
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CorruptCheckpointError(f"{file}: tensors {a!r} and {b!r} overlap in the data")
    return entries


def check_file_name(name: Any, *, index: str) -> str:
    """A shard name from an index must be a plain ``*.safetensors`` name beside the index."""
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or name.startswith(".")
        or any(c in name for c in "/\\\x00:")
        or posixpath.basename(name) != name
    ):
        raise UnsafeNameError(
            f"{index} names the file {name!r}; shard files must be plain '*.safetensors' "
            "names in the index's own directory"
        )
    return name


def parse_index(raw: bytes, *, index: str) -> dict[str, str]:
    """``{tensor name: shard file name}`` from a ``model.safetensors.index.json``."""
    doc = _load_json(raw, index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{index} has no 'weight_map' object of tensor -> file")
    out = {}
    for name, file in weight_map.items():
        if not name or "\x00" in name:
            raise CorruptCheckpointError(f"{index}: empty or NUL-containing tensor name")
        out[name] = check_file_name(file, index=index)
    return out


class SafetensorsSource:
    """A safetensors checkpoint (one file, or shards named by an index) on local disk or at
    an fsspec URL; reads headers and byte ranges, never whole files."""

    def __init__(self, path_or_url: str | os.PathLike, storage_options: dict | None = None):
        url = os.fspath(path_or_url)
        if not isinstance(url, str) or not url:
            raise CheckpointNotFoundError(f"pretrained path must be a path or URL, got {url!r}")
        self.url = url
        self._local = "://" not in url or url.startswith("file://")
        if self._local:
            if storage_options:
                raise StorageError(
                    f"storage_options were given for the local path {url!r}; they apply to "
                    "fsspec URLs only: drop them or use a URL"
                )
            self.fs, root = fsspec.filesystem("file"), os.path.abspath(url.removeprefix("file://"))
        else:
            try:
                self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            except (ImportError, ValueError, TypeError) as exc:
                raise StorageError(f"cannot open {url}: {exc}") from exc
        self.root, self.files = self._resolve(root.rstrip("/"))

    def _isfile(self, path: str) -> bool:
        try:
            return bool(self.fs.isfile(path))
        except OSError as exc:
            raise StorageError(f"cannot reach {path}: {exc}") from exc

    def _resolve(self, root: str) -> tuple[str, dict[str, str] | None]:
        """(directory, weight map or None for a single file); ``self.single`` names it."""
        self.single: str | None = None
        if root.endswith(".safetensors") and self._isfile(root):
            self.single = posixpath.basename(root)
            return posixpath.dirname(root), None
        if root.endswith(".json") and self._isfile(root):
            directory, index = posixpath.dirname(root), posixpath.basename(root)
        elif self._isfile(f"{root}/{INDEX_FILE}"):
            directory, index = root, INDEX_FILE
        elif self._isfile(f"{root}/{SINGLE_FILE}"):
            self.single = SINGLE_FILE
            return root, None
        else:
            raise CheckpointNotFoundError(
                f"{self.url} is neither a .safetensors file nor a directory holding "
                f"{SINGLE_FILE} or {INDEX_FILE}{self._checkpoint_root_hint(root)}"
            )
        size = self._size(f"{directory}/{index}")
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(f"{index} is {size} bytes; an index is far smaller")
        self.root = directory  # _read resolves names against it
        return directory, parse_index(self._read(index, 0, size), index=index)

    def _checkpoint_root_hint(self, root: str) -> str:
        """What to do instead when ``root`` is a checkpoint root (it holds ``step-N``
        directories): the usual mix-up of a training checkpoint with exported weights."""
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(root, detail=False)]
        except (OSError, ValueError):
            return ""
        from zerostate.store import format as fmt  # the store's step naming; an error path

        if not any(fmt.parse_step_dir(n) is not None for n in names):
            return ""
        return (
            "; it is a checkpoint root (it holds step directories): resume from it with "
            f"engine.load({self.url!r}), or export its weights first with "
            f"`zerostate consolidate {self.url} OUT/` and load OUT/"
        )

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(path))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc}") from exc

    def _read(self, file: str, start: int, stop: int) -> bytearray:
        path = f"{self.root}/{file}"
        try:
            if self._local:
                data = bytearray(stop - start)  # writable: torch.frombuffer takes it as is
                with open(path, "rb", buffering=0) as f:
                    f.seek(start)
                    got = 0
                    while got < len(data):
                        n = f.readinto(memoryview(data)[got:])
                        if not n:
                            break
                        got += n
                del data[got:]
            else:
                data = bytearray(self.fs.cat_file(path, start=start, end=stop))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"reading {path} [{start}, {stop}) failed: {exc}") from exc
        if len(data) != stop - start:
            raise CorruptCheckpointError(
                f"{path}: read {len(data)} of {stop - start} bytes at {start} (file shrank?)"
            )
        return data

    def file_names(self) -> list[str]:
        if self.files is None:
            return [self.single]
        return sorted(set(self.files.values()))

    def read_header(self, file: str) -> dict[str, TensorEntry]:
        size = self._size(f"{self.root}/{file}")
        if size < 8:
            raise CorruptCheckpointError(f"{file} is {size} bytes: too short for safetensors")
        length = int.from_bytes(self._read(file, 0, 8), "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CorruptCheckpointError(
                f"{file} declares a {length}-byte header (file: {size} bytes, limit "
                f"{MAX_HEADER_BYTES}); it is not a safetensors file or it is damaged"
            )
        return parse_header(self._read(file, 8, 8 + length), file=file, data_start=8 + length,
                            file_size=size)  # fmt: skip

    def entries(self) -> dict[str, TensorEntry]:
        """Every tensor's entry, from the headers of all files (checked against the index)."""
        out: dict[str, TensorEntry] = {}
        for file in self.file_names():
            header = self.read_header(file)
            for name, entry in header.items():
                if self.files is not None and self.files.get(name) != file:
                    continue  # the index is the authority on where each tensor lives
                out[name] = entry
        if self.files is not None:
            lost = sorted(set(self.files) - set(out))
            if lost:
                raise CorruptCheckpointError(
                    f"the index maps {len(lost)} tensor(s) to files whose headers lack them: "
                    + ", ".join(lost[:5])
                )
        return out

    def read_elements(self, entry: TensorEntry, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of the flat tensor into ``out`` (converting the
        dtype), reading at most :data:`READ_PIECE_BYTES` at a time."""
        assert 0 <= start <= stop <= entry.numel and out.numel() == stop - start
        if sys.byteorder != "little" and entry.dtype.itemsize > 1:
            raise StorageError("reading safetensors on a big-endian host is not supported")
        item = entry.dtype.itemsize
        step = max(1, READ_PIECE_BYTES // item)
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            raw = self._read(entry.file, entry.begin + lo * item, entry.begin + hi * item)
            piece = torch.frombuffer(raw, dtype=entry.dtype)
            out[lo - start : hi - start].copy_(piece)
