"""The step-reader protocol: what every checkpoint format offers its readers.

zerostate's formats 1 and 2 (``reader.StepReader``, ``reader_v2.StepReaderV2``) and the
peers' (``foreign.deepspeed``, ``foreign.dcp``) implement it, as siblings of one base
(``step_base.StepBase``); ``inspect``, ``verify``,
``consolidate``, ``reshard`` and ``engine.load`` use nothing else, so a new format is one
more plug-in (:func:`zerostate.store.sources.open_source` picks it by what the location
holds). ``zerostate.testing.StepReaderTests`` is the conformance suite a format passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from zerostate.store.format import TensorInfo


@runtime_checkable
class StepSource(Protocol):
    """One committed step. Tensors are named as zerostate names them: ``model/<param>``,
    ``optim/<state>/<param>``, ``buffers/<name>``; ``attrs["engine"]`` is the engine
    state a load restores."""

    step: int
    world_size: int
    attrs: dict
    tensors: Mapping[str, TensorInfo]
    #: For display; callers branch on the capability flags instead.
    format_version: int | str
    #: May hold tensors by reference to older steps (``refs``); a save may refer to it.
    supports_references: bool
    #: ``alias(name, existing)`` is available (a loader names tensors the format mixes).
    supports_aliases: bool
    #: Ranges are read from this host's files: reading one on several ranks costs copies.
    reads_locally: bool

    @property
    def refs(self) -> dict[str, int]: ...

    @property
    def url(self) -> str: ...

    @property
    def object_count(self) -> int: ...

    def info(self, name: str) -> TensorInfo: ...

    def read_range(
        self, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def read_many(
        self, requests: Iterable[tuple[str, int, int, torch.Tensor | None]]
    ) -> list[torch.Tensor]: ...

    def read_layout_many(
        self, requests: Iterable[tuple[str, Any, int, int, int, torch.Tensor]]
    ) -> None: ...

    def read(self, name: str) -> torch.Tensor: ...

    def read_chunk(self, name: str, index: int) -> memoryview: ...

    def verify(self, progress: Callable[[int], Any] | None = None) -> None: ...

    def rank_state(self, rank: int) -> dict | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> StepSource: ...

    def __exit__(self, *exc: Any) -> None: ...


@runtime_checkable
class CheckpointSource(Protocol):
    """A location holding steps of one format."""

    @property
    def url(self) -> str: ...

    def steps(self) -> list[int]: ...

    def scan(self) -> tuple[list[int], list[int]]: ...

    def step(self, step: int | None = None) -> StepSource: ...
