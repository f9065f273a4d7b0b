"""A simulated process group: ``world_size`` ranks as threads of one process.

``run_sim(fn, world_size, monkeypatch)`` replaces the collectives of
``zerostate.dist.collectives`` with in-process versions that exchange tensors between threads
(a barrier per collective), then runs ``fn(rank, group)`` on one thread per rank and
returns the results in rank order. Pass ``group=group`` to the engine. Sums are taken in
rank order in the tensor's dtype, as a real backend would; volumes are recorded in the
engine's statistics with the real functions' rule ([Note: comm accounting]).

CPU autograd runs backward (and so every gradient hook) on the thread that called it, so
each hook sees its own rank. Fast: no process launch, no sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.dist.collectives import Handle


class SimGroup:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._local = threading.local()
        self._barrier = threading.Barrier(world_size, timeout=60)
        self._slots: list[Any] = [None] * world_size

    def size(self) -> int:
        return self.world_size

    def rank(self) -> int:
        return self._local.rank

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective)."""
        self._slots[self.rank()] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()
        return values


def _record(stats: Any, kind: str, numel: int, tensor: torch.Tensor) -> None:
    if stats is not None:
        stats.record(kind, numel, tensor.element_size())


def _sum(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


def _all_reduce(tensor, *, group, stats, op="sum", async_op=False):
    _record(stats, "all_reduce", 2 * tensor.numel(), tensor)
    values = group.exchange(tensor.clone())
    if op == "sum":
        tensor.copy_(_sum(values))
    else:
        tensor.copy_(torch.stack(values).amax(dim=0))
    return Handle(None)


def _reduce_scatter(output, input, *, group, stats, async_op=False):
    _record(stats, "reduce_scatter", input.numel(), input)
    total = _sum(group.exchange(input.clone()))
    output.copy_(total.view(group.size(), -1)[group.rank()])
    return Handle(None)


def _all_gather(output, input, *, group, stats, async_op=False):
    _record(stats, "all_gather", output.numel(), output)
    output.copy_(torch.cat(group.exchange(input.clone())))
    return Handle(None)


def _all_gather_in_place(pieces, *, group, stats):
    tensors = [t for ts in pieces for t in ts]
    if tensors:
        _record(stats, "all_gather", sum(t.numel() for t in tensors), tensors[0])
    mine = group.rank()
    everyone = group.exchange([t.clone() for t in pieces[mine]])
    for r, ts in enumerate(pieces):
        if r != mine:
            for t, v in zip(ts, everyone[r], strict=True):
                t.copy_(v)
    return Handle(None)


def _broadcast_from_first(tensors, *, group):
    first = group.exchange([t.clone() for t in tensors])[0]
    for t, v in zip(tensors, first, strict=True):
        t.copy_(v)


def _barrier(*, group):
    group.exchange(None)


def run_sim(fn: Callable[[int, SimGroup], Any], world_size: int, monkeypatch) -> list[Any]:
    for name, impl in (
        ("all_reduce", _all_reduce),
        ("reduce_scatter", _reduce_scatter),
        ("all_gather", _all_gather),
        ("all_gather_in_place", _all_gather_in_place),
        # The in-place path ([Note: in-place gathers] in zerostate.dist.comm) runs too.
        ("gathers_in_place", lambda tensor, group: True),
        ("broadcast_from_first", _broadcast_from_first),
        ("barrier", _barrier),
    ):
        monkeypatch.setattr(collectives, name, impl)
    group = SimGroup(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        group._local.rank = rank
        try:
            results[rank] = fn(rank, group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            group._barrier.abort()  # release the other ranks instead of hanging

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    failed = [
        e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)
    ]
    if failed:
        raise failed[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results
