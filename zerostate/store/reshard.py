"""Offline resharding: rewrite one committed step for a different world size.

Online loads already reshard (every rank reads its new range through ``read_range``), so
this is for moving a checkpoint between clusters, or for making a step whose chunk grid
matches the job that will read it many times.

The new plan splits every tensor evenly over ``world_size`` ranks (``even_layout``, what
``plan_specs`` does; ``min_shard_numel`` selects ``plan_layouts``' older placement), and
the step is written in the current format (2) whatever the source's format. One
:class:`StepWriter` per new rank, in turn, streams that rank's rows: each row pulls its
bytes from the source through verified ranged reads, a block at a time, as it goes out.
The step is then committed as usual: every rank's manifest first, the commit record last.
Host memory is a few blocks per group being written, never the model. Attributes are
copied; those that record the world size are updated, and ``resharded_from`` records the
source.

[Note: reshard memory]
A new row streams out of blocks of at most ``BLOCK_NBYTES`` (and of at most one piece),
each read from the source as it is needed and dropped once the row has moved past it, so
peak memory follows the block, not the tensor, the row or the model. Three things used to
hold more: every shard of a row kept its last block until the whole row was written (a
reshard to one rank held the model), the local writer's batch of views (``_WRITE_SLICE``
in ``store/local.py``) kept up to 64 MB of blocks alive, and blocks freed to the C heap
raised glibc's mmap threshold, so later blocks came from a heap that kept them. Blocks are
now mapped pages of their own (:func:`_block`), given back when their last view goes.
Measured on a 64 MB step of eight 8 MB fp32 tensors at tp 2 x dp 2 (2 MB pieces), peak RSS
above a process that had done a tiny reshard already: to one rank 91-112 MB before, 26-28
MB after; to tp 1 x dp 4 38-51 MB before, 13-14 MB after. With 16 MB blocks the first was
38 MB, with 2 MB blocks 13-14 MB; 4 MB is between, as ranged requests to object stores
should not get small. A read that is one run of a stored piece lands in place
(``StepReaderV2._read_planned``); only reads cut into several runs use scratch, pages of
their own as well (``reader_v2._scratch``).
"""

from __future__ import annotations

import copy
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.errors import ConfigError
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import even_layout, plan_layouts
from zerostate.store import geometry as mesh_mod
from zerostate.store.format import TensorInfo
from zerostate.store.root import CheckpointRoot
from zerostate.store.rows import LazyShard
from zerostate.store.sources import open_source
from zerostate.store.storage import canonical_location, locations_overlap
from zerostate.store.writer import TensorSpec

#: Called as ``progress(bytes_done, bytes_total)``.
ProgressFn = Callable[[int, int], None]
#: Source bytes read per request while streaming a new row ([Note: reshard memory]).
BLOCK_NBYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ReshardResult:
    step: int
    src_world_size: int
    world_size: int
    num_tensors: int
    total_bytes: int


def reshard(
    src: Any,
    dst: str | os.PathLike,
    world_size: int,
    *,
    step: int | None = None,
    min_shard_numel: int | None = None,
    storage_options: dict | None = None,
    dst_storage_options: dict | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
    tp: int = 1,
    default_min_shard_numel: int | None = None,
) -> ReshardResult:
    """Write step ``step`` (default: latest committed) of ``src`` to ``dst`` for
    ``world_size`` ranks. ``src`` is a checkpoint root (path or URL) or an opened
    checkpoint; ``dst`` is a checkpoint root that may already hold other steps.
    ``dst_storage_options`` defaults to ``storage_options`` when ``dst`` is a URL (pass
    ``{}`` for none), so S3 <-> local works with one set of options.

    Refuses a step already committed in ``dst`` unless ``force`` (which deletes it first).

    ``tp`` > 1 writes the step for a tensor-parallel job of ``tp`` x ``world_size`` ranks
    (format 3, [Note: mesh tensors] in ``store/mesh.py``): each tensor the source stores
    in tensor-parallel pieces keeps its shard dim and fused sub-tensors at the new degree,
    the others are replicated across tp; both partitioned over ``world_size`` data-parallel
    ranks. So does ``tp`` 1 from such a source (the shard dims stay recorded, so a later
    reshard can split them again); from a source without them it writes format 2.
    ``default_min_shard_numel`` is ``min_shard_numel`` for format 2 when that is None (a
    tp x dp step is split evenly unless ``min_shard_numel`` is given, as a job saves it).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    dst_is_url = "://" in os.fspath(dst) and not os.fspath(dst).startswith("file://")
    if dst_storage_options is None and dst_is_url:
        dst_storage_options = storage_options  # a local destination takes no options
    opened = not isinstance(src, (str, os.PathLike))
    src_url = src.url if opened else os.fspath(src)
    dst = os.fspath(dst)
    # Before anything is opened: with --force the destination's step is deleted first,
    # which must never be the source's own step (or anything above or below it).
    if locations_overlap(src_url, dst):
        raise ConfigError(
            f"source {src_url!r} and destination {dst!r} are the same checkpoint or one "
            f"lies inside the other (they resolve to {canonical_location(src_url)!r} and "
            f"{canonical_location(dst)!r}); reshard into a separate directory or prefix"
        )
    reader = src if opened else open_source(src_url, storage_options=storage_options)
    st = reader.step(step)

    target = CheckpointRoot.open(dst, dst_storage_options)  # one storage for every writer
    if st.step in target.steps():
        if not force:
            raise ConfigError(
                f"step {st.step} already exists in {dst!r}; pass --force to replace it"
            )
        target.delete_step(st.step)
    target.remove_partial(only_step=st.step)

    if st.dcp_pieces:
        if tp > 1:
            raise ConfigError(
                f"step {st.step} of {st.url} was written through zerostate.dcp; it reshards "
                "to FSDP2's layout at a number of ranks (--world-size), not to a tp degree"
            )
        return _reshard_dcp(st, target, world_size, progress)
    infos = list(st.tensors.values())
    numels = [int(i.numel) for i in infos]
    if tp > 1 or any(_source_tp_dim(st, i.name) is not None for i in infos):
        return _reshard_mesh(st, target, infos, world_size, tp, min_shard_numel, progress)
    if min_shard_numel is None:
        min_shard_numel = default_min_shard_numel
    if min_shard_numel is None:
        layouts = [even_layout(n, world_size) for n in numels]
    else:
        layouts = plan_layouts(numels, world_size, min_shard_numel)
    specs = [
        TensorSpec(i.name, tuple(i.shape), i.dtype, layout, dict(i.attrs or {}))
        for i, layout in zip(infos, layouts, strict=True)
    ]
    attrs = _updated_attrs(st.attrs, st.world_size, world_size, st.step)

    def shards_of(rank: int) -> dict[str, LazyShard]:
        shards = {}
        for info, layout in zip(infos, layouts, strict=True):
            lo, hi = layout.owned_range(rank)
            if hi > lo:
                shards[info.name] = LazyShard(hi - lo, info.dtype, _SourceRange(st, info, lo, hi))
        return shards

    total = _write_ranks(st, target, infos, specs, attrs, world_size, shards_of, progress)
    return ReshardResult(st.step, int(st.world_size), world_size, len(infos), total)


def _reshard_dcp(
    st: Any, target: Any, world_size: int, progress: ProgressFn | None
) -> ReshardResult:
    """:func:`reshard` of a step written through ``zerostate.dcp``: a DCP step again, with
    the pieces FSDP2 saves at ``world_size`` ranks ([Note: DCP reshard layout] in
    zerostate.store.dcp_steps), each streamed from the source's global tensor."""
    # Imported here: torch's checkpoint metadata types, for such a step only.
    from zerostate.store.dcp_steps import ATTR, fsdp_plan

    plan = fsdp_plan(st, world_size)
    attrs: dict[str, Any] = {ATTR: plan.document}
    attrs["resharded_from"] = {"world_size": int(st.world_size), "step": int(st.step)}

    def shards_of(rank: int) -> dict[str, LazyShard]:
        shards = {}
        for spec in plan.specs:
            if spec.layout.first_owner == rank and spec.layout.numel:
                key, lo, hi = plan.sources[spec.name]
                shards[spec.name] = LazyShard(hi - lo, spec.dtype, _KeyRange(st, key, lo, hi))
        return shards

    infos = [TensorInfo(s.name, s.shape, s.dtype, s.layout) for s in plan.specs]
    total = _write_ranks(st, target, infos, plan.specs, attrs, world_size, shards_of, progress)
    return ReshardResult(st.step, int(st.world_size), world_size, len(st.globals), total)


def _write_ranks(
    st: Any,
    target: Any,
    infos: list,
    specs: list[TensorSpec],
    attrs: dict,
    world_size: int,
    shards_of: Callable[[int], dict[str, LazyShard]],
    progress: ProgressFn | None,
) -> int:
    """Write and commit the new step, one :class:`StepWriter` per rank, streaming each
    rank's ``shards_of(rank)``; returns the bytes written. Rank 0 goes last: its commit
    waits for every other rank's manifest."""
    total = sum(int(i.nbytes) for i in infos)
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    for rank in [*range(1, world_size), 0]:
        writer = target.writer(
            st.step, rank=rank, world_size=world_size, specs=specs, attrs=attrs, progress=advance
        )
        writer.write(shards_of(rank))
        writer.commit(wait=rank == 0)
    if progress is not None and not total:
        progress(0, 0)
    return total


class _Blocks:
    """Bytes of ``numel`` elements of a new row's tensor, produced by :meth:`_fill` in
    verified blocks of up to ``BLOCK_NBYTES`` as the row streams past them (one block in
    memory)."""

    def __init__(self, st: Any, info: Any, numel: int) -> None:
        self.st, self.info, self.numel = st, info, numel
        self.block_lo, self.block = 0, memoryview(b"")

    def __call__(self, offset: int, nbytes: int) -> memoryview:
        item = self.info.dtype.itemsize
        end = offset + nbytes
        if not (self.block_lo <= offset and end <= self.block_lo + self.block.nbytes):
            first = offset // item
            stop = min(self.numel, max(-(-end // item), first + BLOCK_NBYTES // item))
            data = self._fill(first, stop)
            self.block_lo, self.block = first * item, memoryview(data.view(torch.uint8).numpy())
        out = self.block[offset - self.block_lo : end - self.block_lo]
        if end == self.numel * item:
            # The row has streamed past this shard: hold nothing of it while the row's
            # other shards stream (a retried upload fills it again).
            self.block_lo, self.block = 0, memoryview(b"")
        return out

    def _fill(self, first: int, stop: int) -> torch.Tensor:
        raise NotImplementedError


class _SourceRange(_Blocks):
    """Elements ``[lo, hi)`` of a source tensor."""

    def __init__(self, st: Any, info: Any, lo: int, hi: int) -> None:
        super().__init__(st, info, hi - lo)
        self.lo = lo

    def _fill(self, first: int, stop: int) -> torch.Tensor:
        out = _block(stop - first, self.info.dtype)
        return self.st.read_range(self.info.name, self.lo + first, self.lo + stop, out)


class _KeyRange(_Blocks):
    """Elements ``[lo, hi)`` of the global tensor of a DCP key."""

    def __init__(self, st: Any, key: str, lo: int, hi: int) -> None:
        super().__init__(st, st.globals[key], hi - lo)
        self.key, self.lo = key, lo

    def _fill(self, first: int, stop: int) -> torch.Tensor:
        out = _block(stop - first, self.info.dtype)
        (got,) = self.st.read_keys([(self.key, self.lo + first, self.lo + stop, out)])
        return got


def _block(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed block of its own pages, handed back to the system when the last view of it
    goes ([Note: reshard memory])."""
    buf = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buf, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)


def _updated_attrs(attrs: dict, src_world_size: int, world_size: int, step: int) -> dict:
    out = copy.deepcopy(dict(attrs or {}))
    for holder in (out, out.get("engine")):
        if isinstance(holder, dict):
            for key in ("world_size", "dp", "dp_world_size"):
                if key in holder:
                    holder[key] = world_size
    out["resharded_from"] = {"world_size": int(src_world_size), "step": int(step)}
    return out


def _source_tp_dim(st: Any, name: str) -> int | None:
    mesh = st.mesh_layout(name) if hasattr(st, "mesh_layout") else None
    return None if mesh is None else mesh.tp_dim


def _target_mesh(st: Any, info: Any, dp: int, tp: int, msn: int | None) -> MeshLayout:
    """The layout of ``info`` in a tp x dp step: the source's shard dim and fused
    sub-tensors at degree ``tp``, or replicated across tp when the source has none."""
    shape = tuple(info.shape)
    if _source_tp_dim(st, info.name) is None:
        return MeshLayout(shape=shape, dp_shard=dp, min_shard_numel=msn)
    source = st.mesh_layout(info.name)
    return MeshLayout(
        shape=shape,
        tp_dim=source.tp_dim,
        tp_degree=tp,
        fused_sizes=source.fused_sizes,
        dp_shard=dp,
        min_shard_numel=msn,
    )


def _reshard_mesh(
    st: Any,
    target: Any,
    infos: list,
    dp: int,
    tp: int,
    min_shard_numel: int | None,
    progress: ProgressFn | None,
) -> ReshardResult:
    """:func:`reshard` to a tp x dp step: rank ``t * dp + d`` writes piece ``(t, d)``."""
    world = tp * dp
    meshes = [_target_mesh(st, info, dp, tp, min_shard_numel) for info in infos]
    if not any(m.tp_dim is not None for m in meshes):
        raise ConfigError(
            f"step {st.step} of {st.url} records no tensor-parallel layout (no tensor was "
            "saved in tensor-parallel pieces), so it cannot say which dim to split; "
            "reshard it with tp 1, or save it from a tensor-parallel job"
        )
    specs = [
        TensorSpec(
            i.name,
            tuple(i.shape),
            i.dtype,
            mesh_mod.stored_layout(m, world, i.name),
            dict(i.attrs or {}),
            mesh=m,
        )  # fmt: skip
        for i, m in zip(infos, meshes, strict=True)
    ]
    attrs = _updated_attrs(st.attrs, st.world_size, world, st.step)
    attrs["resharded_from"]["tp"] = tp

    def shards_of(rank: int) -> dict[str, LazyShard]:
        piece, shards = divmod(rank, dp), {}
        for info, mesh, spec in zip(infos, meshes, specs, strict=True):
            if piece[0] < mesh.num_tp_pieces and spec.layout.numel:
                chunk = spec.layout.chunk_numel
                read = _PieceSource(st, info, mesh, piece, chunk)
                shards[info.name] = LazyShard(chunk, info.dtype, read)
        return shards

    total = _write_ranks(st, target, infos, specs, attrs, world, shards_of, progress)
    return ReshardResult(st.step, int(st.world_size), world, len(infos), total)


class _PieceSource(_Blocks):
    """One target piece (padded to its row's chunk), read as the range of its tp shard in
    the target layout: a format-3 source plans it with ``layout_plan.plan_range``, any other
    reads its logical segments (``StepSource.read_layout_many``)."""

    def __init__(self, st: Any, info: Any, mesh: MeshLayout, piece: tuple, chunk: int) -> None:
        super().__init__(st, info, chunk)
        self.mesh, self.tp_index = mesh, piece[0]
        self.lo, self.hi = mesh.dp_layout(piece[0]).owned_range(piece[1])

    def _fill(self, first: int, stop: int) -> torch.Tensor:
        out = _block(stop - first, self.info.dtype)  # zeros: the padding stays zero
        end = min(stop, self.hi - self.lo)  # elements past the piece are padding
        if end > first:
            request = (self.info.name, self.mesh, self.tp_index, self.lo + first, self.lo + end)
            self.st.read_layout_many([(*request, out[: end - first])])
        return out
