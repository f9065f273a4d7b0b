"""Consolidate one checkpoint step into safetensors, streaming tensor by tensor.

[Note: streaming consolidation]
The safetensors header holds every tensor's dtype, shape and byte offsets, and all of
those follow from the step's metadata (:class:`TensorInfo`) without reading any data. So
the header is computed and written first, then each tensor's bytes are appended in header
order, one stored chunk at a time (see :func:`iter_chunk_payloads`), cast in pieces of at
most ``piece_bytes`` when a dtype is requested. Host memory is thus bounded by two chunks
(the one being written and the one being prefetched; a chunk is at most one tensor) plus
one cast piece, not by the model, which is what zero_to_fp32-style "gather everything,
then save" tools run out of.

Output is written to ``<file>.partial``, flushed, fsynced and then renamed, so a crash
never leaves a complete-looking file. A sharded output (``max_shard_size``) renames every
shard first and writes ``<prefix>.safetensors.index.json`` last: without the index the
Hugging Face loaders do not consider the directory a checkpoint.

Only model weights (``model/<param>``, written as ``<param>``) and buffers
(``buffers/<name>``, written as ``<name>``) are exported; optimizer state is skipped, and
so are the buffers the engine recorded as non-persistent
(``attrs["engine"]["non_persistent_buffers"]``): the export holds what the model's
``state_dict()`` holds.
Tied parameters (``attrs["engine"]["tied"] = {alias: canonical}``) are stored once, under
the canonical name, and are exported once: safetensors refuses shared storage, and Hugging
Face models re-tie aliases on load (``tie_word_embeddings``). The aliases are returned in
:attr:`ConsolidateResult.tied` so callers can report them.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerostate.errors import ConfigError, CorruptCheckpointError
from zerostate.store import format as fmt
from zerostate.store.protocol import CheckpointSource
from zerostate.store.sources import open_source
from zerostate.store.storage import location_contains

#: Called as ``progress(bytes_done, bytes_total)`` after each piece is written.
ProgressFn = Callable[[int, int], None]

#: Largest piece cast at once (bytes of the stored dtype).
DEFAULT_PIECE_BYTES = 64 << 20

MODEL_PREFIX = "model/"
BUFFERS_PREFIX = "buffers/"

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",  # safetensors has no complex128 ([Note: complex tensors])
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-z]*)\s*$", re.I)


def parse_size(text: str | int) -> int:
    """Bytes from ``5GB`` (10**9), ``500MB``, ``2GiB`` (2**30) or a plain byte count."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"cannot read size {text!r}: write it like 5GB, 500MB, 2GiB or a byte count"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ConfigError(f"size must be at least 1 byte, got {text!r}")
    return value


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``fp32``/``bf16``/``fp16``, their long names (``bfloat16``, ``torch.bfloat16``) or the
    torch dtype; ``None`` keeps the stored dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in _DTYPE_NAMES.values():
            raise ConfigError(f"dtype must be fp32, bf16 or fp16, got {dtype}")
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower().strip().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}") from None


@dataclass(frozen=True, slots=True)
class ExportEntry:
    """One tensor of the output: where it comes from and how it is stored."""

    name: str  # name in the safetensors file
    source: str  # logical tensor name in the checkpoint
    shape: tuple[int, ...]
    dtype: torch.dtype  # dtype written (after the optional cast)
    numel: int
    #: The stored real pairs of a complex tensor, written as that complex tensor (the same
    #: bytes, no cast).
    pairs: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(slots=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote."""

    step: int
    files: list[Path]
    index: Path | None
    num_tensors: int
    total_bytes: int
    tied: dict[str, str] = field(default_factory=dict)


def export_entries(
    tensors: dict[str, Any], dtype: torch.dtype | None, skip: frozenset[str] = frozenset()
) -> list[ExportEntry]:
    """Select model weights and buffers from a step's ``tensors`` (name -> TensorInfo),
    leaving out the buffers named in ``skip`` (see ``non_persistent_names``).

    Floating-point tensors are cast to ``dtype`` when given; integer and bool buffers
    (step counters, position ids, masks) keep their dtype. A complex tensor, stored as its
    real pairs ([Note: complex tensors] in zerostate.store.format), is never cast: a
    complex64 one is written as safetensors' C64, a complex128 one (which safetensors
    cannot hold) as its float64 real pairs with a last dimension of 2, and a warning says
    so. The order is the step's tensor order, stably sorted by item size (largest first)
    so every tensor starts aligned to its item size, as the safetensors serializer itself
    arranges.
    """
    entries: list[ExportEntry] = []
    seen: dict[str, str] = {}
    for source, info in tensors.items():
        if source.startswith(MODEL_PREFIX):
            name = source[len(MODEL_PREFIX) :]
        elif source.startswith(BUFFERS_PREFIX):
            name = source[len(BUFFERS_PREFIX) :]
            if name in skip:
                continue
        else:
            continue
        if name in seen:
            raise CorruptCheckpointError(
                f"checkpoint holds both {seen[name]!r} and {source!r}: they would share the "
                f"name {name!r} in the safetensors output"
            )
        seen[name] = source
        shape = tuple(info.shape)
        logical = fmt.complex_dtype(info.attrs, info.dtype, shape, f"tensor {source!r}")
        if logical in SAFETENSORS_DTYPES:
            numel = int(info.numel) // 2
            entries.append(ExportEntry(name, source, shape[:-1], logical, numel, pairs=True))
            continue
        if logical is not None:
            warnings.warn(
                f"{source} is {logical}, which safetensors cannot hold: it is written as its "
                f"real pairs ({info.dtype}, shape {shape}); torch.view_as_complex(t) gives "
                "it back",
                stacklevel=2,
            )
            out_dtype = info.dtype
        elif dtype is not None and info.dtype.is_floating_point:
            out_dtype = dtype
        else:
            out_dtype = info.dtype
        if out_dtype not in SAFETENSORS_DTYPES:
            raise CorruptCheckpointError(f"tensor {source!r} has unsupported dtype {info.dtype}")
        entries.append(ExportEntry(name, source, shape, out_dtype, int(info.numel)))
    entries.sort(key=lambda e: -e.dtype.itemsize)
    return entries


def _engine_attrs(attrs: dict) -> dict:
    """The engine's part of a step's attrs; ``{}`` for steps not written by the engine."""
    engine = attrs.get("engine")
    return engine if isinstance(engine, dict) else {}


def non_persistent_names(attrs: dict) -> frozenset[str]:
    """Buffers the engine recorded as non-persistent (``state_dict`` leaves them out, so
    an export does too); checked, since the list comes from storage."""
    names = _engine_attrs(attrs).get("non_persistent_buffers", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CorruptCheckpointError(
            f"engine attrs: non_persistent_buffers must be a list of names, got {names!r:.200}"
        )
    return frozenset(names)


def safetensors_header(entries: list[ExportEntry]) -> bytes:
    """The header block: 8-byte little-endian length, then JSON padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def plan_shards(entries: list[ExportEntry], max_shard_size: int | None) -> list[list[ExportEntry]]:
    """Greedy packing in order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [entries]
    shards: list[list[ExportEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def consolidate(
    ckpt: Any,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    progress: ProgressFn | None = None,
    force: bool = False,
    storage_options: dict | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> ConsolidateResult:
    """Write the model weights and buffers of one step as safetensors at ``out``.

    ``ckpt`` is a checkpoint root (path or fsspec URL) or an opened checkpoint. Without
    ``max_shard_size`` ``out`` is one ``.safetensors`` file. With it, ``out`` names the
    index: ``dir/name.safetensors`` gives ``dir/name-00001-of-0000N.safetensors`` and
    ``dir/name.safetensors.index.json``; any other ``out`` is a directory that gets
    ``model-*.safetensors`` and ``model.safetensors.index.json`` (the Hugging Face layout).
    ``out`` must be local. Existing output is refused unless ``force``.

    An ``out`` ending in ``/`` (or an existing directory) is a directory that
    ``from_pretrained`` loads as is: ``model.safetensors`` (or, with ``max_shard_size``,
    shards and their index) and, for a Hugging Face model, the ``config.json`` the engine
    recorded at save time (written last).
    """
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    if piece_bytes < 1:
        raise ConfigError(f"piece_bytes must be positive, got {piece_bytes}")
    out_path = _local_path(out)
    as_directory = _names_directory(out, limit)
    if as_directory and limit is None:
        out_path = out_path / "model.safetensors"
    if sys.byteorder != "little":
        raise ConfigError("safetensors is little-endian; consolidate on a little-endian host")

    reader = _open(ckpt, storage_options)
    _refuse_inside_checkpoint(reader.url, out_path)
    st = reader.step(step)
    entries = export_entries(st.tensors, cast, non_persistent_names(st.attrs))
    shards = plan_shards(entries, limit)

    if limit is None:
        targets = [out_path]
        index_path = None
    else:
        directory, prefix = _shard_naming(out_path)
        targets = [
            directory / f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            for i in range(len(shards))
        ]
        index_path = directory / f"{prefix}.safetensors.index.json"
    model_config = _model_config(st.attrs) if as_directory else None
    config_path = out_path.parent / "config.json" if limit is None else targets[0].parent
    if model_config is not None and limit is not None:
        config_path = config_path / "config.json"
    extra = [config_path] if model_config is not None else []
    _refuse_existing([*targets, *([index_path] if index_path else []), *extra], force)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)

    total = sum(e.nbytes for e in entries)
    done = 0
    for target, shard in zip(targets, shards, strict=True):
        done = _write_file(st, target, shard, piece_bytes, progress, done, total)
    if index_path is not None:
        weight_map = {
            e.name: t.name for t, shard in zip(targets, shards, strict=True) for e in shard
        }
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_write_bytes(index_path, (json.dumps(index, indent=2) + "\n").encode())
    if progress is not None and not entries:
        progress(0, 0)
    if model_config is not None:
        # Last, like the index: from_pretrained finds a complete directory or none.
        text = json.dumps(model_config, indent=2, sort_keys=True) + "\n"
        _atomic_write_bytes(config_path, text.encode())

    tied = _engine_attrs(st.attrs).get("tied") or {}
    return ConsolidateResult(
        step=st.step,
        files=targets,
        index=index_path,
        num_tensors=len(entries),
        total_bytes=total,
        tied=dict(tied) if isinstance(tied, dict) else {},
    )


def _write_file(
    st: Any,
    target: Path,
    entries: list[ExportEntry],
    piece_bytes: int,
    progress: ProgressFn | None,
    done: int,
    total: int,
) -> int:
    partial = target.with_name(target.name + ".partial")
    infos = {e.source: st.tensors[e.source] for e in entries}
    try:
        with open(partial, "wb") as f:
            f.write(safetensors_header(entries))
            casts = {e.source: e.dtype for e in entries}
            pairs = {e.source for e in entries if e.pairs}
            for chunk in iter_chunk_payloads(st, [e.source for e in entries]):
                info = infos[chunk.name]
                out_dtype = casts[chunk.name]
                if out_dtype == info.dtype or chunk.name in pairs:
                    f.write(chunk.payload)  # the verified bytes, no copy
                    done += (chunk.stop - chunk.start) * info.dtype.itemsize
                else:
                    _write_cast(f, chunk.payload, info.dtype, out_dtype, piece_bytes)
                    done += (chunk.stop - chunk.start) * out_dtype.itemsize
                if progress is not None:
                    progress(done, total)
                del chunk  # drop it before the iterator fetches the one after next
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return done


def _write_cast(
    f: Any, payload: memoryview, src: torch.dtype, dst: torch.dtype, piece_bytes: int
) -> None:
    # Cast in pieces so the converted copy stays small next to the chunk itself.
    numel = payload.nbytes // src.itemsize
    step = max(1, piece_bytes // src.itemsize)
    with warnings.catch_warnings():
        # frombuffer warns that the bytes are read-only; they are only read here.
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(payload, dtype=src, count=numel) if numel else None
    for lo in range(0, numel, step):
        piece = source[lo : lo + step].to(dst)  # type: ignore[index]
        # A byte view, not a copy: numpy has no bfloat16, uint8 covers every dtype.
        f.write(piece.view(torch.uint8).numpy().data)


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """Elements ``[start, stop)`` of tensor ``name`` (one stored chunk), verified bytes."""

    name: str
    index: int
    start: int
    stop: int
    payload: memoryview


def iter_chunk_payloads(st: Any, names: list[str]) -> Iterator[ChunkPayload]:
    """Every stored chunk of ``names``, in order, each read once and checksum-verified.

    The store verifies whole chunks, so reading a chunk in sub-ranges would re-read it
    per sub-range; whole chunks it is. The next chunk is read on a helper thread while
    the caller consumes this one (file reads and crc32c release the GIL), so at most two
    chunks are in memory.
    """
    refs = []
    for name in names:
        layout = st.tensors[name].layout
        refs += [(name, i, *layout.chunk_range(i)) for i in range(layout.num_chunks)]
    if not refs:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zs-prefetch") as pool:
        pending: Future | None = pool.submit(st.read_chunk, refs[0][0], refs[0][1])
        try:
            for i, (name, index, start, stop) in enumerate(refs):
                payload = pending.result()  # type: ignore[union-attr]
                pending = None
                if i + 1 < len(refs):
                    pending = pool.submit(st.read_chunk, refs[i + 1][0], refs[i + 1][1])
                itemsize = st.tensors[name].dtype.itemsize
                # Trim the edge chunk's padding: zarr stores it at full chunk size.
                yield ChunkPayload(name, index, start, stop, payload[: (stop - start) * itemsize])
                del payload
        finally:
            if pending is not None:
                pending.cancel()


def _open(ckpt: Any, storage_options: dict | None) -> Any:
    if isinstance(ckpt, CheckpointSource):
        return ckpt
    return open_source(os.fspath(ckpt), storage_options=storage_options)


def _local_path(out: str | os.PathLike) -> Path:
    text = os.fspath(out)
    if "://" in text:
        raise ConfigError(
            f"output {text!r} is a URL: consolidate writes to a local path; "
            "write locally, then upload the file"
        )
    return Path(text)


def _names_directory(out: str | os.PathLike, limit: int | None) -> bool:
    """Whether ``out`` names a directory to fill (``hf/``, an existing directory, or any
    non-``.safetensors`` name when sharding) rather than one ``.safetensors`` file."""
    text = os.fspath(out)
    if text.endswith(("/", os.sep)) or Path(text).is_dir():
        return True
    return limit is not None and not text.endswith(".safetensors")


def _model_config(attrs: dict) -> dict | None:
    """The model's config the engine recorded at save (a transformers model), checked."""
    config = attrs.get("model_config")
    if config is None:
        return None
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise CorruptCheckpointError(
            f"the step's model_config must be a JSON object, got {type(config).__name__}"
        )
    return config


def _refuse_inside_checkpoint(root: str, out: Path) -> None:
    # Files written into the checkpoint root would sit among (or, with --force, replace)
    # the step files; an output beside the checkpoint is fine.
    if location_contains(root, out):
        raise ConfigError(
            f"output {str(out)!r} lies inside the checkpoint {root!r}; write it outside "
            "the checkpoint directory"
        )


def _shard_naming(out: Path) -> tuple[Path, str]:
    if out.name.endswith(".safetensors"):
        return out.parent, out.name[: -len(".safetensors")]
    return out, "model"


def _refuse_existing(paths: list[Path], force: bool) -> None:
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"output {str(path)!r} is a directory; name a file to write")
        if path.exists() and not force:
            raise ConfigError(f"output {str(path)!r} already exists; pass --force to overwrite")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    # The rename is only durable once the directory entry is; not every OS allows it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
