"""The node-local memory tier: one run's steps in a directory in shared memory.

[Note: memory tier layout]
A node's memory directory (``/dev/shm/zerostate`` by default; ``ZEROSTATE_MEMORY_DIR`` or
the engine's ``memory_dir`` setting override it) holds one directory per run::

    <memory dir>/run-<16 hex>/run.json             {"zerostate_memory": {"run_id", "location"}}
    <memory dir>/run-<16 hex>/step-<8 digits>/     a step in the store's format (docs/format.md)

The run id is derived from the canonical location of the durable root the steps belong to
(:func:`run_id`), so a directory left by a job saving elsewhere is never taken for ours;
``run.json`` repeats it and the location, and a directory whose ``run.json`` does not name
exactly our run is refused (never read, never written, never deleted: it may belong to a
job still running on this node).

A memory step is an ordinary step directory with every metadata document, every rank's
manifest and the commit record, but only some row objects: those of the ranks of this node
and the replicas this node keeps for ranks of another node. Which rows a node holds is
read off the directory (:meth:`MemoryTier.held_ranks`), each checked against the commit
record's sizes; their checksums are checked by every read, as for any step. The commit
record is written last, and only after every rank's own rows and their replicas were
written (zerostate.checkpoint.tiers), so a committed memory step on any node means the
whole step existed on two nodes when it was committed.

This module does storage bookkeeping only; it imports no training code and no transport.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import crc32c

from zerostate.errors import CheckpointError
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store.local import LocalStorage
from zerostate.store.problems import VerifyError
from zerostate.store.root import CheckpointRoot
from zerostate.store.rows import row_path

#: Where memory steps live when nothing says otherwise (tmpfs on Linux).
DEFAULT_MEMORY_DIR = "/dev/shm/zerostate"
#: The environment variable naming a node's memory directory.
MEMORY_DIR_ENV = "ZEROSTATE_MEMORY_DIR"
_RUN_FILE = "run.json"
_RUN_KEY = "zerostate_memory"
_MAX_RUN_FILE = 64 * 1024


class MemoryTierRefused(CheckpointError):
    """A memory directory that is not this run's (or not readable as one)."""


def memory_dir(setting: str | None = None) -> str:
    """The memory directory: ``setting``, else ``$ZEROSTATE_MEMORY_DIR``, else the default."""
    chosen = setting or os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR
    return os.path.abspath(os.fspath(chosen))


def run_id(location: str) -> str:
    """The run id of the durable root at canonical ``location``: 16 hex digits."""
    return hashlib.sha256(location.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Holding:
    """A committed memory step as one node holds it."""

    step: int
    world_size: int
    #: crc32c of the commit record's bytes: nodes holding different records of one step
    #: number (a step saved again after a restart) do not assemble it together.
    record_crc: int
    #: Ranks whose manifest and every row the record lists are present, at their sizes.
    ranks: frozenset[int]


class MemoryTier:
    """One run's directory in one node's memory directory ([Note: memory tier layout])."""

    def __init__(self, base: str, location: str) -> None:
        self.base = base
        self.location = location
        self.run_id = run_id(location)
        self.path = os.path.join(base, f"run-{self.run_id}")
        self._root: CheckpointRoot | None = None
        #: The newest step this process committed here (None: not known, so list).
        self.newest: int | None = None

    def __repr__(self) -> str:
        return f"MemoryTier({self.path!r}, for {self.location!r})"

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def open(self, *, create: bool) -> CheckpointRoot | None:
        """The tier's root (None when it does not exist and ``create`` is False). Raises
        :class:`MemoryTierRefused` when the directory is another run's or damaged."""
        if self._root is not None:
            return self._root
        run_file = os.path.join(self.path, _RUN_FILE)
        if not os.path.isdir(self.path):
            if not create:
                return None
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        if os.path.lexists(run_file):
            self._check_run_file(run_file)
        elif create:
            doc = fmt.group_document({_RUN_KEY: {"run_id": self.run_id, "location": self.location}})
            # The ranks of a node may create it together: each writes its own partial file
            # and renames it over the same name (their contents are the same).
            partial = f"{run_file}.{os.getpid()}.partial"
            with open(partial, "wb") as f:
                f.write(doc)
            os.replace(partial, run_file)
        else:
            raise MemoryTierRefused(f"{self.path} has no {_RUN_FILE}: not a memory tier of ours")
        # In memory already: a direct write would only add a copy ([Note: direct writes]).
        self._root = CheckpointRoot(LocalStorage(self.path, direct_writes=False))
        return self._root

    def _check_run_file(self, run_file: str) -> None:
        if os.path.islink(run_file) or not os.path.isfile(run_file):
            raise MemoryTierRefused(f"{run_file} is not a regular file")
        with open(run_file, "rb") as f:
            raw = f.read(_MAX_RUN_FILE + 1)
        try:
            doc = fmt.parse_document(raw, _RUN_KEY, run_file)
        except CheckpointError as exc:
            raise MemoryTierRefused(f"{run_file} is damaged: {exc}") from exc
        if doc.get("run_id") != self.run_id or doc.get("location") != self.location:
            raise MemoryTierRefused(
                f"{self.path} belongs to another run (run id {str(doc.get('run_id'))[:40]!r}, "
                f"root {str(doc.get('location'))[:200]!r}), not to {self.location!r}"
            )

    @property
    def root(self) -> CheckpointRoot:
        root = self.open(create=True)
        assert root is not None
        return root

    # ------------------------------------------------------------------ reading
    def record(self, step: int) -> tuple[bytes, format2.StepRecord]:
        """The raw and validated commit record of a committed memory step."""
        where = f"commit record of memory step {step} in {self.path}"
        raw = self.root.storage.read(f"{fmt.step_dir(step)}/{fmt.COMMIT_PATH}")
        doc = fmt.parse_document(raw, "zerostate_commit", where)
        if fmt.check_format_version(doc, where) not in (2, 3):
            raise MemoryTierRefused(f"{where}: memory steps are written in format 2 or 3")
        return raw, format2.parse_commit_record(doc, step, where)

    def held_ranks(self, step: int, record: format2.StepRecord) -> frozenset[int]:
        """Ranks of ``step`` whose manifest and rows this node holds at the recorded sizes
        (their contents are checked by the reads)."""
        storage, directory = self.root.storage, fmt.step_dir(step)
        held = set()
        for r in range(record.world_size):
            paths = [(fmt.manifest_path(r), record.manifests[r].nbytes)]
            paths += [
                (row_path(g, r), rows[r].nbytes)  # type: ignore[union-attr]
                for g, rows in record.rows.items()
                if rows[r] is not None
            ]
            if all(_size(storage, f"{directory}/{p}") == n for p, n in paths):
                held.add(r)
        return frozenset(held)

    def intact_ranks(self, step: int, record: format2.StepRecord) -> frozenset[int]:
        """:meth:`held_ranks` less those with a row that fails its checks when re-read in
        full; none when a document, a manifest or the step itself fails them. For a load
        that met a damaged copy: it reads every byte this node holds of the step."""
        held = self.held_ranks(step, record)
        if not held:
            return held
        try:
            self.root.step(step).verify()
        except VerifyError as exc:
            if any(p.rank is None for p in exc.problems):
                return frozenset()
            return held - {p.rank for p in exc.problems}
        except (CheckpointError, OSError):
            return frozenset()
        return held

    def holdings(self, newest: int = 4) -> list[Holding]:
        """The newest ``newest`` committed steps this node holds (newest first); a step
        whose record does not validate is skipped (it cannot be trusted)."""
        root = self.open(create=False)
        if root is None:
            return []
        out = []
        for step in sorted(root.steps(), reverse=True)[:newest]:
            try:
                raw, record = self.record(step)
            except (CheckpointError, OSError):
                continue
            out.append(
                Holding(step, record.world_size, crc32c.crc32c(raw), self.held_ranks(step, record))
            )
        return out

    def nbytes(self) -> int:
        """Bytes of every file of this run's memory directory (host RAM, on tmpfs)."""
        total = 0
        for dirpath, _, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
        return total

    # ------------------------------------------------------------------ writing
    def write(self, step: int, rel: str, data: bytes | memoryview) -> None:
        """Write ``rel`` (a path inside step ``step``, validated) atomically."""
        fmt.validate_name(rel, what="memory tier path", allow_meta=True)
        storage = self.root.storage
        path = f"{fmt.step_dir(step)}/{rel}"
        storage.makedirs([path.rsplit("/", 1)[0]])
        storage.write(path, [data])

    def read(self, step: int, rel: str) -> bytes:
        fmt.validate_name(rel, what="memory tier path", allow_meta=True)
        return self.root.storage.read(f"{fmt.step_dir(step)}/{rel}")

    def sync(self) -> None:
        self.root.storage.sync_dirs()

    def clear_from(self, step: int) -> None:
        """Delete every step >= ``step``, committed or not: a save of ``step`` starts a
        new timeline, and those steps are the old one's (a run resumed from an older
        step saves over them)."""
        if self.newest is not None and step > self.newest:
            return  # this engine's own timeline, newest step known: nothing newer to drop
        root = self.open(create=False)
        if root is None:
            return
        committed, partial = root.scan()
        for s in sorted(committed + partial, reverse=True):
            if s >= step:
                root.delete_step(s)

    def retain(self, keep_last: int, saved: int) -> None:
        """Keep the newest ``keep_last`` committed steps; remove partial steps below
        ``saved`` (crashed saves)."""
        self.newest = saved
        self.root.prune(keep_last=keep_last, partial_below=saved, saved=saved)


def _size(storage: LocalStorage, path: str) -> int:
    try:
        return storage.size(path)
    except (FileNotFoundError, OSError, CheckpointError):
        return -1
