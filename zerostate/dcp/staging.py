"""Staging for ``dcp.async_save`` through zerostate's writer: copies into CPU buffers that are
reused from one save to the next, never while a save still reads them.

[Note: reused staging buffers]
``async_save`` blocks the training loop for as long as staging takes: a copy of the whole
state, so the next optimizer step cannot change what is being written. DCP's default stager
copies into newly allocated memory on every save, and on the host most of that time is the
kernel zeroing fresh pages on first touch, not the copy itself. Our writer keeps the buffers
of a finished save and copies the next save's state into them: the blocked time is the copy.

A set of buffers is reused only once the save that read it is known to be done with it: its
rank's ``write_data`` has returned (every byte of this rank is in storage, or the save
failed). Staging while the previous save is still writing (the caller did not wait on its
future) gets a new set, and the older one is no longer tracked: its save keeps its buffers
alive until it finishes, and they are never handed out again. A save whose release never
arrives (it failed before writing, or DCP's staging process wrote it, releasing its own
unpickled copy) is forgotten at the next staging the same way, and that one allocates. At
most one finished set and the newest staged one are kept, so the host memory held between
saves is one copy of this rank's state. ``write_data`` recognises its set by the
storage of the tensors the planner hands it, not by order, so no interleaving of saves can
free a set that a running save still reads.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import torch

from zerostate.dcp.common import check_has_data, plain_data
from zerostate.errors import ConfigError

__all__ = ["StagingBuffers"]


class _Set:
    """One staged copy: its buffers by path in the state, and their storages' addresses."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.addresses: set[int] = set()


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StagingBuffers:
    """The writer's staging memory ([Note: reused staging buffers])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: _Set | None = None
        self._busy: list[_Set] = []

    def __getstate__(self) -> dict:
        # A staging process gets none of this process's memory.
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts, lists and tuples of tensors, DTensors,
        ShardedTensors and plain values) whose tensors are CPU buffers of this stager
        (a ShardedTensor's: new memory, see :func:`_copy_sharded`)."""
        with self._lock:
            reuse, self._idle = self._idle, None
        staged_set = _Set()
        try:
            staged = self._copy(state, (), reuse, staged_set)
        except BaseException:
            with self._lock:
                self._idle = reuse
            raise
        with self._lock:
            # Only the newest staged set is tracked for reuse. An older one still being
            # written is forgotten (its save holds its buffers until done; they are never
            # handed out again), and so is one whose release never comes here (a save that
            # failed before writing, or one written by DCP's staging process): host memory
            # held between saves stays one copy.
            self._busy = [staged_set]
        return staged

    def release(self, tensors: list[torch.Tensor]) -> None:
        """The save that read ``tensors`` is done with them: their set may be reused. Only
        plain tensors can be staged buffers (a subclass without storage is none of them)."""
        seen = {_address(t) for t in tensors if t.numel() and type(t) is torch.Tensor}
        with self._lock:
            done = [s for s in self._busy if s.addresses & seen]
            if not done:
                return
            self._busy = [s for s in self._busy if not s.addresses & seen]
            self._idle = done[-1]

    def held_nbytes(self) -> int:
        """Bytes of staging memory held now (finished and in-flight sets)."""
        with self._lock:
            sets = ([self._idle] if self._idle is not None else []) + list(self._busy)
        return sum(b.numel() * b.element_size() for s in sets for b in s.buffers.values())

    def close(self) -> None:
        with self._lock:
            self._idle = None

    def _copy(self, value: Any, path: tuple, reuse: _Set | None, into: _Set) -> Any:
        if _is_sharded_tensor(value):
            return _copy_sharded(value)
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path, reuse, into)
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k), reuse, into) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, (*path, i), reuse, into) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, (*path, i), reuse, into) for i, v in enumerate(value))
        return copy.deepcopy(value)  # plain values are small; the training loop may change them

    def _copy_tensor(self, t: torch.Tensor, path: tuple, reuse: _Set | None, into: _Set):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        check_has_data(local, ".".join(map(str, path)))
        # A subclass as its values, or refused ([Note: tensor subclasses] in zerostate.dcp.common).
        local = plain_data(local.detach(), ".".join(map(str, path)))  # detached
        if local.is_sparse or local.layout != torch.strided:
            raise ConfigError(
                f"{'.'.join(map(str, path))}: a {local.layout} tensor cannot be staged"
            )
        old = reuse.buffers.get(path) if reuse is not None else None
        if old is not None and old.shape == local.shape and old.dtype == local.dtype:
            buf = old
        else:
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        buf.copy_(local)
        into.buffers[path] = buf
        if buf.numel():  # an empty tensor has no storage of its own to recognise it by
            into.addresses.add(_address(buf))
        if isinstance(t, DTensor):
            return DTensor.from_local(
                buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return buf


def _is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _copy_sharded(value: Any) -> Any:
    """A host copy of a ShardedTensor (FSDP1's sharded state dicts hold them): its local
    shards copied, its metadata and process group kept. Its tensor operations go through
    the shards only, so it cannot be copied into a buffer as a tensor is; it is copied as
    DCP's default stager copies it, into new memory on every save (torch deprecates the
    type for DTensor, whose copies reuse this stager's buffers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the type
        if value.device.type != "cpu":
            return value.to(device="cpu")
        return copy.deepcopy(value)
