"""The sharded state store (format v1): every rank writes its own chunks, any number of
ranks read them back. ``docs/format.md`` specifies the on-storage format."""

from zerostate.store.format import FORMAT_VERSION, ChunkRecord, TensorInfo
from zerostate.store.reader import (
    CheckpointReader,
    ChunkRef,
    StepReader,
    delete_step,
    open_checkpoint,
    prune_steps,
    remove_partial_steps,
)
from zerostate.store.storage import FsspecStorage, LocalStorage, Storage, open_storage
from zerostate.store.tensors import owned_shards, plan_specs, save_tensors
from zerostate.store.writer import StepExistsError, StepWriter, TensorSpec

__all__ = [
    "FORMAT_VERSION",
    "CheckpointReader",
    "ChunkRecord",
    "ChunkRef",
    "FsspecStorage",
    "LocalStorage",
    "StepExistsError",
    "StepReader",
    "StepWriter",
    "Storage",
    "TensorInfo",
    "TensorSpec",
    "delete_step",
    "open_checkpoint",
    "open_storage",
    "owned_shards",
    "plan_specs",
    "prune_steps",
    "remove_partial_steps",
    "save_tensors",
]
