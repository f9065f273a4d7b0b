"""Offline resharding: rewrite one committed step for a different world size.

Online loads already reshard (every rank reads its new range through ``read_range``), so
this is for moving a checkpoint between clusters, or for making a step whose chunk grid
matches the job that will read it many times.

The new plan is :func:`~zerostate.partition.plan_layouts` over the source tensors in the
source's tensor order, so it is exactly the plan an engine of ``world_size`` ranks with the
same tensors computes. One :class:`StepWriter` per new rank is opened; each tensor's source
chunks are streamed once, in order (verified), and cut into the new chunk grid (1-D range
intersection), each new chunk going to its owner's writer as soon as it is complete. The
step is then committed as usual: every rank's manifest first, the commit record last.
Host memory is one new chunk plus two source chunks, never the model. Attributes are
copied; those that record the world size are updated, and ``resharded_from`` records the
source.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.errors import ConfigError
from zerostate.partition import DEFAULT_MIN_SHARD_NUMEL, TensorLayout, plan_layouts
from zerostate.store.consolidate import iter_chunk_payloads
from zerostate.store.reader import delete_step, open_checkpoint, remove_partial_steps
from zerostate.store.storage import canonical_location, locations_overlap
from zerostate.store.writer import StepWriter, TensorSpec

#: Called as ``progress(bytes_done, bytes_total)``.
ProgressFn = Callable[[int, int], None]


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
    min_shard_numel: int = DEFAULT_MIN_SHARD_NUMEL,
    storage_options: dict | None = None,
    dst_storage_options: dict | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> ReshardResult:
    """Write step ``step`` (default: latest committed) of ``src`` to ``dst`` for
    ``world_size`` ranks. ``src`` is a checkpoint root (path or URL) or an opened
    checkpoint; ``dst`` is a checkpoint root that may already hold other steps.
    ``dst_storage_options`` defaults to ``storage_options`` when ``dst`` is a URL (pass
    ``{}`` for none), so S3 <-> local works with one set of options.

    Refuses a step already committed in ``dst`` unless ``force`` (which deletes it first).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
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
    reader = src if opened else open_checkpoint(src_url, storage_options=storage_options)
    st = reader.step(step)

    existing = open_checkpoint(dst, storage_options=dst_storage_options)
    if st.step in existing.steps():
        if not force:
            raise ConfigError(
                f"step {st.step} already exists in {dst!r}; pass --force to replace it"
            )
        delete_step(dst, st.step, storage_options=dst_storage_options)
    remove_partial_steps(dst, storage_options=dst_storage_options, only_step=st.step)

    infos = list(st.tensors.values())
    layouts = plan_layouts([int(i.numel) for i in infos], world_size, min_shard_numel)
    specs = [
        TensorSpec(i.name, tuple(i.shape), i.dtype, layout, dict(i.attrs or {}))
        for i, layout in zip(infos, layouts, strict=True)
    ]
    attrs = _updated_attrs(st.attrs, st.world_size, world_size, st.step)
    # One writer per new rank, all open at once, so each source chunk is read exactly once
    # and handed to whichever new ranks' ranges it overlaps.
    writers = [
        StepWriter(
            dst,
            st.step,
            rank=rank,
            world_size=world_size,
            specs=specs,
            attrs=attrs,
            storage_options=dst_storage_options,
        )
        for rank in range(world_size)
    ]
    total = sum(int(i.nbytes) for i in infos)
    done = 0
    for info, layout in zip(infos, layouts, strict=True):
        for rank, shard in _new_chunks(st, info, layout):
            writers[rank].write({info.name: shard})
            done += shard.numel() * info.dtype.itemsize
            if progress is not None:
                progress(done, total)
    # Rank 0 commits last: it waits for every other rank's manifest, then commits.
    for writer in writers[1:]:
        writer.commit(wait=False)
    writers[0].commit(wait=True)
    if progress is not None and not infos:
        progress(0, 0)
    return ReshardResult(st.step, int(st.world_size), world_size, len(infos), total)


def _new_chunks(st: Any, info: Any, layout: TensorLayout) -> Iterator[tuple[int, torch.Tensor]]:
    """``(new owner, data)`` for each chunk of ``layout``, assembled from source chunks.

    One reusable buffer of one new chunk plus at most two source chunks are in memory;
    the buffer is refilled only after the writer has written (and released) it.
    """
    if layout.num_chunks == 0:
        return
    itemsize = info.dtype.itemsize
    buffer = torch.empty(layout.chunk_numel, dtype=info.dtype)
    dest = buffer.view(torch.uint8).numpy()
    index, (lo, hi) = 0, layout.chunk_range(0)
    for src in iter_chunk_payloads(st, [info.name]):
        pos = src.start
        while pos < src.stop:
            take = min(src.stop, hi) - pos
            at, off = (pos - lo) * itemsize, (pos - src.start) * itemsize
            dest[at : at + take * itemsize] = src.payload[off : off + take * itemsize]
            pos += take
            if pos == hi:
                yield layout.chunk_owner(index), buffer[: hi - lo]
                index += 1
                if index == layout.num_chunks:
                    break
                lo, hi = layout.chunk_range(index)
        del src  # drop it before the iterator fetches the one after next
    assert index == layout.num_chunks, "source chunks did not cover the tensor"


def _updated_attrs(attrs: dict, src_world_size: int, world_size: int, step: int) -> dict:
    out = copy.deepcopy(dict(attrs or {}))
    for holder in (out, out.get("engine")):
        if isinstance(holder, dict):
            for key in ("world_size", "dp", "dp_world_size"):
                if key in holder:
                    holder[key] = world_size
    out["resharded_from"] = {"world_size": int(src_world_size), "step": int(step)}
    return out

