"""A checkpoint root: the one object that owns a root's storage.

A root (a directory or URL holding ``step-<8 digits>/`` steps) is opened once, and that one
:class:`CheckpointRoot` lists its steps, opens them for reading, makes the writers of new
ones, runs retention and answers the save guard, and carries the guard's memory of what
one engine did there (:class:`SaveMemory`). An engine opens each root it saves to or loads
from once and keeps it for its life (``zerostate.checkpoint.roots``): one storage client per
root, one listing where the guard needs one.

Every operation that deletes is here, so the ordering rules that keep a root consistent
through a crash live in one place: a commit record is removed before its step's data, and
committed steps are deleted newest first (see [Note: tensor references] in ``refs.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from zerostate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ZerostateError,
)
from zerostate.store import format as fmt
from zerostate.store import refs
from zerostate.store.base import BATCH_THREADS, Storage
from zerostate.store.reader import StepReader
from zerostate.store.storage import open_storage

log = logging.getLogger(__name__)

RootLike = str | os.PathLike | Storage


@dataclass(frozen=True, slots=True)
class SaveCheck:
    """Rank 0's findings before a save of one step (:meth:`CheckpointRoot.check_save`)."""

    #: Committed steps of the root, ascending, as listed before the save.
    committed: tuple[int, ...]
    #: Why the save must not write there (another model's root, a step directory), or None.
    refusal: str | None = None
    #: The root's latest committed step when it is newer than the step and that is refused.
    newer: int | None = None
    #: Whether the step is already committed.
    exists: bool = False
    #: The step checked: the one asked for, or the one after the newest committed.
    step: int = 0

    @property
    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None

    @property
    def ok(self) -> bool:
        return self.refusal is None and self.newer is None and not self.exists


@dataclass(slots=True)
class SaveMemory:
    """What one engine remembers of a root it used: the save guard's memory ([Note: save
    target]). Shared by every root object of one location (one engine may reach a location
    with two sets of storage options); a root opened on its own starts with an empty one."""

    shapes_checked: bool = False
    """Whether the guard already compared the model in the root with this engine's."""
    own: bool = False
    """Whether this engine loaded from the root or committed a step to it: saving an older
    step there is resuming or rewinding this run, not landing beside another run's steps."""


#: Commit records :meth:`CheckpointRoot.latest_step` checks at once, newest step first:
#: as many as an object store's batched existence checks run concurrently.
LATEST_BATCH = BATCH_THREADS


class CheckpointRoot:
    """A checkpoint root: its storage, its steps, their readers and writers, retention."""

    def __init__(
        self, storage: Storage, num_threads: int = 8, memory: SaveMemory | None = None
    ) -> None:
        if not isinstance(storage, Storage):
            raise ConfigError(f"CheckpointRoot needs a Storage, got {type(storage).__name__}")
        self._storage = storage
        self._num_threads = num_threads
        self._location: str | None = None
        #: The save guard's memory of this root ([Note: save target]).
        self.memory = SaveMemory() if memory is None else memory
        # (step, committed, partial) as check_save listed them before a save of that step:
        # retention after it reuses them ([Note: one scan per save]).
        self._save_scan: tuple[int, list[int], list[int]] | None = None
        # Removing the data of steps retention retired, after a save ([Note: retention
        # off the save's path]).
        self._retiring: threading.Thread | None = None

    @classmethod
    def open(
        cls, root: RootLike | CheckpointRoot, storage_options: dict | None = None, **kwargs: Any
    ) -> CheckpointRoot:
        """``root`` as a :class:`CheckpointRoot`: a path or URL is opened (nothing is read
        yet), a :class:`Storage` is wrapped, an open root is returned as it is."""
        if isinstance(root, CheckpointRoot):
            if storage_options:
                raise ConfigError("storage_options were given with an already open root")
            return root
        if isinstance(root, Storage):
            if storage_options:
                raise ConfigError("storage_options were given with an already open Storage")
            return cls(root, **kwargs)
        return cls(open_storage(root, storage_options), **kwargs)

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def num_threads(self) -> int:
        """Read threads of each step this root opens."""
        return self._num_threads

    @property
    def url(self) -> str:
        return self._storage.url

    @property
    def location(self) -> str:
        """Canonical identity of the root (``storage.canonical_location``), computed once."""
        if self._location is None:
            self._location = self._storage.location
        return self._location

    def __repr__(self) -> str:
        return f"CheckpointRoot({self.url!r})"

    # ----------------------------------------------------------------- listing
    def scan(self) -> tuple[list[int], list[int]]:
        """``(committed, partial)`` steps, ascending: one listing of the root and one
        existence check of each step's commit record."""
        committed, partial = [], []
        dirs = sorted(self._step_dirs().items())
        records = self._storage.exists_many([f"{name}/{fmt.COMMIT_PATH}" for _, name in dirs])
        for (step, _), has_record in zip(dirs, records, strict=True):
            (committed if has_record else partial).append(step)
        return committed, partial

    def steps(self) -> list[int]:
        """Committed steps (those with a commit record), ascending.

        A damaged commit record still lists its step; opening it raises
        CorruptCheckpointError rather than silently rolling back to an older step.
        """
        return self.scan()[0]

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` has a commit record (one existence check, no listing)."""
        return self._storage.exists(f"{fmt.step_dir(step)}/{fmt.COMMIT_PATH}")

    def latest_step(self) -> int:
        """The newest committed step: one listing, then the commit records checked from
        the newest step down, a batch at a time, until one exists. A root of many steps
        costs a batch of existence checks, not one per step (on an object store a request
        each, every rank at every load)."""
        dirs = sorted(self._step_dirs().items(), reverse=True)
        partial: list[int] = []
        for i in range(0, len(dirs), LATEST_BATCH):
            batch = dirs[i : i + LATEST_BATCH]
            records = self._storage.exists_many([f"{n}/{fmt.COMMIT_PATH}" for _, n in batch])
            for (step, _), has_record in zip(batch, records, strict=True):
                if has_record:
                    return step
                partial.append(step)
        # A missing directory or bucket lists as empty: name that cause instead.
        self._storage.check_readable()
        hint = f" (only partial, uncommitted steps: {sorted(partial)[-5:]})" if partial else ""
        raise CheckpointNotFoundError(f"no committed step under {self.url}{hint}")

    def _step_dirs(self) -> dict[int, str]:
        out = {}
        for name in self._storage.list_dir(""):
            step = fmt.parse_step_dir(name)
            if step is not None:
                out[step] = name
        return out

    # ----------------------------------------------------------------- reading
    def step(self, step: int | None = None) -> Any:
        """Open a committed step (the latest when ``step`` is None): a format-1
        :class:`~zerostate.store.reader.StepReader` or a format-2
        :class:`~zerostate.store.reader_v2.StepReaderV2`."""
        if step is None:
            step = self.latest_step()
        directory = fmt.step_dir(step)
        where = f"commit record of {self._storage.url_of(directory)}"
        try:
            raw = self._storage.read(f"{directory}/{fmt.COMMIT_PATH}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {self.url} (committed steps: "
                f"{self.steps()[-10:]})"
            ) from None
        record = fmt.parse_document(raw, "zerostate_commit", where)
        if fmt.check_format_version(record, where) in (2, 3):  # 3: [Note: mesh tensors]
            from zerostate.store import format2
            from zerostate.store.reader_v2 import StepReaderV2

            parsed = format2.parse_commit_record(record, step, where)
            holders = self._holders(parsed, where)
            return StepReaderV2(self._storage, directory, step, parsed, self._num_threads, holders)
        world_size, attrs, tensors, files = fmt.parse_commit_record(record, step, where)
        return StepReader(
            self._storage, directory, step, world_size, attrs, tensors, files, self._num_threads
        )

    def _holders(self, parsed: Any, where: str) -> dict[int, Any]:
        """The older steps a step refers to ([Note: tensor references] in ``refs.py``)."""
        holders = {}
        for holder in sorted({k for _, k in parsed.refs.values()}):
            names = sorted(n for n, (_, k) in parsed.refs.items() if k == holder)
            try:
                holders[holder] = self.step(holder)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                shown = ", ".join(repr(n) for n in names[:5])
                raise CorruptCheckpointError(
                    f"{where}: tensor(s) {shown}{' ...' if len(names) > 5 else ''} are held "
                    f"by step {holder}, which cannot be opened: {exc}"
                ) from exc
        return holders

    # ----------------------------------------------------------------- writing
    def writer(self, step: int, **kwargs: Any) -> Any:
        """A :class:`~zerostate.store.writer.StepWriter` of ``step`` into this root (the
        keyword arguments are the writer's), on this root's storage."""
        from zerostate.store.writer import StepWriter

        self.wait_for_retention()
        return StepWriter(self._storage, step, **kwargs)

    def check_save(
        self,
        step: int | None,
        *,
        model_shapes: dict[str, tuple[int, ...]] | None = None,
        newer_ok: bool = True,
        clean: bool = True,
    ) -> SaveCheck:
        """Rank 0's save guard before a save of ``step``, from one listing of the root:
        why the save must not write there (with ``model_shapes``: :meth:`save_refusal`),
        a newer committed step (unless ``newer_ok``), or ``step`` already committed. When
        none holds, a partial directory of ``step`` left by a crashed save is removed so
        the new save starts clean (unless ``clean`` is False: a save that writes elsewhere,
        the memory tier, whose copy of a step to this root may be that partial directory);
        nothing else is changed. ``step`` None checks the step after the newest committed
        one (0 in an empty root); the check says which."""
        self.wait_for_retention()  # the last save's retired steps gone before this one
        committed, partial = self.scan()
        if step is None:
            step = committed[-1] + 1 if committed else 0
        self._save_scan = (step, list(committed), list(partial))
        refusal = None if model_shapes is None else self.save_refusal(model_shapes, committed)
        newer = None
        if not newer_ok and committed and committed[-1] > step:
            newer = committed[-1]
        check = SaveCheck(tuple(committed), refusal, newer, step in committed, step)
        if clean and check.ok and step in partial:
            self._remove_partial([step], set(committed))
        return check

    def save_refusal(
        self, model_shapes: dict[str, tuple[int, ...]], committed: list[int] | None = None
    ) -> str | None:
        """Why a save of a model with these ``model/`` tensor shapes must not write into
        this root, or None. ``committed``: the root's committed steps when the caller has
        just listed them.

        [Note: save target]
        A root is refused when it lies inside a step directory of a checkpoint (``.../step-
        00000100/``), or when its latest committed step holds a different model (other
        ``model/`` tensor names or shapes): that is another run's root reused by accident,
        where this run's steps would interleave with the other's, a later ``load`` could
        pick the other run's step, and ``keep_last`` would delete the other run's steps.
        Names and shapes are logical, so a root written at another world size (or
        compiled, see [Note: canonical names]) is the same model. ``engine.save`` checks it
        once per root per engine.
        """
        refusal = _inside_step_dir(self.location)
        if refusal is not None:
            return refusal
        try:
            if committed is None:
                committed = self.steps()
            if not committed:
                return None
            latest = committed[-1]
            with self.step(latest) as st:
                tensors = st.tensors
            theirs = {n: tuple(i.shape) for n, i in tensors.items() if n.startswith("model/")}
        except ZerostateError as exc:
            return f"cannot check the save path {self.url!r}: {exc}"
        if theirs == model_shapes:
            return None
        only = set(theirs) ^ set(model_shapes)
        differ = sorted(only) or sorted(n for n in theirs if theirs[n] != model_shapes[n])
        name = differ[0]
        if name in only:
            why = "only in this model" if name in model_shapes else "only in the checkpoint"
        else:
            why = f"shape {theirs[name]} there, {model_shapes[name]} here"
        return (
            f"{self.url!r} already holds checkpoints of a different model (latest step "
            f"{latest}: {name!r} {why}; {len(differ)} tensor(s) differ). Saving there "
            "would mix two runs, and keep_last would delete the other run's steps: save to a "
            "new directory, or delete the old steps first"
        )

    # --------------------------------------------------------------- retention
    def remove_partial(
        self, *, only_step: int | None = None, below_step: int | None = None
    ) -> list[int]:
        """Delete step directories that have no commit record (crashed or abandoned saves).

        ``only_step`` limits this to one step; ``below_step`` to steps smaller than it. Never
        call it while a save of an affected step may be in flight. Returns the steps removed.
        """
        self.wait_for_retention()
        if only_step is not None:
            directory = fmt.step_dir(only_step)
            listed = directory in self._storage.list_dir("")
            commit = f"{directory}/{fmt.COMMIT_PATH}"
            partial = [only_step] if listed and not self._storage.exists(commit) else []
            committed = None
        else:
            committed_list, partial = self.scan()
            committed = set(committed_list)
        removed = [s for s in partial if below_step is None or s < below_step]
        if removed and committed is None:
            committed = set(self.scan()[0])
        return self._remove_partial(removed, committed or set())

    def _remove_partial(self, candidates: list[int], committed: set[int]) -> list[int]:
        if candidates:  # see [Note: tensor references] in refs.py
            referenced = refs.kept_steps(self._storage, committed)
            candidates = [s for s in candidates if referenced is not None and s not in referenced]
        self._remove_trees(candidates)
        return candidates

    def prune(
        self,
        *,
        keep_last: int | None,
        partial_below: int | None,
        saved: int | None = None,
        background: bool = False,
    ) -> tuple[list[int], list[int]]:
        """Retention in one scan: delete partial steps below ``partial_below`` (crashed
        saves) and all but the newest ``keep_last`` committed steps (the newest is always
        kept). Returns ``(committed steps deleted, partial steps deleted)``.

        ``saved``: the step a save through this root object just committed; retention then
        reuses the listing its :meth:`check_save` of that step made instead of listing
        again (a root object lives as long as its engine, so the listing is taken only by
        the save it was made for). ``background``: the retired steps' data is removed on a
        thread of its own ([Note: retention off the save's path]).

        [Note: one scan per save]
        A save lists the root once, in rank 0's save guard (:meth:`check_save`: one listing
        and one existence check per step directory; on an object store a LIST and a HEAD
        each). Retention after the commit needs the same facts, and the save's own step is
        the only one this run added since, so it reuses them. What another process did in
        between can only make that view stale in safe directions: a step committed since is
        missing from it, so fewer old steps count as surplus; a partial step is deleted only
        after its commit record is checked again, so a save that committed meanwhile is
        never taken for a crashed one.
        """
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.wait_for_retention()
        scan, self._save_scan = self._save_scan, None
        if saved is not None and scan is not None and scan[0] == saved:
            committed = sorted({*scan[1], saved})
            partial = [s for s in scan[2] if s != saved]
            recheck = True
        else:
            (committed, partial), recheck = self.scan(), False
        stale = [s for s in partial if partial_below is not None and s < partial_below]
        if stale and recheck:
            records = self._storage.exists_many(
                [f"{fmt.step_dir(s)}/{fmt.COMMIT_PATH}" for s in stale]
            )
            stale = [s for s, has_record in zip(stale, records, strict=True) if not has_record]
        old = committed[:-keep_last] if keep_last else []
        if old:  # steps the kept ones refer to stay ([Note: tensor references] in refs.py)
            kept = refs.kept_steps(self._storage, set(committed[-keep_last:]))
            old = [s for s in old if kept is not None and s not in kept]
        # Every retired step's commit record goes first, newest first (references point to
        # older steps, so a crash part-way leaves no committed step whose holder is gone),
        # and is durable before any data goes: from here they are partial steps.
        for step in sorted(old, reverse=True):
            self._storage.remove(f"{fmt.step_dir(step)}/{fmt.COMMIT_PATH}")
        if old:
            self._storage.sync_dirs()
        doomed = [*stale, *sorted(old, reverse=True)]
        if background and doomed:
            self._retiring = threading.Thread(
                target=self._remove_retired, args=(doomed,), name="zs-retire"
            )
            self._retiring.start()
        elif doomed:
            self._remove_trees(doomed)
        return old, stale

    def _remove_trees(self, steps: list[int]) -> None:
        for step in steps:
            self._storage.remove_tree(fmt.step_dir(step))
        self._storage.sync_dirs()

    def _remove_retired(self, steps: list[int]) -> None:
        """The retirement thread's work: never raises (the steps are already partial, and a
        later retention removes what is left)."""
        try:
            self._remove_trees(steps)
        except Exception as exc:
            log.warning(
                "zerostate: removing the data of retired steps %s in %s failed (they are no "
                "longer committed; a later save's retention removes them): %s",
                steps,
                self.url,
                exc,
            )

    def wait_for_retention(self) -> None:
        """Wait until the data of the steps the last retention retired is removed ([Note:
        retention off the save's path]). Every operation of this root that writes or deletes
        steps waits for it first; a process waits for it before it exits."""
        retiring = self._retiring  # kept: every caller, of any thread, waits for it
        if retiring is not None and retiring is not threading.current_thread():
            retiring.join()

    def retain(self, step: int, keep_last: int | None) -> None:
        """Retention after a save through this root committed ``step`` (:meth:`prune`
        of the partial steps below it, left by crashed saves, and all but the newest
        ``keep_last`` committed); never fails the save, whose step is already committed.

        [Note: retention off the save's path]
        Removing a step's data is the filesystem freeing its blocks (or an object store
        deleting its objects), and it grows with the step: 0.07 s for the 294 MB of two
        row objects on this project's machine (ext4), twice as long as the rest of a 2-rank
        save's commit, and every rank of a save waits for it. So a save retires
        steps in two parts. Before it returns, each retired step's commit record is
        removed (newest first) and the removal made durable: from then on no reader,
        listing or later save sees those steps as committed. Their data is then removed on
        a thread of this root, while training goes on. The next operation of this root that
        writes or deletes steps (the next save's guard above all) waits for that thread
        first, so two removals never overlap and no save writes beside one (a listing or a
        read need not wait: a step being removed is already partial); the thread is not a
        daemon, so a process that exits waits for it. A crash in between
        leaves partial steps, which the next save's retention removes as it removes any
        crashed save's."""
        try:
            self.prune(keep_last=keep_last, partial_below=step, saved=step, background=True)
        except Exception as exc:  # retention must not fail a good save
            log.warning("zerostate: retention in %s after step %d failed: %s", self.url, step, exc)

    def delete_step(self, step: int) -> None:
        """Delete one step, committed or not (the commit record first). Refused while
        another committed step refers to its tensors."""
        self.wait_for_retention()
        if fmt.step_dir(step) not in self._storage.list_dir(""):
            raise CheckpointNotFoundError(f"no step {step} under {self.url}")
        others = [s for s in self.scan()[0] if s != step]
        # A step whose references cannot be read counts as referring: deleting is undoable.
        referrers = [s for s in others if step in (refs.kept_steps(self._storage, {s}) or {step})]
        if referrers:
            raise CheckpointError(
                f"step {step} under {self.url} holds tensors that steps {referrers[:10]} "
                "refer to; delete those steps first (or consolidate/reshard one of them, "
                "which writes every tensor)"
            )
        self._delete_dir(step)
        self._storage.sync_dirs()

    def _delete_dir(self, step: int) -> None:
        # The commit record goes first, so a crash while deleting leaves a partial step,
        # never a committed step with missing chunks.
        directory = fmt.step_dir(step)
        self._storage.remove(f"{directory}/{fmt.COMMIT_PATH}")
        self._storage.sync_dirs()
        self._storage.remove_tree(directory)


def _inside_step_dir(location: str) -> str | None:
    inside = [p for p in location.split("://", 1)[1].split("/") if fmt.parse_step_dir(p)]
    if not inside:
        return None
    return (
        f"save path {location!r} lies inside the step directory {inside[-1]!r} of a "
        "checkpoint; pass the checkpoint root (the directory holding step-* directories) "
        "or a new directory"
    )


# ------------------------------------------------------------- by path or URL
def open_checkpoint(
    root: RootLike, storage_options: dict | None = None, *, num_threads: int = 8
) -> CheckpointRoot:
    """Open a checkpoint root (path or fsspec URL) for reading. Nothing is read yet."""
    return CheckpointRoot.open(root, storage_options, num_threads=num_threads)


def remove_partial_steps(
    root: RootLike,
    storage_options: dict | None = None,
    *,
    only_step: int | None = None,
    below_step: int | None = None,
) -> list[int]:
    """:meth:`CheckpointRoot.remove_partial` of the root at ``root``."""
    return CheckpointRoot.open(root, storage_options).remove_partial(
        only_step=only_step, below_step=below_step
    )


def prune_steps(
    root: RootLike,
    *,
    keep_last: int | None,
    partial_below: int | None,
    storage_options: dict | None = None,
) -> tuple[list[int], list[int]]:
    """:meth:`CheckpointRoot.prune` of the root at ``root``."""
    return CheckpointRoot.open(root, storage_options).prune(
        keep_last=keep_last, partial_below=partial_below
    )


def delete_step(root: RootLike, step: int, storage_options: dict | None = None) -> None:
    """:meth:`CheckpointRoot.delete_step` of the root at ``root``."""
    CheckpointRoot.open(root, storage_options).delete_step(step)
