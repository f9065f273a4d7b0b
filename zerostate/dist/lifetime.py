"""Process groups at interpreter exit: nothing that zerostate or an import-time default holds
keeps a destroyed group into finalisation ([Note: no group kept to exit])."""

from __future__ import annotations

import atexit
import gc
import types
import weakref
from typing import Any

from zerostate.dist import collectives

#: The process groups zerostate ran collectives on, weakly: at exit
#: :func:`_release_destroyed_group_pins` looks for pins only if one is destroyed but alive.
_GROUPS_USED: weakref.WeakSet = weakref.WeakSet()


def track_group(group: Any = None) -> None:
    """Remember ``group`` and the default group as groups zerostate used, for the exit hook
    ([Note: no group kept to exit]); weakly, so this keeps nothing alive."""
    for pg in (group, collectives.default_group()):
        if pg is not None:
            _GROUPS_USED.add(pg)


def release_pins_and_track(group: Any = None) -> None:
    """For a new engine over ``group``: torch's import-time pin of the default group goes
    ([Note: pinned default group] in zerostate.dist.collectives), and ``group`` is tracked."""
    collectives.release_import_time_group_pins()
    track_group(group)


def _release_destroyed_group_pins() -> int:
    """At interpreter exit: function defaults that still hold a destroyed process group are
    set to ``None``, so the group is freed now; how many functions were changed.

    [Note: no group kept to exit]
    A gloo group's worker thread drops each finished collective, and a collective whose
    tensors Python has already let go (an async broadcast, a barrier holding the works
    queued before it) frees them on that thread, which needs the GIL. When the group is
    still alive as the interpreter finalises, a worker that asks for the GIL then is ended
    by Python and the process aborts ("terminate called without an active exception").
    It was seen at the end of runs that had called ``destroy_process_group()``: 4
    times in about 95 runs of examples/hf_trainer.py at stage 3 on a loaded machine. A
    core file showed the worker in ``~AsyncBarrierWork`` -> ``~AsyncBroadcastWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` while the main
    thread was in ``Py_FinalizeEx``'s collection. A group freed before finalisation joins
    its workers with the GIL released, and they finish.

    So nothing of zerostate keeps a destroyed group to finalisation. The shared-memory
    transports hold theirs by weak reference. The memory tiers that ``zerostate.save``
    and ``zerostate.load`` keep per group are dropped once their group is destroyed, at
    the next call and at exit (``zerostate.api._drop_destroyed_tiers``).

    Other modules can keep it: DeepSpeed's ``TorchBackend.barrier`` declares
    ``group=GroupMember.WORLD``, bound when DeepSpeed is imported (the HF Trainer imports
    it after the group exists), as [Note: pinned default group] in
    zerostate.dist.collectives describes for torch's own module. ``atexit`` runs before
    finalisation. So this hook, when a group zerostate used (an engine's and the default
    group, or that of ``zerostate.save`` and ``load``: :func:`track_group`) is destroyed
    and still alive, rebinds such defaults to ``None`` (the default group, which is what
    they name), and the group is freed. A destroyed group cannot serve a collective, so
    nothing loses a working default. A group still held another way (a closure, an
    object's attribute) stays as it was.
    """
    destroyed = collectives.is_destroyed_group
    if not any(map(destroyed, list(_GROUPS_USED))):
        return 0  # nothing held: the usual case, and no walk over the heap
    functions = (obj for obj in gc.get_objects() if type(obj) is types.FunctionType)
    return sum(collectives.unpin_defaults(fn, destroyed) for fn in functions)


atexit.register(_release_destroyed_group_pins)
