"""Start training from pretrained Hugging Face safetensors weights, reading only owned bytes.

``Engine.load_pretrained`` delegates here. Every rank, in step:

1. opens the checkpoint (:class:`~zerostate.safetensors_io.SafetensorsSource`) and reads
   and validates every header (a few KB to MB; see [Note: safetensors layout]);
2. matches file names to the model: a parameter is found under its canonical name or any
   of its tied aliases; persistent buffers under their own names. Missing, unexpected and
   mis-shaped names are collected into one :class:`PretrainedReport`;
3. agrees with the other ranks (one all-reduce of a failure flag), so all fail together;
4. reads, per parameter, only the elements whose fp32 master this rank holds (stage 0:
   all of them; stages 1-3: ``[start, stop)``), converting the file's dtype to fp32 in
   bounded pieces; buffers (small, replicated) are read whole;
5. agrees again, then ``Engine.refresh_from_masters`` rebuilds the working copies (stages
   1-2 all-gather them; stage 3 casts into the local shard).

Peak extra memory per rank is one read piece (``READ_PIECE_BYTES``) plus its converted
copy, whatever the model's size: the masters and buffers already exist.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zerostate.errors import DistributedMismatchError, PretrainedMismatchError, ZerostateError
from zerostate.runtime import adapt
from zerostate.safetensors_io import SafetensorsSource, TensorEntry

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts

log = logging.getLogger(__name__)

__all__ = ["PretrainedMismatchError", "PretrainedReport", "load_pretrained"]


class PretrainedReport(NamedTuple):
    """What ``load_pretrained`` could not match; all empty after a clean strict load."""

    missing: list[str]
    """Model parameters and persistent buffers that no file tensor provided."""
    unexpected: list[str]
    """File tensors that name nothing in the model."""
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    """``(name, file shape, model shape)`` for names present in both with other shapes."""

    def describe(self, limit: int = 20) -> str:
        def shown(items: list[Any]) -> str:
            more = f" ... (+{len(items) - limit} more)" if len(items) > limit else ""
            return ", ".join(map(str, items[:limit])) + more

        parts = []
        if self.missing:
            parts.append(f"missing from the file ({len(self.missing)}): {shown(self.missing)}")
        if self.unexpected:
            parts.append(
                f"unexpected in the file ({len(self.unexpected)}): {shown(self.unexpected)}"
            )
        if self.mismatched:
            rows = [f"{n} file {list(f)} vs model {list(m)}" for n, f, m in self.mismatched]
            parts.append(f"mis-shaped ({len(rows)}): {shown(rows)}")
        return "; ".join(parts)


class _Target(NamedTuple):
    name: str
    entry: TensorEntry
    out: torch.Tensor  # flat, the elements [start, start + numel) of the tensor
    start: int


def _plan(
    parts: EngineParts, entries: dict[str, TensorEntry]
) -> tuple[list[_Target], PretrainedReport]:
    aliases: dict[str, list[str]] = {}
    for alias, canonical in parts.tied.items():
        aliases.setdefault(canonical, []).append(alias)
    used: set[str] = set()
    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    targets: list[_Target] = []

    def match(names: list[str], shape: tuple[int, ...]) -> TensorEntry | None:
        present = [n for n in names if n in entries]
        used.update(present)
        if not present:
            missing.append(names[0])
            return None
        entry = entries[present[0]]
        if entry.shape != shape:
            mismatched.append((present[0], entry.shape, shape))
            return None
        return entry

    for view in parts.state_views():
        if not view.name.startswith("model/"):
            continue
        # The master covers the whole tensor at stage 0, the owned range otherwise.
        name, master, start = view.name.removeprefix("model/"), view.local, view.local_start
        entry = match([name, *aliases.get(name, [])], tuple(view.shape))
        if entry is not None:
            assert start + master.numel() <= math.prod(view.shape), (name, start)
            targets.append(_Target(name, entry, master, start))
    for name, buf, persistent in adapt.buffers_with_persistence(parts.module):
        if not persistent:
            continue
        entry = match([name], tuple(buf.shape))
        if entry is not None:
            targets.append(_Target(name, entry, buf.view(-1), 0))
    unexpected = sorted(set(entries) - used)
    return targets, PretrainedReport(missing, unexpected, mismatched)


def _agree(parts: EngineParts, error: BaseException | None, what: str) -> None:
    """All ranks raise when any rank failed: the failing rank its own error, the others
    a pointer to it (:meth:`~zerostate.dist.coordinator.Coordinator.agree`)."""
    coordinator = parts.coordinator.with_errors(DistributedMismatchError)
    coordinator.agree(error, f"load_pretrained ({what})")


def load_pretrained(
    parts: EngineParts,
    path_or_url: str | os.PathLike,
    storage_options: dict | None = None,
    strict: bool = True,
    *,
    settle: Callable[[], None] = lambda: None,
) -> PretrainedReport:
    """Load Hugging Face safetensors weights into an engine's ``parts`` ([Note: engine
    parts] in zerostate.checkpoint.parts); collective. See the module docstring.
    ``strict=False`` loads what matches and returns (and logs) the rest.

    ``settle`` is called first, inside the first agreement: it waits for the engine's
    async save in flight and its snapshot (an async save may still be reading the masters)
    and re-raises the save's error. ``parts.mark_set`` is told the names of the parameters
    and buffers that were written; ``parts.mark_torn`` the names that a read failing
    part-way may have partly written, and the source ([Note: torn weights] in
    zerostate.engine.parts)."""
    error: BaseException | None = None
    targets: list[_Target] = []
    report = PretrainedReport([], [], [])
    source: SafetensorsSource | None = None
    try:
        # Inside the agreement ([Note: failing together] in zerostate.checkpoint): a
        # background save that failed on one rank fails every rank here, instead of
        # leaving the others in the agreement below until a process-group timeout.
        settle()
        source = SafetensorsSource(path_or_url, storage_options)
        targets, report = _plan(parts, source.entries())
        if strict and (report.missing or report.unexpected or report.mismatched):
            raise PretrainedMismatchError(
                f"{os.fspath(path_or_url)} does not fit the model: {report.describe()}. "
                "Check that the file belongs to this architecture and config, or pass "
                "strict=False to load what matches and get these lists back"
            )
    except Exception as exc:  # a previous background save's error can be of any kind
        error = exc
    _agree(parts, error, "reading the safetensors headers")
    try:
        with torch.no_grad():
            for t in targets:
                # Pieces are copied (and cast) straight into the master, on any device.
                source.read_elements(t.entry, t.start, t.start + t.out.numel(), t.out)
    except (ZerostateError, OSError, ValueError) as exc:
        error = exc
    try:
        _agree(parts, error, "reading tensor data")
    except BaseException:
        # Every rank: any rank may have written part of its share ([Note: torn weights]).
        parts.mark_torn([t.name for t in targets], os.fspath(path_or_url))
        raise
    parts.refresh_from_masters()
    parts.mark_set([t.name for t in targets])
    if parts.rank == 0 and (report.missing or report.unexpected or report.mismatched):
        log.warning("load_pretrained(%s, strict=False): %s", path_or_url, report.describe())
    return report
