"""Every ``torch.distributed`` call the package makes, as free functions returning handles.

Nothing else in ``zerostate`` imports ``torch.distributed`` (a test scans the sources).
The collective *patterns* built on these calls (pack, launch, cap in-flight work,
accumulate, unpack, release) live once in :mod:`zerostate.comm`.

[Note: comm accounting]
Volumes follow the ZeRO paper: an all-reduce of ``X`` elements moves ``2X`` (it is a
reduce-scatter plus an all-gather); a reduce-scatter or all-gather whose *full* (unsharded)
tensor has ``X`` elements moves ``X``. What is counted is what is really put on the wire,
padding included. Collectives that are not part of training (engine construction,
``full_state_dict``) pass ``stats=None`` and are not counted.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zerostate.dist import shm
from zerostate.errors import ConfigError, DistributedMismatchError

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    # torch >= 2.10 names the single-tensor collectives *_single; older releases only have
    # the *_tensor spellings (same semantics). Looked up per call so that a wrapper
    # installed on torch.distributed (an independent traffic count, say) sees every call.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


@dataclass
class CommStats:
    """Per-step communication counters (elements, bytes, calls per collective kind)."""

    current: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0, 0] for k in KINDS})
    last: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0, 0] for k in KINDS})

    def record(self, kind: str, numel: int, element_size: int) -> None:
        entry = self.current[kind]
        entry[0] += numel
        entry[1] += numel * element_size
        entry[2] += 1

    def end_step(self) -> None:
        self.last = self.current
        self.current = {k: [0, 0, 0] for k in KINDS}

    def report(self) -> dict[str, dict[str, int]]:
        out = {k: {"elements": v[0], "bytes": v[1], "calls": v[2]} for k, v in self.last.items()}
        out["total"] = {
            key: sum(out[k][key] for k in KINDS) for key in ("elements", "bytes", "calls")
        }
        return out


class Handle(NamedTuple):
    """A launched collective; ``wait()`` blocks until its output is ready."""

    work: Any

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


def group_info(group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; errors name the fix when there is no group."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (one process is fine: "
                "backend='gloo', world_size=1), or launch with torchrun"
            )
        return dist.get_rank(), dist.get_world_size()
    size = group.size() if hasattr(group, "size") else None
    rank = group.rank() if hasattr(group, "rank") else None
    if not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"group has world size {size!r}; pass a process group with at least one rank "
            "(group=None uses the default group)"
        )
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ConfigError(
            f"this process has rank {rank!r} in a group of size {size}: it is not a member; "
            "construct the Engine only on the group's ranks"
        )
    return rank, size


def is_device_mesh(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.device_mesh.DeviceMesh``."""
    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (a parameter that ``parallelize_module`` sharded)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def dtensor_local(tensor: Any) -> torch.Tensor:
    """The plain local tensor a DTensor holds on this rank (its storage, not a copy)."""
    with torch.no_grad():
        return tensor.to_local()


def dtensor_placements(tensor: Any) -> tuple[str, ...]:
    """A DTensor's placements as ``"shard(d)"``, ``"replicate"`` or ``"partial"``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for p in tensor.placements:
        if isinstance(p, Shard):
            out.append(f"shard({p.dim})")
        elif isinstance(p, Replicate):
            out.append("replicate")
        elif isinstance(p, Partial):
            out.append("partial")
        else:
            out.append(type(p).__name__)
    return tuple(out)


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh, placements, global shape and stride whose local
    tensor on this rank is ``local``. No communication."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def dtensor_redistribute_like(tensor: Any, like: Any) -> Any:
    """``tensor`` (a DTensor) redistributed to ``like``'s placements: a ``Partial``
    gradient is summed over the mesh here (collective over ``tensor``'s mesh)."""
    with torch.no_grad():
        return tensor.redistribute(like.device_mesh, like.placements)


def dtensor_full(local: torch.Tensor, like: Any) -> torch.Tensor:
    """The global tensor whose local piece on this rank is ``local``, laid out as ``like``
    (collective over ``like``'s mesh)."""
    with torch.no_grad():
        return dtensor_like(local, like).full_tensor()


def new_singleton_group() -> Any:
    """A one-rank process group of this rank alone; only this rank takes part in
    creating it (``use_local_synchronization``), so it is no collective."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def new_subgroups(rank_lists: list[list[int]]) -> Any:
    """This rank's group of ``rank_lists`` (disjoint lists covering the world), made by every
    rank for every list in the same order: a collective."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists)
    return group


def _count(stats: CommStats | None, kind: str, numel: int, tensor: torch.Tensor) -> None:
    if stats is not None:
        stats.record(kind, numel, tensor.element_size())


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: Any,
    stats: CommStats | None,
    op: str = "sum",
    async_op: bool = False,
) -> Handle:
    """In-place all-reduce (``op`` is ``"sum"`` or ``"max"``)."""
    _count(stats, "all_reduce", 2 * tensor.numel(), tensor)
    transport = _transport(tensor, group)
    if transport is not None:
        transport.all_reduce(tensor, op)
        return Handle(None)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    return Handle(dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op))


class _Works:
    """Several launched works as one, then ``after`` once they are all done."""

    __slots__ = ("works", "after")

    def __init__(self, works: list[Any], after: Any = None) -> None:
        self.works = works
        self.after = after

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.after is not None:
            after, self.after = self.after, None
            after()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _by_segment(tensor: torch.Tensor, group: Any) -> bool:
    """[Note: gloo segments]
    On gloo a reduce-scatter or an all-gather is faster as one rooted collective per
    segment (a ``reduce`` to each segment's owner; a ``broadcast`` from each) than as
    torch's single call, which gloo runs slower than an all-reduce of the same full
    tensor. Measured on 2 shared cores, 2 ranks, best of 12 (ms; benchmarks/README.md):
    2M elements reduce-scatter 12.8 single / 2.7 by segment, all-gather 4.0 / 2.5; 6.5M
    all-gather 12.7 / 3.6, all-reduce 11.6; at 4 ranks 2M reduce-scatter 18.3 / 12.1,
    all-gather 11.6 / 4.9. The elements handed to torch.distributed are the same (the
    segments add up to the full tensor), and so is the count of [Note: comm accounting].
    NCCL (and any other backend) keeps the single call."""
    if tensor.device.type != "cpu":
        return False
    return "gloo" in str(dist.get_backend(group))


def _segments(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(full.view(world, -1).unbind(0))


def _segmented(
    kind: str,
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: Any,
    stats: CommStats | None,
    async_op: bool = False,
) -> Handle:
    # The full (unsharded) tensor is the input of a reduce-scatter, the output of an
    # all-gather: that is what [Note: comm accounting] counts.
    full = input if kind == "reduce_scatter" else output
    _count(stats, kind, full.numel(), full)
    transport = _transport(full, group)
    if transport is not None:
        if kind == "reduce_scatter":
            transport.reduce_scatter(output, input)
        else:
            transport.all_gather(output, input)
        return Handle(None)
    if _by_segment(full, group):
        handle = Handle(_by_segments(kind, output, input, group))
        if not async_op:
            handle.wait()
            return Handle(None)
        return handle
    if kind == "reduce_scatter":
        work = _reduce_scatter_single(
            output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
    else:
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    return Handle(work)


def _by_segments(kind: str, output: torch.Tensor, input: torch.Tensor, group: Any) -> _Works:
    """[Note: gloo segments]. A reduce-scatter's ``input`` is scratch afterwards: gloo's
    reduce may leave partial sums in the segments a rank does not own."""
    rank, world = group_info(group)
    if kind == "reduce_scatter":
        pieces = _segments(input, world)
        works = [
            dist.reduce(
                piece, _global_rank(group, i), op=dist.ReduceOp.SUM, group=group, async_op=True
            )
            for i, piece in enumerate(pieces)
        ]
        own = pieces[rank]
        if own.data_ptr() == output.data_ptr():
            return _Works(works)  # in place: the owned segment is the output
        return _Works(works, lambda: output.copy_(own))
    pieces = _segments(output, world)
    if pieces[rank].data_ptr() != input.data_ptr():
        pieces[rank].copy_(input)
    works = [
        dist.broadcast(piece, _global_rank(group, i), group=group, async_op=True)
        for i, piece in enumerate(pieces)
    ]
    return _Works(works)


# -- the shared-memory transport ([Note: shared-memory transport] in zerostate.dist.shm) ----
#: id(process group) -> (a weak reference to the group, its transport or None). Weak, and
#: the transport's collectives hold the group weakly too ([Note: no group kept to exit] in
#: zerostate.dist.lifetime).
_TRANSPORTS: dict[int, tuple[weakref.ref, shm.Transport | None]] = {}


def _transport(tensor: torch.Tensor, group: Any) -> shm.Transport | None:
    """The group's shared-memory transport when it suits a collective of ``tensor`` (its
    full size), else None (gloo, or another backend). Collective on first use."""
    if not shm.eligible(tensor):
        return None
    transport = _group_transport(group)
    if transport is None:
        return None
    return transport if transport.reserve(tensor.numel() * tensor.element_size()) else None


def _group_transport(group: Any) -> shm.Transport | None:
    pg = dist.group.WORLD if group is None else group
    entry = _TRANSPORTS.get(id(pg))
    if entry is not None and entry[0]() is pg:  # a dead reference: the id was reused
        return entry[1]
    for key, (ref, _) in list(_TRANSPORTS.items()):
        old = ref()
        if old is None or not is_registered(old):  # destroyed since: let its mappings go
            del _TRANSPORTS[key]
    transport = _new_transport(pg)
    _TRANSPORTS[id(pg)] = (weakref.ref(pg, _forget_transport), transport)
    return transport


def _forget_transport(ref: weakref.ref) -> None:
    """A group was freed: its entry goes, and with it the transport's mappings."""
    for key, (entry_ref, _) in list(_TRANSPORTS.items()):
        if entry_ref is ref:
            del _TRANSPORTS[key]


def shared_memory_bytes() -> tuple[int, int]:
    """Bytes of this process's own shared-memory segments, and of the other ranks'
    segments it maps, over its live groups ([Note: shared-memory transport])."""
    own = peers = 0
    for ref, transport in list(_TRANSPORTS.values()):
        pg = ref()
        if transport is not None and pg is not None and is_registered(pg):
            mine, theirs = transport.nbytes()
            own, peers = own + mine, peers + theirs
    return own, peers


def is_registered(pg: Any) -> bool:
    """Whether ``pg`` is a live process group of torch.distributed (not destroyed)."""
    try:
        return pg in dist.distributed_c10d._world.pg_map
    except (AttributeError, TypeError):
        return True


def _new_transport(pg: Any) -> shm.Transport | None:
    # Decided from what every rank shares (the backend, the world size), then agreed.
    if "gloo" not in str(dist.get_backend(pg)):
        return None
    rank, world = pg.rank(), pg.size()
    if world < 2:
        return None
    mine = torch.tensor([int(shm.enabled()), shm.new_token()], dtype=torch.int64)
    rows = torch.empty(2 * world, dtype=torch.int64)
    _all_gather_single(rows, mine, group=pg)
    table = rows.view(world, 2).tolist()
    if not all(row[0] for row in table):
        return None

    ref = weakref.ref(pg)

    def live() -> Any:
        group = ref()
        if group is None:  # nothing runs a collective on a group it no longer holds
            raise ConfigError("the process group of a shared-memory transport was freed")
        return group

    def barrier() -> None:
        dist.barrier(group=live())

    def all_ok(ok: bool) -> bool:
        failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=live())
        return int(failed.item()) == 0

    return shm.Transport(rank, world, table[0][1], barrier, all_ok)


def _global_rank(group: Any, rank: int) -> int:
    # torch < 2.6 takes a rooted collective's root as a global rank only.
    return rank if group is None else dist.get_global_rank(group, rank)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, **options: Any) -> Handle:
    """Sum ``input`` (``world_size`` equal segments) across ranks; rank r gets segment r.

    ``options``: ``group``, ``stats`` (both required) and ``async_op``.
    """
    return _segmented("reduce_scatter", output, input, **options)


def all_gather(output: torch.Tensor, input: torch.Tensor, **options: Any) -> Handle:
    """Concatenate every rank's ``input`` into ``output`` (``world_size`` segments).

    ``options``: ``group``, ``stats`` (both required) and ``async_op``.
    """
    return _segmented("all_gather", output, input, **options)


def gathers_in_place(tensor: torch.Tensor, group: Any) -> bool:
    """Whether :func:`all_gather_in_place` suits ``group`` for tensors like ``tensor``: a
    backend that runs an all-gather as rooted collectives anyway ([Note: gloo segments]),
    unless the group's collectives go through shared memory ([Note: shared-memory
    transport]), where one packed all-gather is a few copies."""
    return _by_segment(tensor, group) and _group_transport(group) is None


def all_gather_in_place(
    pieces: list[list[torch.Tensor]], *, group: Any, stats: CommStats | None
) -> Handle:
    """An all-gather whose segments already lie where they belong, asynchronously: every
    tensor of ``pieces[r]`` holds rank r's values on rank r and receives them, in place,
    on every other rank (one ``broadcast`` each, [Note: gloo segments]). Counted as one
    all-gather of all their elements ([Note: comm accounting])."""
    tensors = [t for ts in pieces for t in ts]
    if tensors:
        _count(stats, "all_gather", sum(t.numel() for t in tensors), tensors[0])
    works = [
        dist.broadcast(t, _global_rank(group, r), group=group, async_op=True)
        for r, ts in enumerate(pieces)
        for t in ts
    ]
    return Handle(_Works(works))


def broadcast_from_first(tensors: list[torch.Tensor], *, group: Any) -> None:
    """Overwrite ``tensors`` on every rank with the group's first rank's values (in place).

    Used once at construction, so it is not counted in the per-step statistics.
    """
    src = 0 if group is None else dist.get_global_rank(group, 0)
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def is_initialized() -> bool:
    """Whether a default process group exists (checkpoint tools also run without one)."""
    return dist.is_available() and dist.is_initialized()


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
    import torch.distributed.nn.functional as functional  # loaded now, so nothing binds later

    for fn in vars(functional).values():
        if getattr(fn, "__module__", None) == functional.__name__ and callable(fn):
            unpin_defaults(fn, lambda d: isinstance(d, dist.ProcessGroup))


def unpin_defaults(fn: Any, pinned: Any) -> bool:
    """Set to None each default of ``fn`` (positional or keyword-only) that ``pinned(value)``
    says holds a process group; whether any was."""
    changed = False
    defaults = getattr(fn, "__defaults__", None)
    if defaults and any(pinned(d) for d in defaults):
        fn.__defaults__ = tuple(None if pinned(d) else d for d in defaults)
        changed = True
    kwdefaults = getattr(fn, "__kwdefaults__", None)
    for key, value in list((kwdefaults or {}).items()):
        if pinned(value):
            kwdefaults[key] = None
            changed = True
    return changed


def is_destroyed_group(value: Any) -> bool:
    """Whether ``value`` is a process group that was destroyed (and is still alive)."""
    return isinstance(value, dist.ProcessGroup) and not is_registered(value)


def barrier(*, group: Any) -> None:
    """Block until every rank of ``group`` arrives; a no-op without a process group."""
    if is_initialized():
        dist.barrier(group=group)


def digest(obj: Any) -> int:
    raw = hashlib.sha256(repr(obj).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def exchange(
    row: list[int],
    *,
    group: Any,
    world_size: int,
    device: torch.device,
    stats: CommStats | None = None,
) -> list[list[int]]:
    """All-gather one short row of integers per rank (control traffic: counted only when
    it recurs every step, with ``stats``)."""
    if not is_initialized():
        return [list(row)]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = torch.empty(world_size * len(row), dtype=torch.int64, device=device)
    all_gather(rows, mine, group=group, stats=stats)
    return rows.view(world_size, len(row)).tolist()


def check_agreement(
    aspects: dict[str, Any],
    local_error: BaseException | None,
    *,
    group: Any,
    world_size: int,
    device: torch.device,
) -> None:
    """Make every rank fail together when any rank failed or ranks disagree.

    Each rank contributes an error flag plus one hash per aspect (e.g. parameter names,
    shapes, config). One all-gather, then every rank reaches the same verdict: the failing
    rank re-raises its own error, the others raise :class:`DistributedMismatchError`.
    """
    names = list(aspects)
    row = [1 if local_error is not None else 0] + [digest(aspects[n]) for n in names]
    table = exchange(row, group=group, world_size=world_size, device=device)
    failed = [r for r, t in enumerate(table) if t[0]]
    if local_error is not None:
        raise local_error
    if failed:
        raise DistributedMismatchError(
            f"engine construction failed on rank(s) {failed}; see the error those ranks "
            "raised, fix it there, and construct the Engine on every rank the same way"
        )
    for column, name in enumerate(names, start=1):
        differ = [r for r, t in enumerate(table) if t[column] != table[0][column]]
        if differ:
            raise DistributedMismatchError(
                f"ranks disagree on {name}: rank(s) {differ} differ from rank 0. Build the "
                "same model (same parameter names, shapes, dtypes, requires_grad) with the "
                "same Engine settings on every rank"
            )


# -- the key-value store ([Note: arrival deadline] in zerostate.dist.arrival) --------------
def kv_store() -> Any:
    """The process group's key-value store (TCPStore), or None where there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def group_ranks(group: Any, world_size: int) -> tuple[int, ...]:
    """The global ranks of ``group`` (every rank for the default group)."""
    if group is None:
        return tuple(range(world_size))
    return tuple(dist.get_process_group_ranks(group))


#: What losing the store raises.
NETWORK_ERROR = getattr(dist, "DistNetworkError", ConnectionError)
#: What a store's ``wait`` raises at its deadline (a plain RuntimeError in older torch).
WAIT_TIMEOUT = getattr(dist, "DistStoreError", RuntimeError)


def agree(
    error: BaseException | None,
    what: str,
    *,
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    error_cls: type[Exception],
    note: str = "",
) -> None:
    """Every rank learns whether any rank failed ``what``: one all-gather of a flag. The
    failing rank re-raises ``error``; the others raise ``error_cls`` naming the failed
    rank(s), followed by ``note``. Without a process group only ``error`` matters."""
    rows = exchange([0 if error is None else 1], group=group, world_size=world_size, device=device)
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise error_cls(
            f"{what} failed on rank(s) {failed} (see the error rank {failed[0]} raised); "
            f"rank {rank}'s part succeeded{note}"
        )


# -- point to point and byte transfers (the memory tier's replicas) -------------------------
def new_gloo_group() -> Any:
    """Collective over the whole world: a new gloo group of every rank (a background
    thread's own group: it must not share one with the training thread's collectives)."""
    return dist.new_group(backend="gloo")


def send_and_receive(
    sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]], *, group: Any
) -> None:
    """Send each ``(tensor, rank)`` and receive into each ``(tensor, rank)`` (ranks in
    ``group``), all launched at once and waited for."""
    ops = [dist.P2POp(dist.irecv, t, _global_rank(group, r), group) for t, r in receives]
    ops += [dist.P2POp(dist.isend, t, _global_rank(group, r), group) for t, r in sends]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def broadcast_from(tensor: torch.Tensor, src: int, *, group: Any) -> None:
    """``tensor`` of rank ``src`` (a rank in ``group``) on every rank, in place."""
    dist.broadcast(tensor, src=_global_rank(group, src), group=group)


# -- objects (a DCP save's plans) -----------------------------------------------------------
#: Seconds a rank waits for the others at a call's arrival when nothing else sets it.
DEFAULT_TIMEOUT_S = 300.0


def default_group() -> Any:
    """The default process group (None without torch.distributed)."""
    return dist.group.WORLD if is_initialized() else None


def control_device(group: Any) -> torch.device:
    """Where the small control tensors of ``group`` live: the host for gloo (or without a
    process group), this process's current GPU for a GPU backend."""
    if not is_initialized() or "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def gather_objects(obj: Any, *, group: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 of ``group`` (in rank order), None on the others.
    The objects travel pickled between this job's own processes, as DCP's plans do; no
    checkpoint data is ever among them."""
    if not is_initialized():
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=_global_rank(group, 0), group=group)
    return out


def scatter_objects(objs: list[Any] | None, *, group: Any, rank: int) -> Any:
    """Rank 0's ``objs[r]`` on each rank ``r`` of ``group`` (``objs`` is read on rank 0)."""
    if not is_initialized():
        return objs[0] if objs else None
    out: list[Any] = [None]
    dist.scatter_object_list(
        out, objs if rank == 0 else None, src=_global_rank(group, 0), group=group
    )
    return out[0]
