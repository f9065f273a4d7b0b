"""What every step reader shares, whatever its format: the base of the plug-ins behind
the step-reader protocol (``zerostate.store.protocol``).

zerostate's format 1 (``reader.StepReader``, a read-only adapter), format 2
(``reader_v2.StepReaderV2``) and the peers' (``foreign.base.ForeignStep``) are siblings
under :class:`StepBase`: it owns the thread pool, ``close`` and the context manager, the
checks of a requested range and a rank, and the reads that follow from ``read_range``
(``read``, ``read_many``, ``read_chunk``). A format adds how its bytes are found and
verified. What a format can do beyond the protocol it says with capability flags, so
callers never branch on ``format_version`` or probe for methods.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, ClassVar

import torch

from zerostate.errors import ConfigError
from zerostate.store.format import TensorInfo

#: ``(name, target layout, tp index, start, stop, out)``: see
#: :meth:`StepBase.read_layout_many`; ``out`` a contiguous 1-D CPU tensor of the tensor's dtype.
LayoutRead = tuple[str, Any, int, int, int, torch.Tensor]


class StepBase:
    """One committed step of some format. Thread-safe; reads use a small pool that
    ``close`` frees."""

    #: Shown by ``inspect``; never branched on outside the readers (use the flags below).
    format_version: ClassVar[int | str]
    #: The step may hold tensors by reference to older steps (``refs``), and records each
    #: rank's frozen-tensor digests in its rank state: a save may refer to it.
    supports_references: ClassVar[bool] = False
    #: ``alias(name, existing)`` works: the format cannot tell some tensors apart (DCP
    #: stores buffers among the model's tensors) and a loader names them.
    supports_aliases: ClassVar[bool] = False
    #: The step was written through ``zerostate.dcp`` and is read as its global tensors
    #: (``dcp_steps.DcpStoreStep``): ``reshard`` writes it as a DCP step again.
    dcp_pieces: ClassVar[bool] = False
    #: Any range of any tensor is read from files on this host, through the page cache the
    #: host's ranks share: a range several ranks read costs memory copies, not network
    #: transfers or requests, so a loader may read a replicated tensor whole on every rank
    #: instead of gathering it ([Note: whole replicas at load] in zerostate.checkpoint). A
    #: format that reads through a ``Storage`` passes on its ``reads_locally`` flag.
    reads_locally: bool = False

    def __init__(
        self,
        step: int,
        world_size: int,
        attrs: dict,
        tensors: Mapping[str, TensorInfo],
        num_threads: int,
        thread_name: str = "zs-read",
    ) -> None:
        self.step, self.world_size, self.attrs = step, world_size, attrs
        self.tensors: dict[str, TensorInfo] = dict(tensors)
        self._num_threads = num_threads
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._pool_users = 0  # _map calls running on self._pool

    # ------------------------------------------------------------ what a format adds
    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def object_count(self) -> int:
        raise NotImplementedError

    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flat tensor, verified, as a 1-D tensor (in
        ``out`` when given; :meth:`_check_range` says what ``out`` must be)."""
        raise NotImplementedError

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Re-read every stored byte and check it; raise listing every problem found.
        ``progress`` gets logical byte counts that add up to the tensors' bytes."""
        raise NotImplementedError

    def _rank_state(self, rank: int) -> dict | None:
        return None  # a format with per-rank JSON state overrides it

    # ------------------------------------------------------------------- shared
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.url!r}, world_size={self.world_size}, "
            f"{len(self.tensors)} tensors)"
        )

    def __enter__(self) -> StepBase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Hand the thread pool back (idempotent; reads after it take a pool again).
        Its threads wait for the next step this process opens ([Note: pool reuse])."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            busy, self._pool_users = self._pool_users, 0
        if pool is not None:
            _return_pool(pool, self._num_threads, self._thread_name, busy=busy > 0)

    @property
    def refs(self) -> dict[str, int]:
        """``{tensor: holder step}`` of the tensors held by older steps (none here)."""
        return {}

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"step {self.step} at {self.url} has no tensor {name!r}") from None

    def rank_state(self, rank: int) -> dict | None:
        """The JSON state rank ``rank`` saved (None when it, or the format, saved none)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return self._rank_state(rank)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor with its logical shape."""
        info = self.info(name)
        return self.read_range(name, 0, info.numel).reshape(info.shape)

    def read_many(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """Several ``(name, start, stop, out)`` reads (see :meth:`read_range`), results
        in request order. A format that can coalesce them overrides this."""
        items = list(requests)
        if len(items) <= 1:
            return [self.read_range(*r) for r in items]
        # A pool of its own: read_range may fan out over self._map, which must not wait
        # on the threads running these requests.
        with ThreadPoolExecutor(min(4, len(items)), thread_name_prefix="zs-read-many") as pool:
            return list(pool.map(lambda r: self.read_range(*r), items))

    def read_layout_many(self, requests: Iterable[LayoutRead]) -> None:
        """Fill each request's ``out`` with elements ``[start, stop)`` of flattened tp shard
        ``tp_index`` of tensor ``name`` laid out as ``target`` (a
        :class:`~zerostate.layout.mesh_layout.MeshLayout` of the tensor's global shape): what a
        rank of a tp x dp mesh, or a target piece of ``reshard``, holds. Here: the logical
        segments of that range, read with :meth:`read_many`; a format storing tp pieces plans
        the whole range at once instead (format 3, ``reader_v2``)."""
        logical = []
        for name, target, tp_index, start, stop, out in requests:
            for g, n, p in target.local_segments(tp_index, start, stop):
                logical.append((name, g, g + n, out[p : p + n]))
        self.read_many(logical)

    def read_chunk(self, name: str, index: int) -> memoryview:
        """The verified bytes of layout chunk ``index`` (its owner's range)."""
        info = self.info(name)
        if not 0 <= index < info.layout.num_chunks:
            raise IndexError(f"{name}: chunk {index} out of range [0, {info.layout.num_chunks})")
        start, stop = info.layout.chunk_range(index)
        out = self.read_range(name, start, stop)
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def _map(self, fn: Callable, items: list, *, cpu_bound: bool = False) -> list:
        """``fn`` over ``items`` on the pool. ``cpu_bound``: the work is copies and
        checks of bytes already on this host (local files), so at most as many items run
        at once as there are CPUs to run them ([Note: local read threads]).

        [Note: a failed map]
        The map returns, results or error, only once no item runs any more: the items of
        a load write into the engine's own tensors, and one still running after the load
        raised would land its bytes there later, over whatever the caller did next (a
        load of an older step, say). Once an item fails, items that have not begun are
        skipped, and a long item may stop early when :func:`map_failed` says so; the error
        raised is that of the first failed item in ``items`` order."""
        limit = min(self._num_threads, usable_cpus()) if cpu_bound else self._num_threads
        if len(items) <= 1 or limit <= 1:
            return [fn(x) for x in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = _leased_pool(self._num_threads, self._thread_name)
            pool = self._pool
            self._pool_users += 1
        try:
            gate = threading.BoundedSemaphore(limit) if limit < self._num_threads else None
            failed = threading.Event()

            def run(x: Any) -> Any:
                if gate is not None:
                    gate.acquire()
                try:
                    if failed.is_set():
                        return None  # the map raises: no more work
                    _item.failed = failed  # for map_failed() in a long item
                    try:
                        return fn(x)
                    except BaseException:
                        failed.set()
                        raise
                finally:
                    _item.failed = None
                    if gate is not None:
                        gate.release()

            futures = []
            try:
                for x in items:
                    futures.append(pool.submit(run, x))
            finally:
                if len(futures) < len(items):
                    failed.set()  # a submit failed: what was handed out is only waited for
                wait(futures)
            return [f.result() for f in futures]
        finally:
            with self._pool_lock:
                if self._pool is pool:
                    self._pool_users -= 1

    def _check_range(
        self, info: TensorInfo, start: int, stop: int, out: torch.Tensor | None
    ) -> tuple[int, int, torch.Tensor]:
        """``(start, stop, out)`` checked: integer bounds inside the tensor, and ``out``
        (allocated when None) a contiguous 1-D CPU tensor of the tensor's dtype."""
        name = info.name
        try:
            start, stop = operator.index(start), operator.index(stop)
        except TypeError as exc:
            raise ConfigError(f"{name}: start/stop must be integers ({exc})") from exc
        if not 0 <= start <= stop <= info.numel:
            raise ConfigError(f"{name}: range [{start}, {stop}) is outside [0, {info.numel})")
        numel = stop - start
        if out is None:
            out = torch.empty(numel, dtype=info.dtype)
        elif (
            out.dtype != info.dtype
            or out.dim() != 1
            or out.numel() != numel
            or not out.is_contiguous()
            or out.device.type != "cpu"
        ):
            raise ConfigError(
                f"{name}: out must be a contiguous 1-D CPU {info.dtype} tensor of {numel} "
                f"elements, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        return start, stop, out


_item = threading.local()  # the failure event of the map whose item this thread runs


def map_failed() -> bool:
    """Whether another item of the :meth:`StepBase._map` running this one has failed, so
    this one's work will be thrown away ([Note: a failed map]); False outside a map."""
    failed = getattr(_item, "failed", None)
    return failed is not None and failed.is_set()


def usable_cpus() -> int:
    """CPUs this process may run on.

    [Note: local read threads]
    Reading local files is CPU work once the bytes are in the page cache (copies and
    checksums), and threads beyond the CPUs only contend for them and the interpreter
    lock. Measured on 2 CPUs with a warm cache: one process reading the whole 128 MB
    Llama step took 43 ms with 2 threads and 69 ms with 8; ``verify`` of the 268 MB
    step 0.053 s with 2 and 0.079 s with 8; a 2 -> 3 rank load of the 128 MB step
    0.060 s with 2 per rank against 0.070 s with 8 (stage 2), and 0.055 s against 0.067
    s (stage 3). With a cold cache the thread count made no difference there (1, 2, 4
    and 8 threads within one another's noise, 10 alternating rounds each). So local reads
    and checks run at most this many at once. Object stores keep every thread: there
    the threads wait on the network."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


# [Note: pool reuse]
# A step's pool used to be started for the step and shut down with it, so every load paid
# for starting its threads: 4-6 ms of a 66 ms warm load of a 128 MB checkpoint (2 -> 3
# ranks on 2 cores), 2.5-4 ms of a 24 ms one of 15 MB. A closed step now hands its pool
# back here, and the next step of this process with the same thread count takes it, its
# threads already running (a load closes its step). Alternating both ways in one process
# (20 rounds each, warm cache, that 128 MB step, stage 3), a load took 84.6 ms against
# 100.0 ms, and 76.4 ms against 87.5 ms in a second run. Steps open at the same time still
# have a pool each, so a read never queues behind another step's work. A pool handed back
# while one of its maps still runs (a step closed from another thread) is shut down as
# before, and so is one beyond MAX_IDLE_POOLS of its kind. A forked child forgets the idle
# pools: their threads exist only in the parent, and a pool whose threads are gone takes
# work it never runs.
MAX_IDLE_POOLS = 2
_idle_pools: dict[tuple[int, str], list[ThreadPoolExecutor]] = {}
_idle_lock = threading.Lock()


def _leased_pool(num_threads: int, thread_name: str) -> ThreadPoolExecutor:
    """An idle pool of ``num_threads`` threads named ``thread_name``, or a new one."""
    with _idle_lock:
        idle = _idle_pools.get((num_threads, thread_name))
        if idle:
            return idle.pop()
    return _started_pool(num_threads, thread_name)


def _return_pool(
    pool: ThreadPoolExecutor, num_threads: int, thread_name: str, *, busy: bool
) -> None:
    if not busy:
        with _idle_lock:
            idle = _idle_pools.setdefault((num_threads, thread_name), [])
            if len(idle) < MAX_IDLE_POOLS:
                idle.append(pool)
                return
    pool.shutdown(wait=True)


def _forget_idle_pools() -> None:
    global _idle_lock
    _idle_lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _idle_pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_idle_pools)


def _started_pool(num_threads: int, thread_name: str) -> ThreadPoolExecutor:
    """A pool whose threads are all running before any work is handed to it.

    A pool starts a thread per submission, and each start waits for the new thread to
    take the interpreter lock; once the first reads are verifying checksums, that wait
    is a switch interval (5 ms) per thread, on the load's critical path. Started while
    nothing else runs, all of them take well under a millisecond."""
    pool = ThreadPoolExecutor(num_threads, thread_name_prefix=thread_name)
    gate = threading.Barrier(num_threads + 1)
    # Every task blocks on the gate, so no thread is idle when the next one is submitted:
    # each submission starts a new thread.
    try:
        waits = [pool.submit(gate.wait) for _ in range(num_threads)]
    except BaseException:  # no thread to be had: release the ones that started
        gate.abort()
        pool.shutdown(wait=False)
        raise
    gate.wait()
    for w in waits:
        w.result()
    return pool
