"""Writing one step (format 2): every rank writes one row object per state group, then its
manifest; rank 0 commits.

[Note: commit protocol]
1. Each rank streams its row of every group it stores bytes of (see [Note: rows] in
   ``rows.py``) as one object, durably (see [Note: durability] in ``base.py``); rank 0
   also writes the zarr group and array documents.
2. Once all of them are durable, the rank writes ``_zerostate/manifests/rank-<r>/zarr.json``
   listing every object it wrote with its size and checksums, plus its ``rank_state``.
3. Rank 0 polls storage until it has read a valid manifest from every rank, checks that
   together they hold exactly the rows the plan expects, and writes
   ``_zerostate/commit/zarr.json`` last. The step exists for readers iff that record exists.
4. Other ranks, if asked to wait, poll storage for the commit record.
Coordination goes through storage, not ``torch.distributed``, because async saves run this
on a background thread where collectives on the training process group are not allowed.
A crash at any point before 3 leaves a step directory without commit record: invisible to
readers and removable with ``remove_partial_steps``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from zerostate.errors import (
    CheckpointError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    DistributedMismatchError,
    LayoutError,
)
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import TensorLayout
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store import geometry as mesh_mod
from zerostate.store.format import ChunkRecord
from zerostate.store.refs import TensorRef
from zerostate.store.rows import LazyShard, RowView, Source, row_parts, row_path
from zerostate.store.storage import Storage, open_storage


class StepExistsError(CheckpointError, FileExistsError):
    """The step is already committed; writing it again would change a committed step."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One logical tensor of a step: its name, logical shape, dtype and chunk layout."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: TensorLayout
    attrs: dict | None = None
    mesh: MeshLayout | None = None
    """Set: the tensor is written as its tp x dp pieces ([Note: mesh tensors] in
    ``store/mesh.py``); ``shape`` is the logical shape and ``layout`` the stored array's
    (:func:`zerostate.store.geometry.stored_layout`), and the step is format 3."""

    def __post_init__(self) -> None:
        fmt.validate_name(self.name)
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{self.name}: shape must be a tuple of ints, got {self.shape!r}"
            ) from exc
        if any(d < 0 for d in shape):
            raise ConfigError(f"{self.name}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{self.name}: dtype must be a torch.dtype, got {self.dtype!r}")
        fmt.dtype_name(self.dtype, self.name)
        if not isinstance(self.layout, TensorLayout):
            raise ConfigError(
                f"{self.name}: layout must be a TensorLayout "
                "(see zerostate.layout.partition.plan_layouts)"
            )
        if self.mesh is not None:
            if not isinstance(self.mesh, MeshLayout) or tuple(self.mesh.shape) != shape:
                raise ConfigError(f"{self.name}: mesh must be a MeshLayout of shape {shape}")
            try:
                mesh_mod.check_stored(self.mesh, self.layout, self.name)
            except LayoutError as exc:
                raise ConfigError(str(exc)) from None
        elif self.layout.numel != math.prod(shape):
            raise ConfigError(
                f"{self.name}: layout covers {self.layout.numel} elements but "
                f"shape {shape} has {math.prod(shape)}"
            )
        attrs = dict(self.attrs or {})
        if attrs:  # (most specs have none: a JSON encoding each adds up at 10^5 pieces)
            fmt.check_json(attrs, f"{self.name}: attrs")
        clash = [k for k in fmt.RESERVED_ARRAY_ATTRS if k in attrs]
        if clash:
            raise ConfigError(f"{self.name}: attrs keys {clash} are set by the store; rename them")
        object.__setattr__(self, "attrs", attrs)


class StepWriter:
    """This rank's part of saving step ``step`` under ``root``; see [Note: commit protocol].

    ``root`` is a path or URL, or an open :class:`Storage` (what
    ``CheckpointRoot.writer`` passes, so a save opens its root once).

    ``write`` may be called several times with disjoint sets of tensors; a group's row is
    written as soon as every tensor this rank stores in it was given (the tensors must stay
    unchanged until then), and the manifest once every row is durable. Every rank must pass
    the same ``specs`` (checked at commit); rank 0's ``attrs`` are the ones committed.
    ``rank_state`` is a JSON object (at most 4 MiB) kept in this rank's manifest and read
    back with ``StepReader.rank_state(rank)``. ``save_id``, when given (the same string on
    every rank), makes rank 0 ignore manifests left behind by an earlier attempt.
    ``refs`` name tensors the step refers to instead of storing them (the same on every
    rank; see [Note: tensor references] in ``refs.py``): they are not written.
    ``views`` (ranks other than 0): ``specs`` are only this rank's tensors, placed in their
    groups' rows by these views; rank 0, given every spec, takes ``manifest_digests[r]``
    as the digest rank ``r``'s manifest must carry ([Note: row views] in ``rows.py``).
    """

    def __init__(
        self,
        root: str | Storage,
        step: int,
        *,
        rank: int,
        world_size: int,
        specs: list[TensorSpec],
        attrs: dict | None = None,
        storage_options: dict | None = None,
        timeout_s: float = 600.0,
        num_threads: int = 8,
        progress: Callable[[int], Any] | None = None,
        save_id: str | None = None,
        rank_state: dict | None = None,
        refs: list[TensorRef] | None = None,
        views: dict[str, RowView] | None = None,
        manifest_digests: dict[int, str] | None = None,
    ) -> None:
        if not isinstance(world_size, int) or not 1 <= world_size <= fmt.MAX_RANKS + 1:
            raise ConfigError(
                f"world_size must be an int in [1, {fmt.MAX_RANKS + 1}], got {world_size!r}"
            )
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ConfigError(f"num_threads must be a positive int, got {num_threads!r}")
        self.step, self.rank, self.world_size = step, rank, world_size
        self._dir = fmt.step_dir(step)
        self._attrs = fmt.check_json(dict(attrs or {}), "attrs")
        self._rank_state = format2.check_rank_state(rank_state)
        self._save_id = save_id
        self._timeout_s, self._num_threads, self._progress = float(timeout_s), num_threads, progress
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise ConfigError(f"specs must be TensorSpec objects, got {type(spec).__name__}")
            if spec.layout.world_size != world_size:
                raise ConfigError(
                    f"{spec.name}: layout is for world_size "
                    f"{spec.layout.world_size}, writer for {world_size}"
                )
        self._refs_json = _refs_json(refs or [], step, world_size)
        fmt.check_name_tree([s.name for s in specs] + list(self._refs_json))
        self._specs = {s.name: s for s in specs}
        if views and (rank == 0 or refs):
            raise ConfigError(
                "row views are for ranks other than 0 (rank 0 commits the step from every "
                "spec) and cannot be combined with refs"
            )
        self._tensors_json, self._plans = format2.tensor_entries(specs, world_size, views)
        meshes = any(s.mesh is not None for s in specs)
        if meshes and refs:
            raise ConfigError("a step with mesh tensors cannot refer to tensors of other steps")
        self._version = mesh_mod.VERSION if meshes else format2.VERSION
        #: The tensor entries as the commit record holds them: encoded once, with the digest.
        self._tensors_doc: dict | fmt.Encoded = self._tensors_json
        if self._refs_json or views:
            self._digest = format2.writer_digest(self._tensors_json, self._refs_json, views)
        else:
            self._digest, self._tensors_doc = format2.tensors_digest(self._tensors_json)
        #: Rank 0: the digest each rank's manifest must carry where it is not rank 0's own
        #: (ranks written with row views: [Note: row views] in ``rows.py``).
        self._manifest_digests = dict(manifest_digests or {})
        self._storage = open_storage(root, storage_options)
        # Groups this rank stores bytes of, and the tensors each row waits for.
        self._waiting = {
            g: {slot.name for _, _, slot in plan.spans(rank)}
            for g, plan in self._plans.items()
            if plan.num_present(rank)
        }
        self._sources: dict[str, Source] = {}
        self._given: set[str] = set()
        self._rows: dict[str, format2.RowRecord] = {}
        self._files: dict[str, ChunkRecord] = {}
        self._lock = threading.Lock()
        # Pool threads record results while write() holds self._lock: a separate lock.
        self._results_lock = threading.Lock()
        self._pending_docs: dict[str, bytes] = {}
        self._prepared = self._manifest_written = False

    @property
    def url(self) -> str:
        return self._storage.url_of(self._dir)

    def _path(self, rel: str) -> str:
        return f"{self._dir}/{rel}"

    # ------------------------------------------------------------------ write
    def write(self, shards: dict[str, torch.Tensor | LazyShard]) -> None:
        """Write this rank's owned range of the given tensors (1-D CPU, exact size)."""
        with self._lock:
            self._validate(shards)
            self._prepare()
            ready = [g for g, names in self._waiting.items() if names <= self._given]
            ready = [g for g in ready if g not in self._rows]
            self._run(ready)
            self._maybe_write_manifest()

    def _validate(self, shards: dict[str, torch.Tensor | LazyShard]) -> None:
        if not isinstance(shards, dict):
            raise ConfigError(f"shards must be a dict name -> tensor, got {type(shards).__name__}")
        accepted: dict[str, Source] = {}
        for name, shard in shards.items():
            spec = self._specs.get(name)
            if spec is None:
                raise ConfigError(f"shard {name!r} is not among this writer's specs")
            if name in self._given:
                raise ConfigError(f"shard {name!r} was already written by this writer")
            start, stop = spec.layout.owned_range(self.rank)
            if not isinstance(shard, (torch.Tensor, LazyShard)):
                raise ConfigError(f"{name}: shard must be a torch.Tensor, got {type(shard)}")
            numel = shard.numel if isinstance(shard, LazyShard) else shard.numel()
            problem = None
            if shard.dtype != spec.dtype:
                problem = f"dtype {shard.dtype}, spec says {spec.dtype}"
            elif isinstance(shard, LazyShard):
                if numel != stop - start:
                    problem = f"{numel} elements; rank {self.rank} owns [{start}, {stop})"
            elif shard.device.type != "cpu":
                problem = f"on {shard.device}; copy it to CPU first"
            elif shard.dim() != 1 or numel != stop - start:
                problem = (
                    f"shape {tuple(shard.shape)}; rank {self.rank} owns elements "
                    f"[{start}, {stop}): pass a 1-D tensor of {stop - start}"
                )
            elif not shard.is_contiguous():
                problem = "not contiguous; pass shard.contiguous()"
            if problem:
                raise ConfigError(f"shard {name!r}: {problem}")
            if isinstance(shard, LazyShard):
                accepted[name] = shard
            elif numel:
                # A byte view of the caller's tensor: rows of large inner chunks are written
                # from it without a copy ([Note: batched small chunks] in rows.py).
                accepted[name] = memoryview(shard.detach().view(torch.uint8).numpy()).cast("B")
        for name in shards:
            self._given.add(name)
        self._sources.update(accepted)

    def _metadata_files(self) -> dict[str, bytes]:
        """The zarr documents this rank writes: all of them on rank 0, none elsewhere."""
        if self.rank != 0:
            return {}
        docs = {
            "zarr.json": fmt.group_document(
                {"zerostate": {"format_version": self._version, "step": self.step}}
            )
        }
        for group in [fmt.META_DIR, fmt.MANIFEST_DIR, *fmt.group_paths(list(self._plans))]:
            docs[f"{group}/zarr.json"] = fmt.group_document()
        for name, plan in self._plans.items():
            docs[f"{name}/zarr.json"] = fmt.dumps(plan.array_document())
        return docs

    def _prepare(self) -> None:
        if self._prepared:
            return
        self._storage.check_writable()
        if self._storage.exists(self._path(fmt.COMMIT_PATH)):
            raise StepExistsError(
                f"step {self.step} is already committed at {self.url}; delete it first "
                "(zerostate.store.delete_step) or save under another step"
            )
        docs = self._metadata_files()
        if self._storage.has_directories:
            dirs = {self._dir, self._path(fmt.manifest_path(self.rank)).rsplit("/", 1)[0]}
            dirs.update(self._path(p).rsplit("/", 1)[0] for p in docs)
            dirs.update(self._path(row_path(g, self.rank)).rsplit("/", 1)[0] for g in self._waiting)
            if self.rank == 0:
                dirs.add(self._path(fmt.COMMIT_PATH).rsplit("/", 1)[0])
            self._storage.makedirs(sorted(dirs))
        self._pending_docs = docs
        self._prepared = True

    def _run(self, groups: list[str]) -> None:
        docs = dict(self._pending_docs)  # each leaves _pending_docs once it is written
        if not groups and not docs:
            return
        with ThreadPoolExecutor(self._num_threads, thread_name_prefix="zs-write") as pool:
            futures = {pool.submit(self._write_doc, p, d): None for p, d in docs.items()}
            futures.update({pool.submit(self._write_row, g): g for g in groups})
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    if fut.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise fut.exception()  # type: ignore[misc]
        self._storage.sync_dirs()

    def _write_doc(self, path: str, data: bytes) -> None:
        self._storage.write(self._path(path), [data])
        with self._results_lock:
            self._files[path] = ChunkRecord(len(data), crc32c.crc32c(data))
            del self._pending_docs[path]

    def _write_row(self, group: str) -> None:
        plan = self._plans[group]
        chunk_crcs = bytearray()
        index_tail = bytearray()

        def parts() -> Iterator[Any]:
            # Called again if the storage retries the upload: start from a clean slate.
            chunk_crcs.clear()
            index_tail.clear()
            for part in row_parts(plan, self.rank, self._sources, chunk_crcs):
                yield part
            index_tail.extend(part)  # the last part is the index's crc32c

        nbytes = plan.object_nbytes(self.rank)
        self._storage.write_stream(self._path(row_path(group, self.rank)), parts, nbytes)
        record = format2.RowRecord(
            nbytes, int.from_bytes(index_tail, "little"), crc32c.crc32c(bytes(chunk_crcs))
        )
        with self._results_lock:
            self._rows[group] = record
        if self._progress is not None:
            self._progress(sum(hi - lo for lo, hi, _ in plan.spans(self.rank)))

    def _maybe_write_manifest(self) -> None:
        if self._manifest_written or self._pending_docs or set(self._rows) != set(self._waiting):
            return
        manifest = {
            "format_version": self._version,
            "kind": "manifest",
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "save_id": self._save_id,
            "specs_digest": self._digest,
            "rows": {g: r.to_json() for g, r in sorted(self._rows.items())},
            "files": {
                p: {"nbytes": r.nbytes, "crc32c": r.crc32c} for p, r in sorted(self._files.items())
            },
            "rank_state": self._rank_state,
        }
        doc = fmt.group_document({"zerostate_manifest": manifest})
        if len(doc) > format2.MAX_MANIFEST_NBYTES:
            raise ConfigError(
                f"rank {self.rank}'s manifest would be {len(doc)} bytes; make rank_state smaller"
            )
        self._storage.write(self._path(fmt.manifest_path(self.rank)), [doc])
        self._storage.sync_dirs()
        self._manifest_written = True

    # ----------------------------------------------------------------- commit
    def commit(self, wait: bool = True, *, attrs: dict | None = None) -> None:
        """Rank 0: wait for every manifest, then write the commit record. Other ranks:
        wait (if ``wait``) until the commit record appears. Raises CommitTimeoutError.

        ``attrs`` (rank 0) replace the ones given at construction: a client that learns
        what to commit only after every rank wrote (``zerostate.dcp``: DCP's metadata and
        the non-tensor values gathered from all ranks) hands them over here."""
        if attrs is not None:
            # Checked when the record is encoded (_write_commit_record), not here as well: a
            # DCP step's attrs list every piece, and a second encoding of them cost rank 0
            # about a second at 256 ranks.
            self._attrs = dict(attrs)
        with self._lock:
            if not self._manifest_written:
                needed = set().union(*self._waiting.values()) if self._waiting else set()
                missing = sorted(needed - self._given)
                if missing:
                    shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                    raise ConfigError(
                        f"rank {self.rank} has not written its shards of "
                        f"{len(missing)} tensor(s): {shown}; call write() first"
                    )
                self._prepare()
                self._run([g for g in self._waiting if g not in self._rows])
                self._maybe_write_manifest()
        deadline = time.monotonic() + self._timeout_s
        if self.rank == 0:
            self._commit_as_rank0(deadline)
        elif wait:
            self._wait_for_commit(deadline)

    def _commit_as_rank0(self, deadline: float) -> None:
        manifests: dict[int, tuple[dict, bytes]] = {}
        delay = 0.01
        while True:
            ready = [r for r in range(self.world_size) if r not in manifests]
            own_listed = True
            if self._storage.listing_is_consistent:
                # One listing says which manifests exist; without a consistent listing
                # (see [Note: storage capabilities]) every missing one is read instead.
                listed = set(self._storage.list_dir(self._path(fmt.MANIFEST_DIR)))
                ready = [r for r in ready if f"rank-{r:05d}" in listed]
                own_listed = f"rank-{self.rank:05d}" in listed
            for r, manifest in zip(ready, self._read_manifests(ready), strict=True):
                if manifest is not None:
                    manifests[r] = manifest
            if len(manifests) == self.world_size:
                break
            self._raise_if_aborted()
            if not own_listed or self.rank not in manifests:
                self._raise_if_removed()
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in manifests]
                raise CommitTimeoutError(
                    f"step {self.step} at {self.url}: after {self._timeout_s:g}s rank 0 still "
                    f"lacks the manifests of ranks {missing[:20]}; they crashed or are still "
                    "writing. Raise timeout_s if they are slow; remove_partial_steps() cleans "
                    "up after a crash"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        self._write_commit_record(manifests)

    def _read_manifests(self, ranks: list[int]) -> list[tuple[dict, bytes] | None]:
        """:meth:`_read_manifest` of each rank; concurrently, so that a commit of many
        ranks waits about one round trip per batch of manifests, not one per rank."""
        if len(ranks) < 2:
            return [self._read_manifest(r) for r in ranks]
        workers = min(len(ranks), 4 * self._num_threads)
        with ThreadPoolExecutor(workers, thread_name_prefix="zs-manifest") as pool:
            return list(pool.map(self._read_manifest, ranks))

    def _read_manifest(self, r: int) -> tuple[dict, bytes] | None:
        where = f"manifest of rank {r} in {self.url}"
        try:
            raw = self._storage.read(self._path(fmt.manifest_path(r)))
        except FileNotFoundError:
            return None  # directory made, document not yet written
        manifest = fmt.parse_document(raw, "zerostate_manifest", where)
        if manifest.get("save_id") != self._save_id and self._save_id is not None:
            return None  # left behind by an earlier attempt; the rank will overwrite it
        fmt.check_format_version(manifest, where, (self._version,))
        if (manifest.get("step"), manifest.get("rank"), manifest.get("world_size")) != (
            self.step,
            r,
            self.world_size,
        ):
            raise CorruptCheckpointError(f"{where} names another step, rank or world size")
        if manifest.get("specs_digest") != self._manifest_digests.get(r, self._digest):
            raise DistributedMismatchError(
                f"rank {r} saved step {self.step} with different tensor specs than rank 0 "
                "(names, shapes, dtypes, layouts or attrs differ); every rank must pass the "
                "same specs"
            )
        return manifest, raw

    @fmt.gc_paused  # [Note: GC paused while parsing] in format.py
    def _write_commit_record(self, manifests: dict[int, tuple[dict, bytes]]) -> None:
        rows: dict[str, list[dict | None]] = {g: [None] * self.world_size for g in self._plans}
        files: dict[str, dict] = {}
        sizes = {g: p.object_sizes().tolist() for g, p in self._plans.items()}
        for r, (manifest, _) in sorted(manifests.items()):
            got, docs = manifest.get("rows"), manifest.get("files")
            if not isinstance(got, dict) or not isinstance(docs, dict):
                raise CorruptCheckpointError(f"manifest of rank {r} lacks rows/files")
            state = manifest.get("rank_state")
            if state is not None and not isinstance(state, dict):
                raise CorruptCheckpointError(f"manifest of rank {r}: rank_state is not an object")
            expected = {g for g in self._plans if sizes[g][r]}
            if set(got) != expected:
                raise DistributedMismatchError(
                    f"manifest of rank {r} lists rows of groups {sorted(got)[:10]}, the plan "
                    f"expects {sorted(expected)[:10]}; every rank must pass the same specs"
                )
            for g in expected:
                row = format2.parse_row(got[g], f"manifest of rank {r}: group {g!r}")
                if row is None or row.nbytes != sizes[g][r]:
                    raise CorruptCheckpointError(
                        f"manifest of rank {r}: group {g!r} row is {got[g]!r}, the plan says "
                        f"{sizes[g][r]} bytes"
                    )
                rows[g][r] = row.to_json()
            for path, entry in docs.items():
                fmt.validate_name(path, what="metadata path", allow_meta=True)
                files[path] = entry
        expected_files = {"zarr.json", *(f"{g}/zarr.json" for g in self._plans)}
        expected_files.update(f"{g}/zarr.json" for g in fmt.group_paths(list(self._plans)))
        expected_files.update({f"{fmt.META_DIR}/zarr.json", f"{fmt.MANIFEST_DIR}/zarr.json"})
        if set(files) != expected_files:
            raise DistributedMismatchError(
                f"step {self.step}: the manifests list metadata files "
                f"{sorted(set(files) ^ expected_files)[:10]} unexpectedly (missing or extra); "
                "every rank must pass the same specs"
            )
        record = {
            "format_version": self._version,
            "kind": "commit",
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self._save_id,
            "attrs": self._attrs,
            "tensors": self._tensors_json,
            "groups": format2.group_entries(self._plans, rows),
            "manifests": [
                {"nbytes": len(raw), "crc32c": crc32c.crc32c(raw)}
                for _, (_, raw) in sorted(manifests.items())
            ],
            "files": files,
        }
        if self._refs_json:
            record["refs"] = self._refs_json
        # Validate what we are about to commit exactly as a reader will.
        format2.parse_commit_record(record, self.step, f"commit record of {self.url}")
        try:
            doc = fmt.group_document({"zerostate_commit": {**record, "tensors": self._tensors_doc}})
        except (TypeError, ValueError) as exc:  # attrs given to commit() that JSON cannot hold
            raise ConfigError(
                f"step {self.step}: attrs must be JSON-serialisable without NaN/inf ({exc}); "
                "nothing was committed"
            ) from exc
        if len(doc) > fmt.MAX_DOCUMENT_NBYTES:
            # A reader refuses a larger document: committing it would leave a step that
            # saved and cannot be opened.
            raise CheckpointError(
                f"step {self.step} at {self.url}: its commit record would be {len(doc)} "
                f"bytes, over the {fmt.MAX_DOCUMENT_NBYTES} a reader accepts, so nothing was "
                f"committed. It lists every tensor of the step ({len(self._tensors_json)} "
                "here; a DCP step has one per chunk, about ranks x tensors): save fewer, "
                "larger tensors, or the state in parts under separate roots"
            )
        self._storage.write(self._path(fmt.COMMIT_PATH), [doc])
        self._storage.sync_dirs()

    def abort(self, error: BaseException) -> None:
        """Leave a note that this rank's part of the save failed, so that rank 0 and the
        others stop waiting for the commit at once instead of at the timeout. Best effort:
        the storage that failed may refuse the note too (then the timeout applies)."""
        write_abort_note(self._storage, self._dir, self.rank, {"save_id": self._save_id}, error)

    def _raise_if_aborted(self) -> None:
        found = find_abort_note(
            self._storage, self._dir, self.rank, self.world_size, {"save_id": self._save_id}
        )
        if found is not None:
            rank, error = found
            raise CheckpointError(
                f"step {self.step} at {self.url}: rank {rank} failed to save its part "
                f"({error}); nothing was committed"
            )

    def _raise_if_removed(self) -> None:
        """Raise if this rank's manifest, written before it began to wait, is gone: the
        step was deleted under the save (``remove_partial_steps`` run too early, a retention
        job), so no commit can come and waiting for the timeout would only hide that."""
        if not self._storage.exists(self._path(fmt.manifest_path(self.rank))):
            raise CheckpointError(
                f"step {self.step} at {self.url}: the step was removed while rank {self.rank} "
                "waited for the commit (remove_partial_steps or another cleanup ran during "
                "the save); nothing was committed"
            )

    def _wait_for_commit(self, deadline: float) -> None:
        delay = 0.01
        commit_path = self._path(fmt.COMMIT_PATH)
        while True:
            # One listing a poll says whether the step is committed, aborted or gone;
            # without a consistent listing, look at each of them directly.
            if self._storage.listing_is_consistent:
                present = set(self._storage.list_dir(self._path(fmt.META_DIR)))
            else:
                meta = (fmt.COMMIT_PATH, fmt.ABORT_DIR, fmt.MANIFEST_DIR)
                present = {_meta_entry(p) for p in meta}
            if _meta_entry(fmt.COMMIT_PATH) in present:
                try:
                    raw = self._storage.read(commit_path)
                except FileNotFoundError:
                    raw = None  # its directory is made, the record not yet written
                if raw is not None:
                    where = f"commit record of {self.url}"
                    record = fmt.parse_document(raw, "zerostate_commit", where)
                    if self._save_id is None or record.get("save_id") == self._save_id:
                        return
            if _meta_entry(fmt.ABORT_DIR) in present:
                self._raise_if_aborted()
            if _meta_entry(fmt.MANIFEST_DIR) not in present:
                self._raise_if_removed()
            if time.monotonic() > deadline:
                raise CommitTimeoutError(
                    f"step {self.step} at {self.url}: rank {self.rank} waited "
                    f"{self._timeout_s:g}s for rank 0's commit record; rank 0 or another rank "
                    "crashed or is slow. Raise timeout_s if they are slow"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)


def _refs_json(refs: list[TensorRef], step: int, world_size: int) -> dict[str, dict]:
    out = {}
    for ref in refs:
        if not isinstance(ref, TensorRef) or not isinstance(ref.spec, TensorSpec):
            raise ConfigError(f"refs must be TensorRef objects with a TensorSpec, got {ref!r}")
        if not isinstance(ref.step, int) or not 0 <= ref.step < step:
            raise ConfigError(
                f"{ref.spec.name}: a reference must name an older step than {step}, "
                f"got {ref.step!r}"
            )
        if ref.spec.layout.world_size != world_size:
            raise ConfigError(f"{ref.spec.name}: reference layout is for another world size")
        out[ref.spec.name] = ref.to_json()
    return dict(sorted(out.items()))


def _meta_entry(path: str) -> str:
    """The entry of ``fmt.META_DIR`` that ``path`` (a path under it) lies in."""
    return path[len(fmt.META_DIR) + 1 :].split("/", 1)[0]


def write_abort_note(
    storage: Storage, directory: str, rank: int, tag: dict, error: BaseException
) -> None:
    """Best effort: leave a note in step ``directory`` that ``rank``'s part of a save (the
    attempt ``tag`` names: ``{"save_id": ...}`` or another key) failed; the storage that
    failed may refuse it too, and then the others wait for their timeout."""
    note = {"rank": rank, **tag, "error": str(error)[:2000]}
    path = f"{directory}/{fmt.abort_path(rank)}"
    try:
        if storage.has_directories:
            storage.makedirs([path.rsplit("/", 1)[0]])
        storage.write(path, [fmt.group_document({"zerostate_abort": note})])
        storage.sync_dirs()
    except Exception:  # noqa: BLE001 - the original error is the one that matters
        pass


def find_abort_note(
    storage: Storage, directory: str, rank: int, world_size: int, tag: dict
) -> tuple[int, str] | None:
    """``(rank, error)`` of another rank's abort note in step ``directory`` left by the
    attempt ``tag`` names (a tag value None matches any attempt), or None."""
    for entry in storage.list_dir(f"{directory}/{fmt.ABORT_DIR}"):
        other = _abort_rank(entry, world_size)
        if other is None or other == rank:
            continue
        try:
            raw = storage.read(f"{directory}/{fmt.abort_path(other)}")
            note = fmt.parse_document(raw, "zerostate_abort", f"abort note of rank {other}")
        except (FileNotFoundError, CorruptCheckpointError):
            continue  # still being written, or not a note of ours
        if any(v is not None and note.get(k) != v for k, v in tag.items()):
            continue  # left by another attempt at this step
        return other, str(note.get("error"))[:500]
    return None


def _abort_rank(entry: str, world_size: int) -> int | None:
    """The rank of an abort note's directory name ``rank-<5 digits>``, if valid."""
    if len(entry) == 10 and entry.startswith("rank-") and entry[5:].isdigit():
        rank = int(entry[5:])
        return rank if rank < world_size else None
    return None
