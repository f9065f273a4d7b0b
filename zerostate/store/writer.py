"""Writing one step: every rank writes the chunks it owns, then its manifest; rank 0 commits.

[Note: commit protocol]
1. Each rank writes the chunk objects it owns (``layout.chunk_owner(i) == rank``) and its
   share of the zarr metadata, durably (see [Note: durability] in ``storage.py``).
2. Once all of them are durable, the rank writes ``_zerostate/manifests/rank-<r>/zarr.json``
   listing every object it wrote with its size and crc32c.
3. Rank 0 polls storage until it has read a valid manifest from every rank, checks that
   together they cover every chunk exactly once, and writes ``_zerostate/commit/zarr.json``
   last. The step exists for readers iff that record exists.
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
from collections.abc import Callable
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
)
from zerostate.partition import TensorLayout
from zerostate.store import format as fmt
from zerostate.store.format import ChunkRecord
from zerostate.store.storage import open_storage


def _metadata_owner(name: str, layout: TensorLayout) -> int:
    """Rank that writes the array's ``zarr.json``: one of its chunk owners, picked by a
    hash of the name so the small writes spread over ranks whatever the spec order."""
    if not layout.num_chunks:
        return 0
    return layout.chunk_owner(crc32c.crc32c(name.encode()) % layout.num_chunks)


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
        fmt.dtype_name(self.dtype)
        if not isinstance(self.layout, TensorLayout):
            raise ConfigError(
                f"{self.name}: layout must be a TensorLayout (see zerostate.partition.plan_layouts)"
            )
        if self.layout.numel != math.prod(shape):
            raise ConfigError(
                f"{self.name}: layout covers {self.layout.numel} elements but "
                f"shape {shape} has {math.prod(shape)}"
            )
        attrs = dict(self.attrs or {})
        fmt.check_json(attrs, f"{self.name}: attrs")
        clash = [k for k in fmt.RESERVED_ARRAY_ATTRS if k in attrs]
        if clash:
            raise ConfigError(f"{self.name}: attrs keys {clash} are set by the store; rename them")
        object.__setattr__(self, "attrs", attrs)


class StepWriter:
    """This rank's part of saving step ``step`` under ``root``; see [Note: commit protocol].

    ``write`` may be called several times with disjoint sets of tensors; the manifest is
    written once every chunk this rank owns has been written. Every rank must pass the
    same ``specs`` (checked at commit); rank 0's ``attrs`` are the ones committed.
    ``save_id``, when given (the same string on every rank), makes rank 0 ignore manifests
    left behind by an earlier attempt at the same step.
    """

    def __init__(
        self,
        root: str,
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
        fmt.check_name_tree([s.name for s in specs])
        self._specs = {s.name: s for s in specs}
        self._tensors_json = {
            s.name: fmt.spec_json(s.name, s.shape, s.dtype, s.layout, s.attrs or {}) for s in specs
        }
        self._digest = fmt.specs_digest(self._tensors_json)
        self._storage = open_storage(root, storage_options)
        self._owned = {n: s.layout.owned_chunk(rank) for n, s in self._specs.items()}
        self._owned = {n: i for n, i in self._owned.items() if i is not None}
        self._chunks: dict[str, tuple[int, ChunkRecord]] = {}
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
    def write(self, shards: dict[str, torch.Tensor]) -> None:
        """Write this rank's owned range of the given tensors (1-D CPU, exact size)."""
        with self._lock:
            jobs = self._validate(shards)
            self._prepare()
            self._run(jobs)
            self._maybe_write_manifest()

    def _validate(self, shards: dict[str, torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
        if not isinstance(shards, dict):
            raise ConfigError(f"shards must be a dict name -> tensor, got {type(shards).__name__}")
        jobs = []
        for name, shard in shards.items():
            spec = self._specs.get(name)
            if spec is None:
                raise ConfigError(f"shard {name!r} is not among this writer's specs")
            if name in self._chunks:
                raise ConfigError(f"shard {name!r} was already written by this writer")
            start, stop = spec.layout.owned_range(self.rank)
            if not isinstance(shard, torch.Tensor):
                raise ConfigError(f"{name}: shard must be a torch.Tensor, got {type(shard)}")
            problem = None
            if shard.dtype != spec.dtype:
                problem = f"dtype {shard.dtype}, spec says {spec.dtype}"
            elif shard.device.type != "cpu":
                problem = f"on {shard.device}; copy it to CPU first"
            elif shard.dim() != 1 or shard.numel() != stop - start:
                problem = (
                    f"shape {tuple(shard.shape)}; rank {self.rank} owns elements "
                    f"[{start}, {stop}): pass a 1-D tensor of {stop - start}"
                )
            elif not shard.is_contiguous():
                problem = "not contiguous; pass shard.contiguous()"
            if problem:
                raise ConfigError(f"shard {name!r}: {problem}")
            if name in self._owned:
                jobs.append((name, self._owned[name], shard.detach()))
        return jobs

    def _metadata_files(self) -> dict[str, bytes]:
        """The zarr documents this rank writes (see [Note: step layout] in format.py)."""
        docs: dict[str, bytes] = {}
        if self.rank == 0:
            docs["zarr.json"] = fmt.group_document(
                {"zerostate": {"format_version": fmt.FORMAT_VERSION, "step": self.step}}
            )
            for group in [fmt.META_DIR, fmt.MANIFEST_DIR, *fmt.group_paths(list(self._specs))]:
                docs[f"{group}/zarr.json"] = fmt.group_document()
        for name, spec in self._specs.items():
            if _metadata_owner(name, spec.layout) == self.rank:
                docs[f"{name}/zarr.json"] = fmt.array_document(
                    spec.shape, spec.dtype, spec.layout, spec.attrs or {}
                )
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
            dirs.update(self._path(f"{name}/c") for name in self._owned)
            if self.rank == 0:
                dirs.add(self._path(fmt.COMMIT_PATH).rsplit("/", 1)[0])
            self._storage.makedirs(sorted(dirs))
        self._pending_docs = docs
        self._prepared = True

    def _run(self, jobs: list[tuple[str, int, torch.Tensor]]) -> None:
        docs = dict(self._pending_docs)  # each leaves _pending_docs once it is written
        if not jobs and not docs:
            return
        with ThreadPoolExecutor(self._num_threads, thread_name_prefix="zs-write") as pool:
            futures = {pool.submit(self._write_doc, p, d): None for p, d in docs.items()}
            futures.update({pool.submit(self._write_chunk, *job): job for job in jobs})
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    if fut.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise fut.exception()  # type: ignore[misc]
                    job = futures[fut]
                    if job is not None and self._progress is not None:
                        self._progress(job[2].numel() * job[2].element_size())
        self._storage.sync_dirs()

    def _write_doc(self, path: str, data: bytes) -> None:
        self._storage.write(self._path(path), [data])
        with self._results_lock:
            self._files[path] = ChunkRecord(len(data), crc32c.crc32c(data))
            del self._pending_docs[path]

    def _write_chunk(self, name: str, index: int, shard: torch.Tensor) -> None:
        spec = self._specs[name]
        # A byte view of the caller's tensor: written without a copy. crc32c releases the GIL.
        payload = memoryview(shard.view(torch.uint8).numpy()) if shard.numel() else b""
        pad = (spec.layout.chunk_numel - shard.numel()) * spec.dtype.itemsize
        padding = bytes(pad)  # zarr stores the edge chunk at full chunk size
        crc = crc32c.crc32c(padding, value=crc32c.crc32c(payload))
        tail = crc.to_bytes(fmt.CHECKSUM_NBYTES, "little")
        self._storage.write(self._path(fmt.chunk_path(name, index)), [payload, padding, tail])
        record = ChunkRecord(len(payload) + pad + fmt.CHECKSUM_NBYTES, crc)
        with self._results_lock:
            self._chunks[name] = (index, record)

    def _maybe_write_manifest(self) -> None:
        if (
            self._manifest_written
            or self._pending_docs
            or any(n not in self._chunks for n in self._owned)
        ):
            return
        manifest = {
            "format_version": fmt.FORMAT_VERSION,
            "kind": "manifest",
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "save_id": self._save_id,
            "specs_digest": self._digest,
            "chunks": {
                n: {"index": i, "nbytes": r.nbytes, "crc32c": r.crc32c}
                for n, (i, r) in sorted(self._chunks.items())
            },
            "files": {
                p: {"nbytes": r.nbytes, "crc32c": r.crc32c} for p, r in sorted(self._files.items())
            },
        }
        doc = fmt.group_document({"zerostate_manifest": manifest})
        self._storage.write(self._path(fmt.manifest_path(self.rank)), [doc])
        self._storage.sync_dirs()
        self._manifest_written = True

    # ----------------------------------------------------------------- commit
    def commit(self, wait: bool = True) -> None:
        """Rank 0: wait for every manifest, then write the commit record. Other ranks:
        wait (if ``wait``) until the commit record appears. Raises CommitTimeoutError."""
        with self._lock:
            if not self._manifest_written:
                missing = sorted(n for n in self._owned if n not in self._chunks)
                if missing:
                    shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                    raise ConfigError(
                        f"rank {self.rank} has not written its shards of "
                        f"{len(missing)} tensor(s): {shown}; call write() first"
                    )
                self._prepare()
                self._run([])
                self._maybe_write_manifest()
        deadline = time.monotonic() + self._timeout_s
        if self.rank == 0:
            self._commit_as_rank0(deadline)
        elif wait:
            self._wait_for_commit(deadline)

    def _commit_as_rank0(self, deadline: float) -> None:
        manifests: dict[int, dict] = {}
        delay = 0.01
        while True:
            listed = set(self._storage.list_dir(self._path(fmt.MANIFEST_DIR)))
            for r in range(self.world_size):
                if r in manifests or f"rank-{r:05d}" not in listed:
                    continue
                manifest = self._read_manifest(r)
                if manifest is not None:
                    manifests[r] = manifest
            if len(manifests) == self.world_size:
                break
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

    def _read_manifest(self, r: int) -> dict | None:
        where = f"manifest of rank {r} in {self.url}"
        try:
            raw = self._storage.read(self._path(fmt.manifest_path(r)))
        except FileNotFoundError:
            return None  # directory made, document not yet written
        manifest = fmt.parse_document(raw, "zerostate_manifest", where)
        fmt.check_format_version(manifest, where)
        if manifest.get("save_id") != self._save_id and self._save_id is not None:
            return None  # left behind by an earlier attempt; the rank will overwrite it
        if (manifest.get("step"), manifest.get("rank"), manifest.get("world_size")) != (
            self.step,
            r,
            self.world_size,
        ):
            raise CorruptCheckpointError(f"{where} names another step, rank or world size")
        if manifest.get("specs_digest") != self._digest:
            raise DistributedMismatchError(
                f"rank {r} saved step {self.step} with different tensor specs than rank 0 "
                "(names, shapes, dtypes, layouts or attrs differ); every rank must pass the "
                "same specs"
            )
        return manifest

    def _write_commit_record(self, manifests: dict[int, dict]) -> None:
        tensors = {
            n: dict(j, chunks=[None] * self._specs[n].layout.num_chunks)
            for n, j in self._tensors_json.items()
        }
        files: dict[str, dict] = {}
        for r, manifest in sorted(manifests.items()):
            chunks, docs = manifest.get("chunks"), manifest.get("files")
            if not isinstance(chunks, dict) or not isinstance(docs, dict):
                raise CorruptCheckpointError(f"manifest of rank {r} lacks chunks/files")
            for name, spec in self._specs.items():
                index = spec.layout.owned_chunk(r)
                entry = chunks.get(name)
                if (index is None) != (entry is None) or (
                    entry is not None and entry.get("index") != index
                ):
                    got = entry.get("index") if isinstance(entry, dict) else None
                    raise DistributedMismatchError(
                        f"manifest of rank {r}: tensor {name!r} chunk {got} does not match "
                        f"the layout (rank {r} owns chunk {index})"
                    )
                if entry is not None:
                    tensors[name]["chunks"][index] = {
                        "nbytes": entry["nbytes"],
                        "crc32c": entry["crc32c"],
                    }
            for path, entry in docs.items():
                fmt.validate_name(path, what="metadata path", allow_meta=True)
                files[path] = entry
        expected = {"zarr.json", *(f"{n}/zarr.json" for n in self._specs)}
        expected.update(f"{g}/zarr.json" for g in fmt.group_paths(list(self._specs)))
        expected.update({f"{fmt.META_DIR}/zarr.json", f"{fmt.MANIFEST_DIR}/zarr.json"})
        if set(files) != expected:
            raise DistributedMismatchError(
                f"step {self.step}: the manifests list metadata files "
                f"{sorted(set(files) ^ expected)[:10]} unexpectedly (missing or extra); every "
                "rank must pass the same specs"
            )
        record = {
            "format_version": fmt.FORMAT_VERSION,
            "kind": "commit",
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self._save_id,
            "attrs": self._attrs,
            "tensors": tensors,
            "files": files,
        }
        # Validate what we are about to commit exactly as a reader will.
        fmt.parse_commit_record(record, self.step, f"commit record of {self.url}")
        doc = fmt.group_document({"zerostate_commit": record})
        self._storage.write(self._path(fmt.COMMIT_PATH), [doc])
        self._storage.sync_dirs()

    def _wait_for_commit(self, deadline: float) -> None:
        delay = 0.01
        path = self._path(fmt.COMMIT_PATH)
        while True:
            if self._storage.exists(path):
                raw = self._storage.read(path)
                record = fmt.parse_document(raw, "zerostate_commit", f"commit record of {self.url}")
                if self._save_id is None or record.get("save_id") == self._save_id:
                    return
            if time.monotonic() > deadline:
                raise CommitTimeoutError(
                    f"step {self.step} at {self.url}: rank {self.rank} waited "
                    f"{self._timeout_s:g}s for rank 0's commit record; rank 0 or another rank "
                    "crashed or is slow. Raise timeout_s if they are slow"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
