"""``zerostate.save`` / ``zerostate.load``: any trainer's state into the store. A save runs
through the store's save session, as ``engine.save`` does, planned by torch's own
``DefaultSavePlanner`` ([Note: zerostate.save through the session] in zerostate.dcp.source);
a load is ``dcp.load`` through zerostate's storage reader (``zerostate.dcp``).

The state follows DCP's contract: a dict of tensors, DTensors, nested dicts and objects with
``state_dict`` / ``load_state_dict`` (schedulers, samplers). Two kinds of object are
translated first, so that what is stored does not depend on how the job was wrapped or how
many ranks it ran on:

- a ``torch.nn.Module`` (plain, DDP, FSDP2, compiled) is saved with torch's
  ``get_model_state_dict``: parameter names without wrapper prefixes, DTensors as their
  global tensors' boxes;
- a ``torch.optim.Optimizer`` is saved with ``get_optimizer_state_dict`` against the module
  of the same state that holds its parameters: its state is keyed by parameter names, not
  by positions, so it loads into any world size and any wrapping of the same model.

Tensors that every rank holds alike (a DDP model, its optimizer state) are written once:
DCP's planner keeps one copy of each and spreads them over the ranks.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from zerostate.checkpoint.async_save import BackgroundSaves
from zerostate.checkpoint.roots import EngineRoots
from zerostate.checkpoint.save import SaveSession, commit_timeout_s
from zerostate.checkpoint.tier_load import load as load_tiers
from zerostate.checkpoint.tiers import TIERS, MemoryTiers
from zerostate.dcp import StorageReader
from zerostate.dcp.common import _check_step, _root_text
from zerostate.dcp.source import DcpSource
from zerostate.dcp.staging import StagingBuffers
from zerostate.dist import collectives, lifetime
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError, ConfigError, ZerostateError

__all__ = ["load", "save"]

#: The staging memory of every non-blocking save of this process: the copy of the last
#: save is reused by the next once that save is done with it ([Note: reused staging
#: buffers] in zerostate.dcp.staging).
_STAGING = StagingBuffers()
#: The roots ``zerostate.save`` and ``zerostate.load`` used in this process, each opened once
#: ([Note: one root per location] in zerostate.checkpoint.roots): the save guard remembers
#: which roots this process saved to or loaded from.
_ROOTS = EngineRoots()
#: The non-blocking save in flight (at most one), written on one background thread.
_SAVES = BackgroundSaves(_STAGING)
#: The memory tier of each process group ``zerostate.save`` saved over with ``tier="memory"``.
_TIERS: dict[Any, MemoryTiers] = {}


class _ModuleState(Stateful):
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict)


class _OptimizerState(Stateful):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


def _translated(state: Any) -> dict[str, Any]:
    """``state`` with modules and optimizers wrapped as described in the module docstring."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConfigError(
            "the state must be a dict with string keys (DCP's contract), e.g. "
            "{'model': model, 'optim': optimizer, 'sched': scheduler}"
        )
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = _ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            params = {id(p) for group in value.param_groups for p in group["params"]}
            owners = [m for m in modules.values() if params <= {id(p) for p in m.parameters()}]
            if len(owners) != 1:
                found = "no module" if not owners else f"{len(owners)} modules"
                raise ConfigError(
                    f"optimizer {key!r}: {found} of the state hold all its parameters; put "
                    "the model it trains in the same state (its state is stored under the "
                    "model's parameter names, so that it loads at any world size)"
                )
            out[key] = _OptimizerState(owners[0], value)
        else:
            out[key] = value
    return out


def _unwrapped(exc: CheckpointException, where: str) -> BaseException:
    """One line for DCP's per-rank exception: the first zerostate error inside it; else the
    planner's own complaint (a key the step lacks, a shape that differs, each named) as a
    :class:`ConfigError` led by ``where``; else DCP's exception itself."""
    inner_errors = []
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ZerostateError):
            return inner
        inner_errors.append(inner)
    for inner in inner_errors:
        if isinstance(inner, (ValueError, RuntimeError, KeyError)):
            text = str(inner).strip().splitlines()[0] if str(inner).strip() else repr(inner)
            return ConfigError(f"{where}: {text}")
    return exc


def save(
    state: dict[str, Any],
    root: str | os.PathLike,
    step: int | None = None,
    *,
    blocking: bool = True,
    keep_last: int | None = None,
    storage_options: dict | None = None,
    process_group: Any = None,
    allow_older_step: bool = False,
    tier: str = "durable",
    memory_durable_every: int | None = 10,
) -> Any:
    """Save ``state`` as a step of the checkpoint root ``root`` (a path or fsspec URL);
    collective: every rank of ``process_group`` (None: the default group, or one process
    without torch.distributed) calls it. ``step`` None takes the step after the newest
    committed one. Returns the step written, or with ``blocking=False`` a
    :class:`~zerostate.checkpoint.SaveHandle` (``step``, ``path``, ``blocked_s``,
    ``wait()``, ``done()``) once the state is copied into host memory kept for the next
    non-blocking save: training may go on, and ``wait()`` returns once the step is committed
    (one save is in flight at a time; the next waits for it). ``keep_last`` keeps only the
    newest that many committed steps.

    The save runs through the store's save session, as ``engine.save`` does ([Note:
    zerostate.save through the session] in zerostate.dcp.source): a rank that fails fails
    every rank with one error, and an explicit ``step`` older than the root's newest
    committed one is refused (another run's root) unless this process saved to or loaded
    from that root, or ``allow_older_step=True``.

    ``tier="memory"`` writes the step into this node's memory directory with a replica on
    another node instead ([Note: memory tier] in zerostate.checkpoint.tiers; the directory
    is ``$ZEROSTATE_MEMORY_DIR``, else ``/dev/shm/zerostate``), and copies every
    ``memory_durable_every``-th memory save of ``root`` to ``root`` in the background (None:
    never). A blocking memory save returns once that copy (when it makes one) is committed
    too; a non-blocking one's handle is done once the step is committed in memory."""
    if tier not in TIERS:
        raise ConfigError(f"tier must be one of {TIERS}, got {tier!r}")
    started = time.perf_counter()
    translated = _translated(state)
    where = _root_text(root)
    coordinator = _coordinator(process_group, " and nothing was committed")
    rank, world_size = coordinator.rank, coordinator.world_size
    source = DcpSource(
        translated,
        root=where,
        step=_check_step(step),
        rank=rank,
        world_size=world_size,
        staging=_STAGING,
    )
    memory, persisting = None, None
    if tier == "memory":  # [Note: memory tier] in zerostate.checkpoint.tiers
        tiers = _memory_tiers(process_group, coordinator)
        tiers.durable_every = memory_durable_every
        memory = tiers.saving(_ROOTS.open(where, storage_options))
    else:  # an earlier memory save's copy to a root may still be under way
        earlier = _TIERS.get(_tiers_key(process_group))
        persisting = earlier.wait if earlier is not None else None
    session = SaveSession(
        source,
        where,
        coordinator=coordinator,
        roots=_ROOTS,
        saves=_SAVES,
        timeout_s=commit_timeout_s(),
        blocking=blocking,
        keep_last=keep_last,
        storage_options=storage_options,
        progress=None,
        allow_older_step=allow_older_step,
        tier=memory,
        persisting=persisting,
    )
    handle = session.run(started)
    if not blocking:
        return handle
    handle.wait()  # a blocking memory save's copy to the root, when it made one
    return handle.step


def _coordinator(process_group: Any, note: str) -> Coordinator:
    """The control collectives of a save or load over ``process_group`` (one process without
    torch.distributed: a group of one); a rank that did not fail raises ``note`` after the
    rank that did ([Note: failing together] in zerostate.checkpoint)."""
    rank, world_size = (
        collectives.group_info(process_group) if collectives.is_initialized() else (0, 1)
    )
    lifetime.track_group(process_group)
    return Coordinator(
        group=process_group,
        rank=rank,
        world_size=world_size,
        device=collectives.control_device(process_group),
        arrival_timeout_s=collectives.DEFAULT_TIMEOUT_S,
    ).with_errors(CheckpointError, note)


def _tiers_key(process_group: Any) -> Any:
    return process_group if process_group is not None else collectives.default_group()


def _memory_tiers(process_group: Any, coordinator: Coordinator) -> MemoryTiers:
    """The memory tier of ``zerostate.save``'s saves over ``process_group`` (one per group:
    it keeps the group's nodes, its save counts and its background copy to the root)."""
    key = _tiers_key(process_group)
    _drop_destroyed_tiers()
    tiers = _TIERS.get(key)
    if tiers is None:
        tiers = MemoryTiers(
            coordinator, directory=None, keep_last=2, durable_every=10, timeout_s=commit_timeout_s()
        )
        _TIERS[key] = tiers
    return tiers


def _drop_destroyed_tiers() -> None:
    """The memory tiers of destroyed groups go, and with them their hold on the groups: at
    the next save or load, and at exit, before the interpreter finalises ([Note: no group
    kept to exit] in zerostate.dist.lifetime). By then nothing of theirs is in flight:
    their persistence threads were joined when the interpreter began to exit."""
    for key in [k for k in _TIERS if collectives.is_destroyed_group(k)]:
        del _TIERS[key]


atexit.register(_drop_destroyed_tiers)


def load(
    state: dict[str, Any],
    root: str | os.PathLike,
    step: int | None = None,
    *,
    storage_options: dict | None = None,
    process_group: Any = None,
) -> int:
    """Load a step of ``root`` into ``state`` (in place: tensors are filled, objects get
    ``load_state_dict``), at any world size; collective. ``step`` None loads the newest
    committed step. Returns the step loaded.

    As ``engine.load`` does, the step comes from the nearest tier that holds it whole: this
    node's memory tier, the replicas on the other nodes (a replaced machine's ranks), else
    ``root`` itself ([Note: memory tier] in zerostate.checkpoint.tiers); rank 0 logs which
    served it. A memory copy that fails its checks is not trusted: the load falls back to
    ``root`` (every tensor of the state is then read again from there)."""
    translated = _translated(state)
    where = _root_text(root)
    coordinator = _coordinator(process_group, ", and nothing was loaded")
    tiers = _memory_tiers(process_group, coordinator)
    durable = _ROOTS.open(where, storage_options)

    def run(memory: Any, at: int | None) -> int:  # memory: the memory tier's storage
        if memory is None:
            return _load_step(translated, where, at, storage_options, coordinator)
        return _load_step(translated, tiers.tier(durable.location).path, at, None, coordinator)

    loaded = load_tiers(tiers, durable, _check_step(step), run, _SAVES.wait)
    # dcp.load sets a value it cannot fill in place (an int, a string, a list) in the dict
    # it was given, which is the translated copy: put those into the caller's dict too, as
    # dcp.load would have (a resumed loop's step counter came back unchanged before).
    for key, value in translated.items():
        if value is not state[key] and not isinstance(value, (_ModuleState, _OptimizerState)):
            state[key] = value
    _ROOTS.memory(where).own = True  # resuming this run ([Note: save target])
    return loaded


def _load_step(
    state: dict[str, Any],
    root: str,
    step: int | None,
    storage_options: dict | None,
    coordinator: Coordinator,
) -> int:
    """``dcp.load`` of one step of ``root`` through zerostate's reader; the step loaded."""
    reader = StorageReader(root, step, storage_options=storage_options)
    error = None
    try:  # a step that is absent, hostile or not DCP's: its own error here
        reader.read_metadata()
    except Exception as exc:
        error = exc
    # Each node reads its own memory copy: every rank must know whether all opened theirs
    # before any enters DCP's collectives ([Note: failing together] in zerostate.checkpoint).
    which = "the newest step" if step is None else f"step {step}"
    coordinator.agree(error, f"opening {which} of {root}")
    reader.requested_step = reader.step  # DCP reads the metadata again: the same step
    try:
        dcp.load(state, storage_reader=reader, process_group=coordinator.group)
    except CheckpointException as exc:
        raise _unwrapped(
            exc, f"step {reader.step} of {reader.root} does not match the state"
        ) from exc
    finally:
        reader.close()
    if reader.step is None:
        raise ZerostateError("internal: the load opened no step")
    return reader.step
