"""Verification of a format-2 step: every row's inner chunks re-read and checked against
their checksums, the damage named per rank, row and chunk (``zerostate verify``)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import crc32c

from zerostate.errors import CorruptCheckpointError
from zerostate.store import format as fmt
from zerostate.store.problems import Problem, as_problem, raise_if_any
from zerostate.store.rows import GroupPlan

if TYPE_CHECKING:
    from zerostate.store.reader_v2 import StepReaderV2


class RowVerification:
    """``verify`` of :class:`~zerostate.store.reader_v2.StepReaderV2`, a mixin: the reader
    supplies its storage, its row plans and ``_verify_row``, which reads one row in checked
    blocks as the reads do."""

    def verify(self, progress: Callable[[int], Any] | None = None) -> None:
        """Re-read every row (every inner chunk and the shard index), metadata document
        and manifest; raise listing every problem found, naming the tensors affected."""
        problems: list[str | Problem] = []
        lock = threading.Lock()

        def report(problem: str | Problem) -> None:
            with lock:
                problems.append(problem)

        def check_row(item: tuple[GroupPlan, int]) -> None:
            plan, rank = item
            try:
                row = self._row(plan, rank)
                if row is not None:
                    self._verify_row(plan, rank, row, report)
            except CorruptCheckpointError as exc:
                report(str(exc))
            if progress is not None:
                logical = sum(hi - lo for lo, hi, _ in plan.spans(rank))
                if logical:
                    progress(logical)

        def check_doc(item: tuple[str, fmt.ChunkRecord]) -> None:
            path, record = item
            problem = self._check_object(path, record, f"metadata {path!r}")
            if problem:
                report(problem)

        rows = [(p, r) for p in self._plans.values() for r in range(self.world_size)]
        self._map(check_row, rows, cpu_bound=self._storage.reads_locally)
        self._map(check_doc, sorted(self._files.items()))
        manifests = [(fmt.manifest_path(r), m) for r, m in enumerate(self._manifests)]
        self._map(check_doc, manifests)
        self._verify_held(report, progress)
        raise_if_any(f"step {self.step} at {self.url}", problems)

    def _verify_held(
        self, report: Callable[[str | Problem], None], progress: Callable[[int], Any] | None
    ) -> None:
        """Verify the holders' rows that hold the tensors this step refers to."""
        for holder in self._holders.values():
            names = [n for n, h in self._held_by.items() if h is holder]
            groups = {holder.tensors[n].group for n in names}
            rows = [(holder._plans[g], r) for g in sorted(groups) for r in range(holder.world_size)]
            held: list[str | Problem] = []

            def check(
                item: tuple[GroupPlan, int],
                holder: StepReaderV2 = holder,
                held: list[str | Problem] = held,
            ) -> None:
                plan, rank = item
                try:
                    row = holder._row(plan, rank)
                    if row is not None:
                        holder._verify_row(plan, rank, row, held.append)
                except CorruptCheckpointError as exc:
                    held.append(str(exc))

            self._map(check, rows)
            for problem in map(as_problem, held):
                message = f"held by step {holder.step}: {problem.message}"
                report(dataclasses.replace(problem, message=message))
            if progress is not None:
                progress(sum(int(holder.tensors[n].nbytes) for n in names))

    def _check_object(self, path: str, record: fmt.ChunkRecord, what: str) -> str | None:
        buf = memoryview(bytearray(record.nbytes + 1))  # one more: an overlong object shows
        try:
            got = self._storage.read_range_into(f"{self._dir}/{path}", 0, [buf])
        except FileNotFoundError:
            return f"{what} ({self._storage.url_of(f'{self._dir}/{path}')}) is missing"
        if got != record.nbytes or crc32c.crc32c(buf[:got]) != record.crc32c:
            return f"{what} ({self._storage.url_of(f'{self._dir}/{path}')}) fails its checksum"
        return None
