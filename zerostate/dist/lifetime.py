"""How long process groups live in a process that used zerostate: nothing zerostate or an
import-time default holds keeps a destroyed group into interpreter finalisation
([Note: pinned default group], [Note: no group kept to exit])."""

from __future__ import annotations

import atexit
import gc
import types
import weakref
from typing import Any

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_registered(pg: Any) -> bool:
    """Whether ``pg`` is a live process group of torch.distributed (not destroyed)."""
    try:
        return pg in dist.distributed_c10d._world.pg_map
    except (AttributeError, TypeError):
        return True


def release_import_time_group_pins() -> None:
    """Stop ``torch.distributed.nn.functional`` from holding the default process group.

    [Note: pinned default group]
    That module's collectives declare ``group=group.WORLD``: a default evaluated once, at
    import. Imported before ``init_process_group`` the default is ``None`` (the default
    group, looked up per call); imported after it, the functions hold the live default
    group for the rest of the process. torch imports the module lazily on the first
    optimizer construction (``Optimizer.add_param_group`` imports ``torch._dynamo``, which
    reaches it through FSDP and sharded-tensor modules), and the engine builds its
    optimizer after the group exists, so every training process pinned its default group.
    ``dist.destroy_process_group()`` then only unregisters the group: a gloo group keeps
    its worker threads until the interpreter exits, and a worker still releasing a
    finished collective while the interpreter finalises needs the GIL, is ended by
    Python's thread exit, and aborts the process ("terminate called without an active
    exception"). Rebinding those defaults to ``None`` keeps their meaning (``None`` is
    the default group) and lets the group be destroyed when it is destroyed.
    """
    if not dist.is_available():
        return
    track_group()
    import torch.distributed.nn.functional as functional  # loaded now, so nothing binds later

    for fn in vars(functional).values():
        if getattr(fn, "__module__", None) != functional.__name__ or not callable(fn):
            continue
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )
        kwdefaults = getattr(fn, "__kwdefaults__", None)
        if kwdefaults:
            for key, value in kwdefaults.items():
                if isinstance(value, dist.ProcessGroup):
                    kwdefaults[key] = None


#: The process groups zerostate ran collectives on, weakly: at exit
#: :func:`_release_destroyed_group_pins` looks for pins only if one is destroyed but alive.
_GROUPS_USED: weakref.WeakSet = weakref.WeakSet()


def track_group(group: Any = None) -> None:
    """Remember ``group`` (None: the default group) as one zerostate used, for the exit hook
    ([Note: no group kept to exit]); weakly, so this keeps nothing alive."""
    if is_initialized():
        _GROUPS_USED.add(dist.group.WORLD if group is None else group)


def _release_destroyed_group_pins() -> int:
    """At interpreter exit: function defaults that still hold a destroyed process group are
    set to ``None``, so the group is freed now; how many functions were changed.

    [Note: no group kept to exit]
    A gloo group's worker thread drops each finished collective, and a collective whose
    tensors Python has already let go (an async broadcast, a barrier holding the works
    queued before it) frees them on that thread, which needs the GIL. When the group is
    still alive as the interpreter finalises, a worker that asks for the GIL then is ended
    by Python and the process aborts ("terminate called without an active exception").
    It was seen at the end of runs that had called ``dist.destroy_process_group()``: 4
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
    it after the group exists), as [Note: pinned default group] describes for torch's own
    module. ``atexit`` runs before finalisation. So this hook, when a group zerostate used
    (the engine's, ``zerostate.save``'s, the DCP writer's and reader's: :func:`track_group`)
    is destroyed and still alive, rebinds such defaults to ``None`` (the default group,
    which is what they name), and the group is freed. A destroyed group cannot serve a
    collective, so nothing loses a working default. A group still held another way (a
    closure, an object's attribute) stays as it was.
    """
    if not dist.is_available() or not any(map(is_destroyed_group, list(_GROUPS_USED))):
        return 0  # nothing held: the usual case, and no walk over the heap
    released = 0
    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType:
            continue
        defaults, kwdefaults = obj.__defaults__, obj.__kwdefaults__
        if defaults and any(is_destroyed_group(d) for d in defaults):
            obj.__defaults__ = tuple(None if is_destroyed_group(d) else d for d in defaults)
            released += 1
        if kwdefaults and any(is_destroyed_group(d) for d in kwdefaults.values()):
            for key, value in list(kwdefaults.items()):
                if is_destroyed_group(value):
                    kwdefaults[key] = None
            released += 1
    return released


def is_destroyed_group(value: Any) -> bool:
    """Whether ``value`` is a process group that was destroyed (and is still alive)."""
    return isinstance(value, dist.ProcessGroup) and not is_registered(value)


atexit.register(_release_destroyed_group_pins)
