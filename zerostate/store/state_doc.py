"""The engine-state document a step carries (``attrs["engine"]``): its schema versions and
the check a load makes first.

The engine writes the document (``Engine.engine_state``); the readers of peers'
checkpoints build one for a DeepSpeed or DCP step
(:func:`zerostate.store.foreign.base.foreign_engine_state`); ``consolidate``, ``reshard``
and the CLI read its fields; a load checks it before anything else ([Note: planned load] in
``zerostate.checkpoint.load_plan``). The versions live here, in the store, so that none of those
readers imports training code to know them ([Note: the store is the ground floor] in
``zerostate.store``).

Version 2 holds ``version``, ``step``, ``loss_scaler``, ``stage``, ``precision``,
``world_size``, ``config``, ``tied`` (``{alias: canonical}``), ``frozen``,
``non_persistent_buffers`` and ``optimizer``, a document of its own with its own version
(``version``, ``classes``, ``group_params``, ``param_groups``, ``state``). A peer's
document has no ``loss_scaler`` or ``config`` and adds ``source``. Version 1 had no
``optimizer`` (the built-in AdamW only).
"""

from __future__ import annotations

from typing import Any

from zerostate.errors import CorruptCheckpointError, FormatVersionError

#: Version of the engine-state document a save writes.
ENGINE_STATE_VERSION = 2
#: Engine states of version 1 (built-in AdamW only, no optimizer metadata) still load.
READABLE_ENGINE_STATES = (1, 2)
#: Version of the optimizer document inside an engine state (``state["optimizer"]``).
OPTIMIZER_STATE_VERSION = 1


def check_document(state: Any) -> None:
    """The document's version first, then its step count. Refusals are
    :class:`~zerostate.errors.CheckpointError` s, as every refused load's are, so
    ``except CheckpointError`` catches each."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"engine state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if version not in READABLE_ENGINE_STATES:
        raise FormatVersionError(
            f"engine state version {version!r} is not one of {READABLE_ENGINE_STATES}; "
            "it was written by an incompatible zerostate"
        )
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"engine state step={step!r} must be an integer >= 0")
