"""Export the trainable tensors of a step alone: a fine-tuning run's adapters.

The engine records which parameters were frozen (``attrs["engine"]["frozen"]``); the
export holds every other ``model/`` tensor (no buffers, no optimizer state). For a peft
model the engine also recorded its adapter configuration at save (``attrs["peft"]``, see
``zerostate.checkpoint.frozen.adapter_attrs``), and the export is then a directory that
``peft.PeftModel.from_pretrained(base, OUT)`` loads: ``adapter_model.safetensors`` with
peft's key names (the adapter name left out, as ``get_peft_model_state_dict`` writes them)
and ``adapter_config.json``. Streaming and atomic, as ``consolidate`` is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerostate.errors import ConfigError, CorruptCheckpointError
from zerostate.store import format as fmt
from zerostate.store.consolidate import (
    DEFAULT_PIECE_BYTES,
    MODEL_PREFIX,
    _atomic_write_bytes,
    _engine_attrs,
    _local_path,
    _open,
    _refuse_existing,
    _refuse_inside_checkpoint,
    _write_file,
    export_entries,
    parse_dtype,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True)
class TrainableExport:
    """What :func:`export_trainable` wrote."""

    step: int
    weights: Path
    config: Path | None  # adapter_config.json, for a peft model
    num_tensors: int
    total_bytes: int


def trainable_names(st: Any) -> list[str]:
    """``model/`` tensors of a step that were not frozen when it was saved."""
    frozen = _engine_attrs(st.attrs).get("frozen", [])
    if not isinstance(frozen, list) or not all(isinstance(n, str) for n in frozen):
        raise CorruptCheckpointError(
            f"engine attrs: frozen must be a list of names, got {frozen!r:.200}"
        )
    skip = {MODEL_PREFIX + n for n in frozen}
    return [n for n in st.tensors if n.startswith(MODEL_PREFIX) and n not in skip]


def peft_record(attrs: dict) -> tuple[str, dict] | None:
    """``(adapter name, adapter config)`` recorded at save, checked; None if none."""
    record = attrs.get("peft")
    if record is None:
        return None
    name = record.get("adapter_name") if isinstance(record, dict) else None
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict) or not isinstance(name, str):
        raise CorruptCheckpointError(
            f"attrs: peft must hold adapter_name and config, got {record!r:.200}"
        )
    fmt.validate_name(name, what="adapter name")
    return name, config


def peft_key(name: str, adapter: str) -> str:
    """peft's saved key of a parameter name: the ``.<adapter>`` component left out."""
    return ".".join(part for part in name.split(".") if part != adapter)


def export_trainable(
    ckpt: Any,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    storage_options: dict | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> TrainableExport:
    """Write the trainable tensors of one step: for a peft model a directory ``out`` that
    ``PeftModel.from_pretrained`` loads, otherwise one safetensors file ``out``."""
    cast = parse_dtype(dtype)
    out_path = _local_path(out)
    reader = _open(ckpt, storage_options)
    _refuse_inside_checkpoint(reader.url, out_path)
    st = reader.step(step)
    names = trainable_names(st)
    if not names:
        raise ConfigError(
            f"step {st.step} of {reader.url} has no trainable tensors recorded (nothing was "
            "frozen, or it was not written by the engine); export the whole model instead"
        )
    entries = export_entries({n: st.tensors[n] for n in names}, cast)
    peft = peft_record(st.attrs)
    config_path = None
    if peft is not None:
        adapter, config = peft
        entries = [dataclasses.replace(e, name=peft_key(e.name, adapter)) for e in entries]
        if len({e.name for e in entries}) != len(entries):
            raise CorruptCheckpointError("two trainable tensors map to one peft key")
        weights, config_path = out_path / ADAPTER_WEIGHTS, out_path / ADAPTER_CONFIG
        _refuse_existing([weights, config_path], force)
        out_path.mkdir(parents=True, exist_ok=True)
    else:
        weights = out_path
        _refuse_existing([weights], force)
        weights.parent.mkdir(parents=True, exist_ok=True)
    total = sum(e.nbytes for e in entries)
    _write_file(st, weights, entries, piece_bytes, None, 0, total)
    if config_path is not None:
        _atomic_write_bytes(config_path, (json.dumps(peft[1], indent=2) + "\n").encode())
    return TrainableExport(st.step, weights, config_path, len(entries), total)
