"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3; fp32, fp16 and bf16) behind the step-reader
protocol.

A DeepSpeed checkpoint root holds ``latest`` (the newest tag) and one directory per tag
(``global_step<N>``) with ``mp_rank_00_model_states.pt`` (stages 1-2) or one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3), and one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. Every file is read through
``safe_unpickle`` (stand-ins under DeepSpeed's class names; deepspeed is never imported).

[Note: DeepSpeed partitions]
Stages 1-2: each optimizer param group is one flat fp32 vector, the trainable parameters of
``param_shapes[g]`` back to back (plus ``param_alignment_paddings[g][i]`` after parameter
i where recorded), padded at the end, and cut into ``partition_count`` equal partitions:
rank r holds ``single_partition_of_fp32_groups[g]``, elements ``[r * P, (r + 1) * P)``,
and its Adam moments ``base_optimizer_state.state[g]`` have the same layout. Stage 3 cuts
every parameter on its own: rank r holds elements ``[r * ceil(n / W), ...)`` of each, and
a rank's pieces follow each other in ``param_shapes`` order across its sub-groups
(``fp32_flat_groups``; the moments in ``optimizer_state_dict.state[g]`` match). Frozen
parameters are in the model states: whole at stages 1-2, one padded piece per rank at
stage 3 (``frozen_param_fragments``). Tied aliases (``shared_params``) are not stored; they
become the ``tied`` map, as in zerostate.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from zerostate.errors import CheckpointNotFoundError, CorruptCheckpointError
from zerostate.store.foreign.base import (
    ForeignStep,
    ForeignTensor,
    Segment,
    foreign_engine_state,
)
from zerostate.store.foreign.detect import OPTIM_FILE, STEP_TAG, is_deepspeed, is_tag
from zerostate.store.safe_unpickle import (
    DEEPSPEED_GLOBALS,
    TORCH_GLOBALS,
    Record,
    StoredTensor,
    TorchArchive,
)
from zerostate.store.storage import Storage

ALLOWED = {**TORCH_GLOBALS, **DEEPSPEED_GLOBALS}
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_STEP_TAG, _OPTIM = STEP_TAG, OPTIM_FILE
_MODEL3 = re.compile(r"zero_pp_rank_(\d{1,6})_mp_rank_(\d{2,6})_model_states\.pt")
MODEL_FILE = "mp_rank_00_model_states.pt"


class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint root; steps are its ``global_step<N>`` tags."""

    format_name = "deepspeed"

    def __init__(self, storage: Storage, num_threads: int = 8) -> None:
        self._storage, self._num_threads = storage, num_threads

    @property
    def url(self) -> str:
        return self._storage.url

    def _tags(self) -> dict[int, str]:
        names = self._storage.list_dir("")
        if is_tag(names):
            return {}
        return {int(m.group(1)): n for n in names if (m := _STEP_TAG.fullmatch(n))}

    def steps(self) -> list[int]:
        tags = self._tags()
        if not tags and is_tag(self._storage.list_dir("")):
            return [self.step().step]
        return sorted(tags)

    def scan(self) -> tuple[list[int], list[int]]:
        return self.steps(), []

    def latest_tag(self) -> str:
        names = self._storage.list_dir("")
        if is_tag(names):
            return ""
        if "latest" in names:
            tag = self._storage.read("latest").decode("utf-8", "replace").strip()
            if not _TAG.fullmatch(tag) or tag in (".", ".."):
                raise CorruptCheckpointError(f"{self.url}/latest names an unsafe tag {tag!r:.80}")
            return tag
        tags = self._tags()
        if not tags:
            raise CheckpointNotFoundError(f"no DeepSpeed tag under {self.url}")
        return tags[max(tags)]

    def step(self, step: int | None = None) -> DeepSpeedStep:
        if step is None:
            tag = self.latest_tag()
        else:
            tags = self._tags()
            if step not in tags:
                raise CheckpointNotFoundError(
                    f"no DeepSpeed tag global_step{step} under {self.url} (steps: "
                    f"{sorted(tags)[-10:]})"
                )
            tag = tags[step]
        return open_tag(self._storage, tag, self._num_threads)


def open_tag(storage: Storage, tag: str, num_threads: int = 8) -> DeepSpeedStep:
    prefix = f"{tag}/" if tag else ""
    names = storage.list_dir(tag)
    url = storage.url_of(tag)
    by_mp: dict[int, list[tuple[int, str]]] = {}
    for n in names:
        if m := _OPTIM.fullmatch(n):
            by_mp.setdefault(int(m.group(3)), []).append((int(m.group(2)), n))
    if not by_mp:
        raise CheckpointNotFoundError(f"{url} holds no DeepSpeed *_optim_states.pt files")
    if sorted(by_mp) != list(range(len(by_mp))):
        raise CorruptCheckpointError(
            f"{url}: optimizer files of tensor-parallel ranks {sorted(by_mp)} (ranks missing)"
        )
    builders = [_open_mp(storage, prefix, url, names, mp, by_mp[mp]) for mp in sorted(by_mp)]
    mp_world = builders[0].models[0].get("mp_world_size", 1)
    if isinstance(mp_world, int) and mp_world != len(builders):
        raise CorruptCheckpointError(
            f"{url}: the model states say {mp_world} tensor-parallel ranks, optimizer files of "
            f"{len(builders)} are present (files missing)"
        )
    if len(builders) == 1:
        return builders[0].build(num_threads)
    from zerostate.store.foreign.deepspeed_tp import combine_tp

    return combine_tp(builders, num_threads, DeepSpeedStep)


def _open_mp(
    storage: Storage, prefix: str, url: str, names: list[str], mp: int,
    optim: list[tuple[int, str]],
) -> _Builder:  # fmt: skip
    """The builder of tensor-parallel rank ``mp``'s files: its data-parallel ranks'
    optimizer files and its model states (``mp_rank_<mp>``)."""
    optim = sorted(optim)
    ranks = [r for r, _ in optim]
    if ranks != list(range(len(ranks))):
        raise CorruptCheckpointError(
            f"{url}: optimizer files of ranks {ranks} of mp rank {mp} (ranks missing)"
        )
    optim_archives = [TorchArchive(storage, prefix + n, ALLOWED) for _, n in optim]
    optim_states = [_dict(a.load(), "optimizer_state_dict", a.url) for a in optim_archives]
    stage = int(optim_states[0].get("zero_stage", -1))
    if stage == 3:
        models = []
        for n in names:
            m = _MODEL3.fullmatch(n)
            if m and int(m.group(2)) == mp:
                models.append((int(m.group(1)), n))
        models.sort()
        if [r for r, _ in models] != ranks:
            raise CorruptCheckpointError(f"{url}: stage 3 needs one model state file per rank")
        model_archives = [TorchArchive(storage, prefix + n, ALLOWED) for _, n in models]
    elif stage in (1, 2):
        model_file = model_file_name(mp)
        if model_file not in names:
            raise CorruptCheckpointError(f"{url} has no {model_file}")
        model_archives = [TorchArchive(storage, prefix + model_file, ALLOWED)]
    else:
        raise CorruptCheckpointError(f"{url}: unknown ZeRO stage {stage!r}")
    model_states = [a.load() for a in model_archives]
    for m, a in zip(model_states, model_archives, strict=True):
        if not isinstance(m, dict):
            raise CorruptCheckpointError(f"{a.url}: not a DeepSpeed model state")
    return _Builder(url, stage, model_states, model_archives, optim_states, optim_archives)


def model_file_name(mp: int) -> str:
    """The stage 1-2 model states of tensor-parallel rank ``mp`` (DeepSpeed's ``:02d``)."""
    return f"mp_rank_{mp:02d}_model_states.pt"


class DeepSpeedStep(ForeignStep):
    format_version = "deepspeed"


def _dict(obj: Any, key: str, where: str) -> dict:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: no {key!r} dict (not a DeepSpeed ZeRO file)")
    return value


def _shapes(value: Any, where: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, tuple) for k, v in value.items()
    ):
        raise CorruptCheckpointError(f"{where}: malformed parameter shapes")
    return list(value.items())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(value: Any, where: str) -> StoredTensor:
    if not isinstance(value, StoredTensor):
        raise CorruptCheckpointError(f"{where}: expected a tensor, got {type(value).__name__}")
    return value


class _Builder:
    """Turns the unpickled DeepSpeed documents into logical tensors and engine attrs."""

    def __init__(
        self,
        url: str,
        stage: int,
        models: list[dict],
        model_archives: list[TorchArchive],
        optims: list[dict],
        optim_archives: list[TorchArchive],
    ) -> None:
        self.url, self.stage = url, stage
        self.models, self.model_archives = models, model_archives
        self.optims, self.optim_archives = optims, optim_archives
        self.world_size = len(optims)
        self.tensors: list[ForeignTensor] = []
        self.moments: dict[str, list[str]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}

    def _base_state(self, rank: int) -> dict:
        key = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        return _dict(self.optims[rank], key, self.optim_archives[rank].url)

    def build(self, num_threads: int) -> DeepSpeedStep:
        attrs = self.build_attrs()
        archives = [*self.model_archives, *self.optim_archives]
        step = _int(self.models[0].get("global_steps"), 0)
        return DeepSpeedStep(
            self.url, step, self.world_size, attrs, self.tensors, archives, num_threads
        )

    def build_attrs(self) -> dict:
        """Fills ``tensors`` (this tensor-parallel rank's logical tensors) and returns the
        step's attrs."""
        model = self.models[0]
        groups = model.get("param_shapes")
        if not isinstance(groups, list):
            raise CorruptCheckpointError(f"{self.model_archives[0].url}: no param_shapes list")
        shapes = [_shapes(g, self.model_archives[0].url) for g in groups]
        if self.stage == 3:
            self._stage3(shapes)
        else:
            self._stage12(shapes)
        self._frozen()
        self._buffers()
        base = self._base_state(0)
        hyper = []
        for g in base.get("param_groups", []):
            if not isinstance(g, dict):
                raise CorruptCheckpointError(f"{self.url}: malformed optimizer param group")
            hyper.append({k: v for k, v in g.items() if k != "params"})
        group_params = [[n for n, _ in g] for g in shapes]
        if len(hyper) != len(group_params):  # stage 3 sub-groups are not param groups
            group_params = [[n for g in group_params for n in g]]
            hyper = hyper[:1]
        shared = model.get("shared_params") or {}
        tied = {str(k): str(v) for k, v in shared.items()} if isinstance(shared, dict) else {}
        frozen_shapes = model.get("frozen_param_shapes") or {}
        config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
        attrs = {
            "engine": foreign_engine_state(
                step=_int(model.get("global_steps"), 0),
                stage=self.stage,
                precision=_precision(config),
                world_size=self.world_size,
                tied=tied,
                frozen=[str(n) for n in frozen_shapes],
                optimizer_class=_optimizer_class(config),
                group_params=group_params,
                param_groups=hyper,
                scalars=self.scalars,
                moments=self.moments,
                source="deepspeed",
            ),
            "client_state": None,
            "deepspeed": {
                "ds_version": str(model.get("ds_version")),
                "global_steps": _int(model.get("global_steps"), 0),
                "global_samples": _int(model.get("global_samples"), 0),
                "skipped_steps": _int(model.get("skipped_steps"), 0),
                "dp_world_size": _int(model.get("dp_world_size"), self.world_size),
                # a config given as a file path is saved as that string: nothing to read
                **({"update": _update_settings(config)} if config else {}),
            },
        }
        return attrs

    # ------------------------------------------------------------ trainable
    def _add(self, name: str, shape: tuple, dtype: torch.dtype, segments: list[Segment]) -> None:
        self.tensors.append(ForeignTensor(name, tuple(shape), dtype, tuple(segments)))

    def _moment_tensors(self, rank: int, group: int) -> dict[str, StoredTensor]:
        state = self._base_state(rank).get("state", {})
        entry = state.get(group, {}) if isinstance(state, dict) else {}
        return {
            k: v for k, v in entry.items() if isinstance(k, str) and isinstance(v, StoredTensor)
            and k != "step"
        }  # fmt: skip

    def _step_of(self, group: int) -> torch.Tensor | None:
        state = self._base_state(0).get("state", {})
        entry = state.get(group, {}) if isinstance(state, dict) else {}
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, StoredTensor) and step.numel == 1:
            return self.optim_archives[0].read(step).reshape(())
        if isinstance(step, int | float):
            return torch.tensor(float(step))
        return None

    def _stage12(self, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> None:
        paddings = self.optims[0].get("param_alignment_paddings")
        for g, params in enumerate(shapes):
            parts = []
            for r in range(self.world_size):
                groups = self.optims[r].get("single_partition_of_fp32_groups")
                if not isinstance(groups, list) or len(groups) != len(shapes):
                    raise CorruptCheckpointError(
                        f"{self.optim_archives[r].url}: single_partition_of_fp32_groups does "
                        f"not have {len(shapes)} groups"
                    )
                parts.append(_tensor(groups[g], self.optim_archives[r].url))
            # Every partition has rank 0's size; the end padding is left out of the saved
            # partitions (group_paddings), so later ones may be shorter.
            size = parts[0].numel
            if any(p.numel > size for p in parts):
                raise CorruptCheckpointError(f"{self.url}: group {g} partitions differ in size")
            moments = [self._moment_tensors(r, g) for r in range(self.world_size)]
            keys = sorted(moments[0])
            step = self._step_of(g)
            pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
            offset = 0
            for i, (name, shape) in enumerate(params):
                numel = _numel(shape)
                for kind, sources in [("model", parts)] + [
                    (f"optim/{k}", [moments[r].get(k) for r in range(self.world_size)])
                    for k in keys
                ]:
                    segs = _flat_segments(offset, numel, size, sources, self.optim_archives)
                    self._add(f"{kind}/{name}", shape, torch.float32, segs)
                self.moments[name] = keys
                if step is not None:
                    self.scalars[name] = {"step": step.clone()}
                offset += numel
                if pads is not None and i < len(pads):
                    offset += _int(pads[i], 0)
            if offset > size * self.world_size:
                raise CorruptCheckpointError(
                    f"{self.url}: group {g} needs {offset} elements, its partitions hold "
                    f"{size * self.world_size}"
                )

    def _stage3(self, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> None:
        ws = self.world_size
        flats = []
        for r in range(ws):
            groups = self.optims[r].get("fp32_flat_groups")
            if not isinstance(groups, list) or not groups:
                raise CorruptCheckpointError(f"{self.optim_archives[r].url}: no fp32_flat_groups")
            flats.append([_tensor(t, self.optim_archives[r].url) for t in groups])
        num_groups = len(flats[0])
        moments = [[self._moment_tensors(r, g) for g in range(num_groups)] for r in range(ws)]
        keys = sorted(moments[0][0]) if num_groups else []
        steps = [self._step_of(g) for g in range(num_groups)]
        # Each rank's sub-groups, end to end: the space param pieces are laid out in.
        bounds = [0]
        for t in flats[0]:
            bounds.append(bounds[-1] + t.numel)
        offset = 0
        for name, shape in (p for g in shapes for p in g):
            numel = _numel(shape)
            piece = -(-numel // ws)
            group = max(i for i, b in enumerate(bounds[:-1]) if b <= offset) if numel else 0
            for kind in ["model", *(f"optim/{k}" for k in keys)]:
                segs = []
                for r in range(ws):
                    lo, hi = r * piece, min((r + 1) * piece, numel)
                    if hi <= lo:
                        continue
                    segs += self._stage3_pieces(
                        r, kind, offset, lo, hi - lo, bounds, flats, moments
                    )
                self._add(f"{kind}/{name}", shape, torch.float32, segs)
            self.moments[name] = keys
            if steps and steps[group] is not None:
                self.scalars[name] = {"step": steps[group].clone()}
            offset += piece
        if offset != bounds[-1] and offset > bounds[-1]:
            raise CorruptCheckpointError(f"{self.url}: stage-3 partitions are too small")

    def _stage3_pieces(
        self, rank: int, kind: str, local: int, dst: int, numel: int, bounds: list[int],
        flats: list[list[StoredTensor]], moments: list[list[dict]],
    ) -> list[Segment]:  # fmt: skip
        """Elements ``[local, local + numel)`` of rank ``rank``'s sub-groups end to end
        (a piece may cross from one sub-group into the next)."""
        out = []
        archive = self.optim_archives[rank]
        while numel:
            g = max(i for i, b in enumerate(bounds[:-1]) if b <= local)
            if g >= len(bounds) - 1 or local >= bounds[-1]:
                raise CorruptCheckpointError(f"{archive.url}: a parameter lies past its groups")
            take = min(numel, bounds[g + 1] - local)
            if kind == "model":
                tensor = flats[rank][g]
            else:
                tensor = moments[rank][g].get(kind.removeprefix("optim/"))
                if tensor is None:
                    raise CorruptCheckpointError(f"{archive.url}: {kind} of sub-group {g} missing")
            out.append(Segment(dst, take, archive, tensor, local - bounds[g]))
            local, dst, numel = local + take, dst + take, numel - take
        return out

    # --------------------------------------------------------------- frozen
    def _frozen(self) -> None:
        shapes = self.models[0].get("frozen_param_shapes") or {}
        if not shapes:
            self._frozen_from_module()
            return
        for name, shape in _shapes(shapes, self.model_archives[0].url):
            numel = _numel(shape)
            segs, at = [], 0
            for archive, model in zip(self.model_archives, self.models, strict=True):
                frags = model.get("frozen_param_fragments") or {}
                frag = _tensor(frags.get(name) if isinstance(frags, dict) else None, archive.url)
                take = min(frag.numel, numel - at)
                if take > 0:
                    segs.append(Segment(at, take, archive, frag))
                    at += take
            dtype = segs[0].tensor.dtype if segs else torch.float32
            self._add(f"model/{name}", shape, dtype, segs)

    def _frozen_from_module(self) -> None:
        """Some optimizers (bf16 at stage 1) record no frozen shapes: the frozen
        parameters are then the module entries that are neither trainable, buffers nor
        tied aliases, at the module's dtype."""
        model = self.models[0]
        module = model.get("module")
        if self.stage == 3 or not isinstance(module, dict):
            return
        known = {t.name.split("/", 1)[1] for t in self.tensors}
        known |= set(model.get("buffer_names") or [])
        known |= set((model.get("shared_params") or {}).keys())
        frozen = []
        for name, t in module.items():
            if isinstance(name, str) and name not in known and isinstance(t, StoredTensor):
                self._add(
                    f"model/{name}",
                    t.shape,
                    t.dtype,
                    [Segment(0, t.numel, self.model_archives[0], t)],
                )
                frozen.append(name)
        model["frozen_param_shapes"] = {n: module[n].shape for n in frozen}

    def _buffers(self) -> None:
        model = self.models[0]
        names = model.get("buffer_names") or []
        module = model.get("module")
        if not isinstance(module, dict):
            return
        for name in names:
            t = module.get(name)
            if isinstance(name, str) and isinstance(t, StoredTensor):
                seg = Segment(0, t.numel, self.model_archives[0], t)
                self._add(f"buffers/{name}", t.shape, t.dtype, [seg])


def _flat_segments(
    offset: int, numel: int, size: int, parts: list[Any], archives: list[TorchArchive]
) -> list[Segment]:
    """Elements ``[offset, offset + numel)`` of a group's flat vector cut into ranks'
    partitions of ``size`` elements each ([Note: DeepSpeed partitions])."""
    segs = []
    for r, part in enumerate(parts):
        lo, hi = max(offset, r * size), min(offset + numel, r * size + parts[r].numel)
        if lo >= hi:
            continue
        tensor = _tensor(part, archives[r].url)
        segs.append(Segment(lo - offset, hi - lo, archives[r], tensor, lo - r * size))
    return segs


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _precision(config: dict) -> str:
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return name
    return "fp32"


#: DeepSpeed's value of ``gradient_clipping`` when its config leaves it out
#: (``deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT``).
DEEPSPEED_CLIPPING_DEFAULT = 1.0


def _update_settings(config: dict) -> dict:
    """The settings of the saved run that change its update and that a zerostate engine
    sets on its own ([Note: a peer's update settings] in zerostate.checkpoint.peer_settings): the
    effective gradient clipping (DeepSpeed clips at 1.0 when its config says nothing; 0
    disables). A value of the wrong type is left out rather than guessed."""
    clip = config.get("gradient_clipping", DEEPSPEED_CLIPPING_DEFAULT)
    out: dict[str, Any] = {}
    if isinstance(clip, int | float) and not isinstance(clip, bool) and clip >= 0:
        out["gradient_clipping"] = float(clip)
    return out


def _optimizer_class(config: dict) -> str | None:
    opt = config.get("optimizer")
    kind = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
    params = opt.get("params", {}) if isinstance(opt, dict) else {}
    if kind == "adamw" or (kind == "adam" and (params or {}).get("adam_w_mode", True)):
        return "AdamW"
    if kind == "adam":
        return "Adam"
    return None


__all__ = ["DeepSpeedCheckpoint", "DeepSpeedStep", "Record", "is_deepspeed", "open_tag"]
