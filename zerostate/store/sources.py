"""Open a checkpoint of any readable format: zerostate's own, DeepSpeed ZeRO, or DCP.

The format is chosen by what the location holds, never by its name: a DCP ``.metadata``,
a DeepSpeed ``latest`` file, ``global_step*`` tag or ``*_optim_states.pt`` files, else a
zerostate root. Every command and ``engine.load`` open checkpoints through here. A zerostate
root's steps written through ``zerostate.dcp`` are read as global tensors ([Note: DCP steps
as global tensors] in zerostate.store.dcp_steps).
"""

from __future__ import annotations

from typing import Any

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
    its own storage and its save memory; a zerostate root is a :class:`SourceRoot`."""
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
    if opened is not None:
        return SourceRoot(opened.storage, opened.num_threads, opened.memory)
    return SourceRoot(storage, num_threads)


class SourceRoot(CheckpointRoot):
    """A zerostate root as the commands and loads read it: a step written through
    ``zerostate.dcp`` opens as its global tensors (:class:`~zerostate.store.dcp_steps.
    DcpStoreStep`), every other step as :meth:`CheckpointRoot.step` opens it."""

    def step(self, step: int | None = None) -> Any:
        st = super().step(step)
        attrs = st.attrs if isinstance(st.attrs, dict) else {}
        if "dcp" not in attrs or "engine" in attrs:
            return st
        # Imported only for such a step: it brings torch's checkpoint metadata types.
        from zerostate.store.dcp_steps import DcpStoreStep, is_dcp_step

        if not is_dcp_step(st):
            return st
        try:
            return DcpStoreStep(st, self.num_threads)
        except BaseException:
            st.close()
            raise
