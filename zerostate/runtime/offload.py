"""ZeRO-Offload: the host tier of a parameter group's state.

[Note: offload]
With ``offload="optimizer"`` every fp32 master a rank holds (the owned range of each
parameter) and every optimizer state tensor built over it live in host memory, pinned
when an accelerator exists. Per optimizer step:

1. Gradients are reduced on the device as without offload. On the accumulation boundary,
   as soon as a group's reduce is complete ([Note: completion hooks] in zerostate.comm)
   its gradient shards are copied device -> host, into one flat host buffer ``host_grads``
   of the rank's trainable master elements, while backward goes on with later groups: on
   an accelerator the copies run on a side stream (``torch.Stream``) after the reduce, one
   ``torch.Event`` per group; on a CPU-only run they are plain copies in the hook.
2. ``step()`` waits for those events (a group whose hook did not run is copied then), and
   scales the host shards, reduces their global norm and clips them on the host with the
   same operations, in the same order, as the device path does without offload (so clipping
   and fp16 overflow checks agree across ranks, and with the device path, as before).
3. The optimizer steps the host masters, with ``offload_threads`` torch threads.
4. The updated masters go host -> device: at stages 1-2 into the owned slice of each working
   parameter, from which the usual all-gather refresh rebuilds the full parameters; at
   stage 3 into the parameter shard (``offload="params"``: the shard is on the host too and
   goes to the device inside its group's all-gather).

Every copy goes through the same lines whatever the device (on a CPU-only run host and
device are both ``cpu`` and the copies are plain copies). Pinning needs an accelerator
(``torch.accelerator``); without one host buffers are ordinary memory, said once in the log.

Frozen parameters keep working storage only; a frozen parameter's separate fp32 master
(16-bit working dtype) moves to the host as well, so no master is on the device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from zerostate.runtime.sharded import ShardedParam

log = logging.getLogger(__name__)
HOST = torch.device("cpu")
_warned_unpinned = False


def can_pin() -> bool:
    """Whether host memory can be pinned here (an accelerator exists); logs once if not."""
    global _warned_unpinned
    if torch.accelerator.current_accelerator() is not None:
        return True
    if not _warned_unpinned:
        _warned_unpinned = True
        log.info("zerostate offload: no accelerator, so host buffers are not pinned")
    return False


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, pinned where that is possible."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=can_pin())


def to_host(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = host_empty(t.numel(), dtype)
    out.copy_(t.reshape(-1))
    return out


def copy_stream(device: torch.device) -> torch.Stream | None:
    """A side stream for device -> host copies; None on the CPU (the copies are plain)."""
    return torch.Stream(device=device) if device.type != "cpu" else None


def wait_copies(device: torch.device) -> None:
    """Wait for non-blocking device <-> host copies issued so far on ``device``."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class HostTier:
    """The host side of one engine's offloaded state: masters moved at construction and
    the gradient staging buffer of the optimizer step; see [Note: offload]."""

    def __init__(
        self,
        params: list[ShardedParam],
        trainable: list[ShardedParam],
        *,
        device: torch.device,
        params_too: bool,
        threads: int | None,
    ) -> None:
        self.device = device
        self.params_too = params_too
        self.threads = threads
        self.trainable = trainable
        for sp in params:
            self._place(sp)
        numel = sum(sp.master.numel() for sp in trainable)
        #: Named staging buffer: this step's fp32 gradient shards, on the host.
        self.host_grads = host_empty(numel, torch.float32)
        self._views: list[torch.Tensor] = []
        offset = 0
        for sp in trainable:
            n = sp.master.numel()
            self._views.append(self.host_grads[offset : offset + n].view_as(sp.master))
            offset += n
        self._stream = copy_stream(device)
        self._events: list[torch.Event] = []
        self._copied: set[int] = set()  # keys of the groups copied since the last step

    def _place(self, sp: ShardedParam) -> None:
        if self.params_too:
            working = sp.shard.dtype
            sp.shard = to_host(sp.shard, working)
            if working == torch.float32 and sp.master_aliased:
                sp.master = sp.shard  # one host tensor is both shard and master
                return
        if sp.master_aliased and not sp.trainable and not self.params_too:
            return  # a frozen fp32 parameter has no separate master to move
        sp.master = to_host(sp.master)
        sp.master_aliased = False

    def copy_group(self, key: int, positions: list[int], grads: list[torch.Tensor]) -> None:
        """Start the device -> host copy of one group's reduced gradient shards:
        ``grads[i]`` is the shard of ``trainable[positions[i]]`` (any float dtype; the host
        keeps fp32). Ordered after the work issued so far on the device."""
        pairs = [(self._views[i], g) for i, g in zip(positions, grads, strict=True) if g.numel()]
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream if stream is not None else contextlib.nullcontext():
            for view, grad in pairs:
                view.copy_(grad.view_as(view), non_blocking=True)
        if stream is not None:
            self._events.append(stream.record_event())
        self._copied.add(key)

    def copied(self, key: int) -> bool:
        return key in self._copied

    def wait_grads(self) -> list[torch.Tensor]:
        """The step's host gradient shards, index-aligned with ``trainable``, once every
        copy started by :meth:`copy_group` has landed."""
        for event in self._events:
            event.synchronize()
        self._events.clear()
        self._copied.clear()
        return self._views

    @contextlib.contextmanager
    def step_threads(self) -> Iterator[None]:
        if self.threads is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def staging_bytes(self) -> int:
        return self.host_grads.numel() * self.host_grads.element_size()
