"""What the foreign readers share: a logical tensor assembled from byte ranges of the
peer's files (:class:`Segment`), and a step reader over such tensors (:class:`ForeignStep`).

[Note: foreign segments]
A peer stores a logical tensor as pieces of its own files: DeepSpeed as slices of each
rank's flat fp32 partition, DCP as one ``torch.save`` item per chunk. A reader lists, per
tensor, which elements of the flat logical tensor each piece holds; the lists are checked
to cover every element exactly once when the step is opened, so a read of ``[start,
stop)`` is plain interval intersection and each piece is fetched by byte range. Nothing is
read whole: a consolidation holds one tensor, a load one rank's ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zerostate import jsonstate
from zerostate.errors import CorruptCheckpointError
from zerostate.layout.partition import even_layout
from zerostate.store import format as fmt
from zerostate.store.format import TensorInfo
from zerostate.store.safe_unpickle import StoredTensor, TorchArchive
from zerostate.store.state_doc import ENGINE_STATE_VERSION, OPTIMIZER_STATE_VERSION
from zerostate.store.step_base import StepBase


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[dst, dst + numel)`` of a logical tensor are elements ``[src, src +
    numel)`` of ``tensor`` in ``archive`` (cast to the logical dtype if they differ)."""

    dst: int
    numel: int
    archive: TorchArchive
    tensor: StoredTensor
    src: int = 0


@dataclass(frozen=True, slots=True)
class ForeignTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[Segment, ...]
    attrs: dict | None = None


# [Note: complex foreign tensors]
# A peer's complex tensor (DCP's ``FileSystemWriter`` saves a RoPE table or a complex
# parameter as any other ``torch.save`` item) is shown to the commands as the store shows
# its own: the real pairs, shape ``(*shape, 2)`` of float32 / float64, with the attribute
# naming the complex dtype ([Note: complex tensors] in zerostate.store.format). The bytes
# are the same (real and imaginary parts interleaved), so each piece is read as the pairs of
# its stored tensor, by the same byte ranges: element ``i`` of the pairs is at byte
# ``i * itemsize / 2`` of the complex storage. A complex tensor stored in pieces of another
# dtype, or a real one stored in complex pieces, is refused: no cast may drop a part.
def real_pairs(tensor: ForeignTensor, where: str) -> ForeignTensor:
    """``tensor``, or a complex one as its real pairs ([Note: complex foreign tensors])."""
    real = fmt.COMPLEX_DTYPES.get(tensor.dtype)
    if real is None:
        if any(s.tensor.dtype in fmt.COMPLEX_DTYPES for s in tensor.segments):
            raise CorruptCheckpointError(
                f"{where}: {tensor.name!r} is {tensor.dtype} but a piece of it is stored complex"
            )
        return tensor
    if any(s.tensor.dtype != tensor.dtype for s in tensor.segments):
        raise CorruptCheckpointError(
            f"{where}: {tensor.name!r} is {tensor.dtype} but a piece of it is stored as "
            f"{next(s.tensor.dtype for s in tensor.segments if s.tensor.dtype != tensor.dtype)}"
        )
    segments = tuple(
        Segment(s.dst * 2, s.numel * 2, s.archive, _stored_pairs(s.tensor), s.src * 2)
        for s in tensor.segments
    )
    attrs = fmt.complex_attrs(tensor.dtype)
    return ForeignTensor(tensor.name, (*tensor.shape, 2), real, segments, attrs)


def _stored_pairs(stored: StoredTensor) -> StoredTensor:
    real = fmt.COMPLEX_DTYPES[stored.dtype]
    return StoredTensor(
        stored.key, real, stored.storage_numel * 2, stored.offset * 2, (*stored.shape, 2)
    )


def check_cover(tensor: ForeignTensor, where: str) -> None:
    """The segments must tile ``[0, numel)`` and lie inside their stored tensors."""
    numel = 1
    for d in tensor.shape:
        numel *= d
    at = 0
    for seg in sorted(tensor.segments, key=lambda s: s.dst):
        if seg.dst != at or seg.numel < 0 or seg.src < 0 or seg.src + seg.numel > seg.tensor.numel:
            raise CorruptCheckpointError(
                f"{where}: the pieces of {tensor.name!r} do not tile its {numel} elements "
                f"(a piece at {seg.dst}, expected {at}): the checkpoint is incomplete"
            )
        at += seg.numel
    if at != numel:
        raise CorruptCheckpointError(
            f"{where}: the pieces of {tensor.name!r} hold {at} of its {numel} elements"
        )


class ForeignStep(StepBase):
    """One step of a peer's checkpoint behind the step-reader protocol (a sibling of
    zerostate's own readers, see ``zerostate.store.step_base``)."""

    format_version: str = "foreign"
    supports_aliases = True

    def __init__(
        self,
        url: str,
        step: int,
        world_size: int,
        attrs: dict,
        tensors: list[ForeignTensor],
        archives: list[TorchArchive],
        num_threads: int = 4,
    ) -> None:
        tensors = [real_pairs(t, url) for t in tensors]
        for t in tensors:
            check_cover(t, url)
        infos = {
            t.name: TensorInfo(
                t.name, t.shape, t.dtype, even_layout(_numel(t.shape), 1), dict(t.attrs or {})
            )
            for t in tensors
        }
        super().__init__(step, world_size, attrs, infos, num_threads, thread_name="zs-peer")
        self._url = url
        self._sources = {t.name: t for t in tensors}
        self._archives = archives

    @property
    def url(self) -> str:
        return self._url

    @property
    def object_count(self) -> int:
        return len(self._archives)

    def objects(self) -> list[str]:
        return [a.url for a in self._archives]

    def alias(self, name: str, existing: str) -> None:
        """Make ``name`` read what ``existing`` reads (a DCP buffer, stored among the
        model's tensors, under the name a load looks for)."""
        source = self._sources[existing]
        self._sources[name] = ForeignTensor(
            name, source.shape, source.dtype, source.segments, source.attrs
        )
        info = self.tensors[existing]
        self.tensors[name] = TensorInfo(name, info.shape, info.dtype, info.layout, dict(info.attrs))

    # ------------------------------------------------------------------- reads
    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flat tensor as a 1-D tensor (into ``out``)."""
        info = self.info(name)
        start, stop, out = self._check_range(info, start, stop, out)
        for seg in self._sources[name].segments:
            lo, hi = max(start, seg.dst), min(stop, seg.dst + seg.numel)
            if lo >= hi:
                continue
            a, b = seg.src + lo - seg.dst, seg.src + hi - seg.dst
            dest = out[lo - start : hi - start]
            if seg.tensor.dtype == info.dtype:
                seg.archive.read(seg.tensor, a, b, out=dest)
            else:
                dest.copy_(seg.archive.read(seg.tensor, a, b))
        return out

    def read_many(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        # read_range does not use the pool itself, so the requests can share it.
        return self._map(lambda r: self.read_range(*r), list(requests))

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Read every byte of every file and check the zip CRC-32 of every entry."""
        problems: list[str] = []
        for archive in self._archives:
            try:
                archive.verify(progress)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        if problems:
            raise CorruptCheckpointError(
                f"{self.url}: {len(problems)} problem(s): " + "; ".join(problems[:20])
            )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def foreign_engine_state(
    *,
    step: int,
    stage: int | None,
    precision: str | None,
    world_size: int,
    tied: dict[str, str] | None,
    frozen: list[str],
    optimizer_class: str | None,
    group_params: list[list[str]],
    param_groups: list[dict],
    scalars: dict[str, dict[str, Any]],
    moments: dict[str, list[str]],
    source: str,
) -> dict:
    """Engine attrs (the engine-state document zerostate saves) for a peer's step.

    ``tied`` or ``optimizer_class`` None mean the peer does not record them; the engine
    that loads the step fills in its own (``zerostate.checkpoint`` does, for foreign
    steps only)."""
    state = {
        name: {
            "tensors": moments[name],
            "scalars": {
                k: jsonstate.encode(v, f"optimizer state {k} of {name}")
                for k, v in scalars.get(name, {}).items()
            },
        }
        for name in moments
    }
    return {
        "version": ENGINE_STATE_VERSION,
        "step": int(step),
        "stage": stage,
        "precision": precision,
        "world_size": world_size,
        "tied": tied,
        "frozen": frozen,
        "non_persistent_buffers": [],
        "source": source,
        "optimizer": {
            "version": OPTIMIZER_STATE_VERSION,
            "classes": [optimizer_class] if optimizer_class else None,
            "group_params": group_params,
            "param_groups": [jsonstate.encode(g, "param group") for g in param_groups],
            "state": state,
        },
    }
