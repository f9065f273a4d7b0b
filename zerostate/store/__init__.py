"""The sharded state store: every rank writes one row object per state group (format 2;
format 1 checkpoints are still read), any number of ranks read them back.
``docs/format.md`` specifies the on-storage format.

[Note: the store is the ground floor]
The store reads, writes, inspects, verifies, consolidates and reshards checkpoints without
the training code: the CLI on a host without a GPU, or another trainer saving through the
store, neither pays for nor depends on the engine, its runtime, its optimizers or its
checkpoint sessions. So no module here imports them; what the store must know of the
engine's state document (its schema and versions) lives in ``zerostate.store.state_doc``,
and the training side imports it from there. ``tests/store/test_store_imports.py`` checks
it in a fresh interpreter.
"""

from zerostate.store.format import FORMAT_VERSION, ChunkedTensorInfo, ChunkRecord, TensorInfo
from zerostate.store.format2 import RowTensorInfo
from zerostate.store.reader import ChunkRef, StepReader
from zerostate.store.reader_v2 import StepReaderV2
from zerostate.store.root import (
    CheckpointRoot,
    SaveCheck,
    delete_step,
    open_checkpoint,
    prune_steps,
    remove_partial_steps,
)
from zerostate.store.rows import LazyShard
from zerostate.store.step_base import StepBase
from zerostate.store.storage import FsspecStorage, LocalStorage, Storage, open_storage
from zerostate.store.tensors import owned_shards, plan_specs, save_tensors
from zerostate.store.writer import StepExistsError, StepWriter, TensorSpec

#: The former name of :class:`CheckpointRoot`, which grew from a reader into the root's owner.
CheckpointReader = CheckpointRoot

__all__ = [
    "FORMAT_VERSION",
    "CheckpointReader",
    "CheckpointRoot",
    "ChunkRecord",
    "ChunkRef",
    "ChunkedTensorInfo",
    "FsspecStorage",
    "LazyShard",
    "LocalStorage",
    "RowTensorInfo",
    "SaveCheck",
    "StepBase",
    "StepExistsError",
    "StepReader",
    "StepReaderV2",
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
