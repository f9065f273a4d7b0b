"""Open a checkpoint of any readable format: zerostate's own, DeepSpeed ZeRO, or DCP.

The format is chosen by what the location holds, never by its name: a DCP ``.metadata``,
a DeepSpeed ``latest`` file, ``global_step*`` tag or ``*_optim_states.pt`` files, else a
zerostate root. Every command and ``engine.load`` open checkpoints through here.
"""

from __future__ import annotations

from zerostate.errors import ConfigError
from zerostate.store.foreign.detect import detect
from zerostate.store.protocol import CheckpointSource
from zerostate.store.root import CheckpointRoot
from zerostate.store.storage import open_storage


def open_source(
    root: str | CheckpointRoot, storage_options: dict | None = None, *, num_threads: int = 8
) -> CheckpointSource:
    """The checkpoint at ``root`` (path or fsspec URL), whatever its format. A peer's
    reader is imported only when the location is that peer's. An open
    :class:`CheckpointRoot` (an engine's, kept across its saves and loads) is read through
    its own storage, and is itself the answer when it holds zerostate steps."""
    opened = root if isinstance(root, CheckpointRoot) else None
    if opened is not None and storage_options:
        raise ConfigError("storage_options were given with an already open root")
    storage = opened.storage if opened is not None else open_storage(root, storage_options)
    try:
        kind = detect(storage)  # one listing of the root
        if kind == "dcp":
            from zerostate.store.foreign.dcp import DcpCheckpoint

            return DcpCheckpoint(storage, num_threads)
        if kind == "deepspeed":
            from zerostate.store.foreign.deepspeed import DeepSpeedCheckpoint

            return DeepSpeedCheckpoint(storage, num_threads)
    except FileNotFoundError:
        pass  # a missing root: the zerostate reader names the cause
    return opened if opened is not None else CheckpointRoot(storage, num_threads)
