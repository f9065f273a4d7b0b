"""zerostate: ZeRO training for PyTorch around a sharded state store."""

from zerostate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CollectiveTimeoutError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    DistributedMismatchError,
    FormatVersionError,
    GradientAccessError,
    PretrainedMismatchError,
    StorageError,
    UnsafeNameError,
    ZerostateError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CollectiveTimeoutError",
    "CommitTimeoutError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedMismatchError",
    "FormatVersionError",
    "GradientAccessError",
    "PretrainedMismatchError",
    "StorageError",
    "UnsafeNameError",
    "ZerostateError",
    "__version__",
    "check_storage",
    "load",
    "save",
]


def __getattr__(name: str):
    # The engine pulls in torch.distributed machinery; import it on first use so the
    # store and the CLI stay light.
    if name in ("Engine", "EngineConfig"):
        from zerostate import engine

        return getattr(engine, name)
    if name == "SaveHandle":
        from zerostate.checkpoint import SaveHandle

        return SaveHandle
    if name in ("save", "load"):  # torch.distributed.checkpoint, imported on first use
        from zerostate import api

        return getattr(api, name)
    if name == "check_storage":
        from zerostate.store.options import check_storage

        return check_storage
    raise AttributeError(f"module 'zerostate' has no attribute {name!r}")
