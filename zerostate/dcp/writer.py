"""The DCP storage writer: each rank's chunks into its row, the metadata as JSON in the
commit record ([Note: DCP steps] in zerostate.dcp)."""

from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zerostate.dcp.common import (
    ATTR,
    GcHold,
    _check_step,
    _GlobalPlan,
    _rank_of_caller,
    _root_text,
    check_has_data,
    plain_data,
    stored_data,
)
from zerostate.dcp.document import RankParts, encode_value, metadata_json, plan_pieces, split_pieces
from zerostate.dcp.staging import StagingBuffers
from zerostate.errors import (
    CheckpointError,
    ConfigError,
)
from zerostate.store import format as fmt
from zerostate.store.root import CheckpointRoot
from zerostate.store.writer import StepExistsError, StepWriter

#: The dicts on torch's ``SavePlanner`` class where DCP's plan caching keeps its plans
#: ([Note: DCP's plan cache]); a torch without one has nothing to forget there.
_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)
_warned_plan_caching = False


def forget_cached_plans(key: str | None = None) -> None:
    """Drop the save plans DCP's plan caching keeps in this process: those under ``key``
    (a planner's cache key), or every one.

    [Note: DCP's plan cache]
    With ``DefaultSavePlanner(enable_plan_caching=True)`` (torch 2.7 and later) each process
    keeps, in dicts on the ``SavePlanner`` class, its last local plan, its last final plan
    and, on the coordinator, every rank's plans and the metadata. A rank whose plan did not
    change sends an empty plan marked unusable and, after the scatter, replays its cached
    final plan, storage data included. Our storage data is the save itself: its step, its
    save id, the row views that place the rank's pieces. Replayed, it wrote the second save
    under the first one's step (rank 1: "step 0 is already committed"; with a new
    ``checkpoint_id``, rows under the old save id that the commit cannot take), and an
    unchanged rank's pieces never reach the coordinator, which lists every piece in the
    commit record. So each save through our writer is planned afresh:
    ``set_up_storage_writer``, which runs on every rank before the planner makes its local
    plan (and on the coordinator before the global plan), forgets every cached plan of the
    process, and ``write_data`` forgets its planner's key again, so that a later save through
    another writer does not replay a plan of ours. The first hook does not see the planner,
    hence every key: another writer's cached plans in this process cost one miss, never a
    wrong plan. A plan marked unusable that reaches our writer anyway (a save planned in
    another thread between the two) fails the save in one line before anything is written.
    Caching would not save much here: our writer's own planning of a 2-rank save of the
    38 MiB ``small`` preset of ``benchmarks/dcp_plugin.py`` is about 10 ms, DCP's 41 ms."""
    for name in _PLAN_CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            if key is None:
                cache.clear()
            else:
                cache.pop(key, None)


def _check_usable(plans: list[SavePlan]) -> None:
    if any(not getattr(plan, "usable", True) for plan in plans):
        raise CheckpointError(
            "a save plan came from DCP's plan cache, which zerostate's writer cleared when this "
            "save began: another save in this process planned meanwhile; save again, one save "
            "at a time ([Note: DCP's plan cache] in zerostate/dcp/writer.py)"
        )


def _forget_planner_cache(planner: SavePlanner) -> None:
    """Forget what ``planner``'s plan caching kept of this save, and say once per process that
    it has no effect here ([Note: DCP's plan cache])."""
    global _warned_plan_caching
    key = getattr(planner, "_cached_plans_key", None)
    if isinstance(key, str):
        forget_cached_plans(key)
    if getattr(planner, "_enable_plan_caching", False) and not _warned_plan_caching:
        _warned_plan_caching = True
        warnings.warn(
            "DCP's plan caching (enable_plan_caching=True) has no effect on saves through "
            "zerostate.dcp.StorageWriter: each save is planned afresh, since its plan carries "
            "the save's step",
            stacklevel=3,
        )


class StorageWriter(dcp_storage.StorageWriter):
    """DCP's storage writer into a zerostate checkpoint root (a path or fsspec URL).

    ``step`` None saves the step after the newest committed one (0 in an empty root); a
    committed step is never overwritten (:class:`~zerostate.store.StepExistsError`).
    ``keep_last`` keeps only the newest that many committed steps after each save.
    ``checkpoint_id`` given to ``dcp.save`` replaces the root. The object is plain data
    until a save starts, so ``async_save`` may hand it to a staging process.

    It is also ``async_save``'s stager (DCP uses a storage writer that stages): the state is
    copied into CPU buffers kept from the previous save once that save is done with them
    ([Note: reused staging buffers] in zerostate.dcp.staging). ``staging`` shares one set of
    buffers between writers (``zerostate.save`` keeps one for all its non-blocking saves).
    """

    #: Staging copies before ``async_save`` returns: there is nothing to wait for after.
    _synchronize_after_execute = False

    def __init__(
        self,
        root: str | os.PathLike,
        step: int | None = None,
        keep_last: int | None = None,
        *,
        storage_options: dict | None = None,
        timeout_s: float = 600.0,
        num_threads: int = 8,
        staging: StagingBuffers | None = None,
    ) -> None:
        super().__init__()
        self.root = _root_text(root)
        self.requested_step = _check_step(step)
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise ConfigError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.timeout_s, self.num_threads = float(timeout_s), int(num_threads)
        #: The step the last save wrote (set on every rank once its plan arrives).
        self.step: int | None = None
        self._staging = staging if staging is not None else StagingBuffers()
        self._gc = GcHold()  # [Note: the heap held out of collections] in zerostate.dcp.common
        self._reset_save()

    def _reset_save(self) -> None:
        self._gc.release()  # a save that failed between hooks held it
        self._rank = 0
        self._is_coordinator = False
        self._plan: _GlobalPlan | None = None
        self._full: _GlobalPlan | None = None  # the coordinator's: every piece
        self._parts: RankParts | None = None  # the coordinator's: what each rank was sent
        self._writer: StepWriter | None = None
        self._root: CheckpointRoot | None = None

    def __getstate__(self) -> dict:
        # Staging processes get the configuration only; a save opens what it needs.
        state = dict(self.__dict__)
        state.update(_plan=None, _full=None, _parts=None, _writer=None, _root=None, _gc=GcHold())
        return state

    def _open_root(self) -> CheckpointRoot:
        if self._root is None:
            self._root = CheckpointRoot.open(
                self.root, self.storage_options or None, num_threads=self.num_threads
            )
        return self._root

    # ------------------------------------------------------------- async staging
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict:
        """A training-safe copy of ``state_dict`` for ``async_save`` to write."""
        return self._staging.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Drops the staging buffers kept for the next save and waits until the steps
        ``keep_last`` retired are removed ([Note: retention off the save's path] in
        zerostate/store/root.py)."""
        self._gc.release()
        self._staging.close()
        if self._root is not None:
            self._root.wait_for_retention()

    # ------------------------------------------------------------- DCP interface
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.root = _root_text(checkpoint_id)
        self._reset_save()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _root_text(checkpoint_id)
        except ConfigError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "zerostate.dcp.StorageWriter needs use_collectives=True: a step is committed "
                "once, by one rank, after every rank's writes are durable"
            )
        self._is_coordinator = bool(is_coordinator)
        self._rank = _rank_of_caller(kwargs)
        # Before the planner plans: no plan of this save comes from its cache.
        forget_cached_plans()  # [Note: DCP's plan cache]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _check_usable([plan])
        self._gc.hold()  # until this rank's last hook
        # The rank travels with the plan so the coordinator knows who it is.
        return dataclasses.replace(plan, storage_data=self._rank)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        try:
            return self._global_plan(plans)
        except BaseException:
            self._gc.release()
            raise

    def _global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _check_usable(plans)
        pieces = plan_pieces(plans, self._rank)
        root = self._open_root()
        # The step (None: the next after the newest committed) and the target check are
        # the save session's (zerostate.save); this also clears a crashed save's partial step.
        check = root.check_save(self.requested_step)
        if check.exists:
            raise StepExistsError(
                f"step {check.step} is already committed at {root.url}; save under another "
                "step (step=None takes the next one) or delete it first"
            )
        glob = _GlobalPlan(check.step, uuid.uuid4().hex, len(plans), self._rank, pieces)
        # Each rank gets its own pieces and the row views that place them, not the whole
        # list (quadratic in ranks); this rank, the store's rank 0, keeps every piece and
        # checks at commit that each rank wrote what it was sent.
        parts = split_pieces(pieces, len(plans))
        self._full, self._parts = glob, parts
        out = []
        for index, plan in enumerate(plans):
            r = glob.store_rank(index)
            # The coordinator's own part travels empty: it keeps the whole plan here.
            own = dataclasses.replace(
                glob, pieces=parts.pieces[r] if r else (), views=parts.views[r]
            )
            out.append(dataclasses.replace(plan, storage_data=own))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        _forget_planner_cache(planner)
        glob = plan.storage_data
        if not isinstance(glob, _GlobalPlan):
            raise CheckpointError("internal: the save plan lacks zerostate's global plan")
        if glob.store_rank(self._rank) == 0:  # the coordinator: every piece, kept here
            if self._full is None or self._full.save_id != glob.save_id:
                raise CheckpointError("internal: the coordinator lost its global plan")
            glob = self._full
        self._plan, self.step = glob, glob.step
        read: list[torch.Tensor] = []  # staged buffers this save reads, freed when it is done
        try:
            results = self._write_row(plan, planner, glob, read)
        except BaseException:
            self._gc.release()
            raise
        finally:
            self._staging.release(read)
        if not self._is_coordinator:  # its last hook: finish runs on the coordinator only
            self._gc.release()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_row(
        self, plan: SavePlan, planner: SavePlanner, glob: _GlobalPlan, read: list[torch.Tensor]
    ) -> list[WriteResult]:
        """This rank's pieces into its row and manifest; the tensors it was handed are
        appended to ``read``."""
        me = glob.store_rank(self._rank)
        mine = {(p.fqn, p.offsets): p for p in glob.pieces if p.owner == me}
        results: list[WriteResult] = []
        shards: dict[str, torch.Tensor] = {}
        # Non-tensor values first: one that cannot be stored fails the save before this
        # rank writes anything.
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = encode_value(item, planner)
                results.append(WriteResult(item.index, len(fmt.dumps(value)), ("value", value)))
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            offsets = tuple(int(o) for o in item.tensor_data.chunk.offsets)  # type: ignore[union-attr]
            piece = mine.get((item.index.fqn, offsets))
            if piece is None:
                raise CheckpointError(f"internal: no piece planned for {item.index.fqn}")
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise ConfigError(f"{item.index.fqn}: the planner gave {type(data).__name__}")
            check_has_data(data, item.index.fqn)
            data = plain_data(data.detach(), item.index.fqn)
            read.append(data)
            if tuple(data.shape) != piece.sizes or data.dtype != piece.dtype:
                raise ConfigError(
                    f"{item.index.fqn}: the planner gave a {data.dtype} tensor of shape "
                    f"{list(data.shape)} for a chunk of {piece.dtype} {list(piece.sizes)}"
                )
            # The store reads a byte view of a contiguous CPU tensor (no copy made here); a
            # complex chunk as its real pairs ([Note: complex chunks] in zerostate.dcp.common).
            shards[piece.name] = stored_data(data.to("cpu").contiguous()).reshape(-1)
            results.append(
                WriteResult(item.index, data.numel() * data.element_size(), ("piece", piece.name))
            )
        if me == 0:  # every spec, made once when planning, and the digests of the others
            if self._parts is None:
                raise CheckpointError("internal: the coordinator lost its global plan")
            specs, options = self._parts.specs, self._parts.writer_options(0)
        else:  # its own pieces, placed by the row views it was sent
            specs = [p.spec(glob.world_size) for p in glob.pieces]
            options = {"views": glob.views}
        self._writer = StepWriter(
            self._open_root().storage,
            glob.step,
            rank=me,
            world_size=glob.world_size,
            specs=specs,
            timeout_s=self.timeout_s,
            num_threads=self.num_threads,
            save_id=glob.save_id,
            **options,
        )
        try:
            self._writer.write(shards)  # every row of this rank, then its manifest
        except BaseException as exc:
            self._writer.abort(exc)
            raise
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        glob, writer = self._plan, self._writer
        if glob is None or writer is None:
            raise CheckpointError("internal: finish() before write_data()")
        values: dict[str, Any] = {}
        for rank_results in results:
            for result in rank_results:
                kind, payload = result.storage_data
                if kind == "value":
                    values[result.index.fqn] = payload
        try:
            document = metadata_json(metadata, glob.pieces, values)
            writer.commit(attrs={ATTR: document})
            # DCP calls finish on the coordinator only: the rank that listed the root.
            self._open_root().retain(glob.step, self.keep_last)
        finally:
            self._gc.release()
