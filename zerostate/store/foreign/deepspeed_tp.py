"""DeepSpeed AutoTP checkpoints: one ``mp_rank_<t>`` set of files per tensor-parallel rank,
put back together into the full logical tensors.

[Note: DeepSpeed tensor-parallel layouts]
With ``"tensor_parallel": {"autotp_size": T}`` DeepSpeed writes, per tensor-parallel rank
t, ``mp_rank_<t>_model_states.pt`` and ``zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt``:
an ordinary ZeRO 1-2 checkpoint of that rank's shard of the model (data-parallel rank r
holds a flat partition of it, [Note: DeepSpeed partitions]). The model states record where
each shard lies in the full tensor in ``universal_checkpoint_info["affine_map"]``: per
parameter (keyed ``^<escaped name>$``) its ``logical_shape`` and, per tensor-parallel rank,
``shard_shape`` and ``pieces``, each an N-d block of ``shape`` at ``source = [offset,
strides]`` in the logical tensor and ``dest = [offset, strides]`` in the shard, held by the
ranks in ``locations`` (all of them for a replicated parameter). Each rank's tensor is read
as usual; its flat runs are then moved to where the map puts them in the logical tensor.
The keys are looked up, never run as patterns. Optimizer states follow their parameter.
A parameter the map does not name is replicated: tensor-parallel rank 0's copy is kept.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from zerostate.errors import CorruptCheckpointError
from zerostate.store.foreign.base import ForeignStep, ForeignTensor, Segment


def combine_tp(builders: list[Any], num_threads: int, step_class: type[ForeignStep]) -> ForeignStep:
    """One ``step_class`` holding the full tensors of tensor-parallel ranks ``builders``
    (``zerostate.store.foreign.deepspeed``'s builders, in order)."""
    tp = len(builders)
    all_attrs = [b.build_attrs() for b in builders]
    first = builders[0]
    url = first.url
    affine = _affine_map(first.models[0], url)
    local = [{t.name: t for t in b.tensors} for b in builders]
    if any(set(m) != set(local[0]) for m in local):
        raise CorruptCheckpointError(f"{url}: tensor-parallel ranks hold different tensors")
    tensors = []
    for name, t0 in local[0].items():
        entry = affine.get("^" + re.escape(_param_name(name)) + "$")
        if entry is None:
            if any(m[name].shape != t0.shape for m in local):
                raise CorruptCheckpointError(
                    f"{url}: {name!r} differs in shape across tensor-parallel ranks and the "
                    "affine map does not place it"
                )
            tensors.append(t0)
            continue
        tensors.append(_place(name, entry, [m[name] for m in local], url))
    attrs = all_attrs[0]
    dp = first.world_size
    attrs["engine"]["world_size"] = dp * tp
    attrs["deepspeed"].update(tp_world_size=tp, dp_world_size=dp)
    archives = [a for b in builders for a in (*b.model_archives, *b.optim_archives)]
    step = attrs["deepspeed"]["global_steps"]
    return step_class(url, step, dp * tp, attrs, tensors, archives, num_threads)


def _param_name(key: str) -> str:
    """``model/x``, ``buffers/x`` -> ``x``; ``optim/exp_avg/x`` -> ``x``."""
    return key.split("/", 2)[2] if key.startswith("optim/") else key.split("/", 1)[1]


def _affine_map(model: dict, url: str) -> dict[str, Any]:
    info = model.get("universal_checkpoint_info")
    amap = info.get("affine_map") if isinstance(info, dict) else None
    params = amap.get("params") if isinstance(amap, dict) else None
    if not isinstance(params, dict):
        raise CorruptCheckpointError(
            f"{url}: a tensor-parallel DeepSpeed checkpoint without "
            "universal_checkpoint_info['affine_map'] (DeepSpeed 0.19 and later record it): "
            "the shards cannot be placed"
        )
    return params


def _ints(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CorruptCheckpointError(f"{where}: malformed {what} in the affine map")
    return list(value)


def _place(name: str, entry: Any, shards: list[ForeignTensor], url: str) -> ForeignTensor:
    """The logical tensor ``name`` from each tensor-parallel rank's shard."""
    where = f"{url}: {name!r}"
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if not isinstance(ranks, dict) or set(ranks) != set(range(len(shards))):
        raise CorruptCheckpointError(f"{where}: the affine map does not cover every tp rank")
    shape = tuple(_ints(entry.get("logical_shape"), "logical_shape", where))
    segments: list[Segment] = []
    for t, shard in enumerate(shards):
        spec = ranks[t]
        if not isinstance(spec, dict):
            raise CorruptCheckpointError(f"{where}: malformed affine map of tp rank {t}")
        if tuple(_ints(spec.get("shard_shape"), "shard_shape", where)) != shard.shape:
            raise CorruptCheckpointError(
                f"{where}: tp rank {t} holds {shard.shape}, the affine map says "
                f"{spec.get('shard_shape')!r:.60}"
            )
        pieces = spec.get("pieces")
        if not isinstance(pieces, list):
            raise CorruptCheckpointError(f"{where}: malformed pieces of tp rank {t}")
        for piece in pieces:
            locations = piece.get("locations") if isinstance(piece, dict) else None
            owners = _ints(locations, "locations", where)
            if not owners or t != min(owners):
                continue  # a replica another tp rank already places
            ordered = sorted(shard.segments, key=lambda s: s.dst)
            for local, glob, n in _runs(piece, shape, shard.shape, where):
                segments += _move(ordered, local, glob, n, where)
    return ForeignTensor(shards[0].name, shape, shards[0].dtype, tuple(segments))


def _runs(
    piece: dict, shape: tuple[int, ...], shard_shape: tuple[int, ...], where: str
) -> list[tuple[int, int, int]]:
    """``(shard offset, logical offset, numel)`` of each flat run of an N-d piece,
    neighbouring runs merged; every run is checked to lie in both tensors."""
    dims = _ints(piece.get("shape"), "piece shape", where)
    src, dst = piece.get("source"), piece.get("dest")
    if (
        not (isinstance(src, list | tuple) and isinstance(dst, list | tuple))
        or len(src) != 2
        or (len(dst) != 2)
    ):
        raise CorruptCheckpointError(f"{where}: malformed piece source/dest in the affine map")
    s_off, d_off = _ints([src[0]], "offset", where)[0], _ints([dst[0]], "offset", where)[0]
    s_str, d_str = _ints(src[1], "strides", where), _ints(dst[1], "strides", where)
    if not (len(dims) == len(s_str) == len(d_str)):
        raise CorruptCheckpointError(f"{where}: a piece's shape and strides disagree")
    numel, shard_numel = _numel(shape), _numel(shard_shape)
    if not dims:
        return [(d_off, s_off, 1)] if s_off < numel and d_off < shard_numel else _outside(where)
    if any(d == 0 for d in dims):
        return []
    unit = dims[-1] if s_str[-1] == 1 and d_str[-1] == 1 else 1
    lead = dims[:-1] if unit > 1 else dims
    runs: list[tuple[int, int, int]] = []
    count = _numel(tuple(lead))
    for flat in range(count):
        idx, rem = [], flat
        for d in reversed(lead):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        lo = d_off + sum(i * s for i, s in zip(idx, d_str, strict=False))
        go = s_off + sum(i * s for i, s in zip(idx, s_str, strict=False))
        if lo + unit > shard_numel or go + unit > numel:
            _outside(where)
        if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == go:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + unit)
        else:
            runs.append((lo, go, unit))
    return runs


def _outside(where: str) -> list:
    raise CorruptCheckpointError(f"{where}: a piece of the affine map lies outside its tensor")


def _move(segs: list[Segment], local: int, glob: int, numel: int, where: str) -> list[Segment]:
    """A shard's segments (``segs``, in order) over its elements ``[local, local + numel)``,
    moved to start at logical element ``glob``."""
    starts = [s.dst for s in segs]
    out, at, stop = [], local, local + numel
    i = max(bisect.bisect_right(starts, local) - 1, 0)
    while at < stop and i < len(segs):
        seg = segs[i]
        lo, hi = max(at, seg.dst), min(stop, seg.dst + seg.numel)
        if lo < hi:
            if lo != at:
                break
            out.append(Segment(glob + lo - local, hi - lo, seg.archive, seg.tensor,
                               seg.src + lo - seg.dst))  # fmt: skip
            at = hi
        i += 1
    if at != stop:
        raise CorruptCheckpointError(f"{where}: a tp shard does not hold the elements mapped")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
