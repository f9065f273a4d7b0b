"""The memory tier's policy: save a step into node-local memory with a replica on another
node, persist it to the durable root every M saves, and load the newest step any tier can
assemble.

[Note: memory tier]
``engine.save(root, tier="memory")`` (and ``zerostate.save(state, root, tier="memory")``,
whose source is a DCP state: [Note: save sources] in zerostate.checkpoint.source) runs the
ordinary save session (the save guard on the
durable ``root``, the snapshot, one :class:`~zerostate.store.writer.StepWriter` per rank)
with the writer pointed at this node's memory directory ([Note: memory tier layout] in
zerostate.store.memory_tier) instead of ``root``. Then, on the caller's thread
(``blocking=True``), or on the background thread behind the async snapshot fence over a
gloo group of its own (``blocking=False``, see ``transfer.side_group``):

1. every rank writes its rows and manifest into its node's memory directory (the writer);
2. every rank sends those files to its *partner*, the rank of the same local index on the
   next node (nodes: torchrun's ``GROUP_RANK``; ranks of one node share one memory
   directory), which writes them into its own node's memory directory;
3. every node leader (the node's lowest rank) receives every rank's manifest and writes
   the ones its node lacks, so that each node's directory lists the whole step;
4. rank 0 commits in its node's directory with the store's ordinary commit (it finds every
   manifest there), and sends the commit record and the metadata documents to the other
   node leaders, which write the documents and then the commit record, last.

Each phase ends in an agreement ([Note: failing together] in zerostate.checkpoint), so a
commit record exists on any node only after every rank's own rows and their replicas were
written. The bytes travel over torch.distributed (send/recv of byte tensors), never
through a transport of our own; nothing received is trusted: paths are validated and
rebuilt from what the receiver expects, sizes and checksums compared with the manifests
and the commit record.

Every ``memory_durable_every`` memory saves the step is copied file by file from the
memory directory to the durable root on a background thread (no second snapshot of the
engine), with the store's commit protocol: each rank copies its own rows and manifest,
rank 0 the documents, waits until every manifest is in the root and writes the same commit
record last. Retention keeps ``memory_keep_last`` memory steps per node (never the one
being persisted).

``engine.load(root)`` asks every rank which committed memory steps its node holds and
which ranks' rows it holds of each (one all-gather), takes the newest step whose rows the
nodes hold between them and that is at least as new as the root's latest committed step,
copies the rows a node lacks to that node's leader from a node holding them (a replaced
machine gets its ranks' rows back from their replicas), and then runs the ordinary load
session on the node's memory directory. Any failure there (a damaged row, a record that
does not validate) is agreed by every rank and leaves the engine as it was ([Note: nothing
lands before every rank has read] in zerostate.checkpoint.load). The load then tries once
more with what is intact: each node's leader re-reads the copy it holds against the
checksums and reports only the ranks whose rows pass, so a damaged row is fetched again
from its replica on another node; when no step can be assembled from intact copies, the
load falls back to the durable root. Rank 0 says which tiers served the step, and why.

Limits: one node has no replica (said once); a node fetching rows gets all it lacks.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c

from zerostate.checkpoint.transfer import (
    Nodes,
    broadcast_bytes,
    exchange_pairs,
    find_nodes,
    pack,
    side_group,
    unpack,
)
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store.memory_tier import MemoryTier, memory_dir
from zerostate.store.root import CheckpointRoot
from zerostate.store.rows import row_path
from zerostate.store.writer import find_abort_note, write_abort_note

log = logging.getLogger(__name__)

TIERS = ("durable", "memory")


# --------------------------------------------------------------------------- saving
class MemoryTiers:
    """The memory tier of one engine: its node directory per root, the save counter and
    the background persistence ([Note: memory tier])."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        directory: str | None,
        keep_last: int,
        durable_every: int | None,
        timeout_s: float,
    ) -> None:
        self.coordinator = coordinator
        self.directory = directory
        self.keep_last = keep_last
        self.durable_every = durable_every
        self.timeout_s = timeout_s
        self._tiers: dict[str, MemoryTier] = {}
        self._nodes: Nodes | None = None
        self.save_counts: dict[str, int] = {}
        self.executor: ThreadPoolExecutor | None = None
        self.persisting: Future | None = None
        self.persist_step: int | None = None
        self.said_single = False
        self.side_made = False
        self.side_coordinator: Coordinator | None = None
        #: The last load's one-line account of where its step came from.
        self.last_report: str | None = None

    def tier(self, location: str) -> MemoryTier:
        if location not in self._tiers:
            self._tiers[location] = MemoryTier(memory_dir(self.directory), location)
        return self._tiers[location]

    def side(self) -> Coordinator | None:
        """Collective the first time: the coordinator background memory saves use
        (:func:`~zerostate.checkpoint.transfer.side_group`; None: they run blocking)."""
        if not self.side_made:
            self.side_coordinator = side_group(self.coordinator)
            self.side_made = True
        return self.side_coordinator

    def nodes(self) -> Nodes:
        if self._nodes is None:
            self._nodes = find_nodes(self.coordinator)
        return self._nodes

    def nbytes(self) -> int:
        """Bytes of this node's memory-tier files of every root this engine used."""
        return sum(t.nbytes() for t in self._tiers.values() if t.exists())

    def wait(self) -> None:
        """Wait for the persistence in flight; re-raise its error."""
        future, self.persisting = self.persisting, None
        self.persist_step = None
        if future is not None:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
                self.executor = None

    def saving(self, durable: CheckpointRoot) -> MemorySave:
        """What a save session with ``tier="memory"`` writes through."""
        return MemorySave(self, durable, self.tier(durable.location))


class MemorySave:
    """One memory-tier save ([Note: memory tier])."""

    def __init__(self, tiers: MemoryTiers, durable: CheckpointRoot, tier: MemoryTier) -> None:
        self.tiers, self.durable, self.tier = tiers, durable, tier
        #: This save's ``memory_durable_every``, as it was when the save was called: the copy
        #: is decided on the background thread for a non-blocking save, by when the next
        #: save may have set another.
        self.durable_every = tiers.durable_every
        #: The coordinator of a background save's side group (None: on the caller's thread).
        self.background: Coordinator | None = None
        self.error: BaseException | None = None

    def prepare(self, step: int, blocking: bool, durable: CheckpointRoot) -> CheckpointRoot:
        """Collective (in the session's preparation, before its agreement): the node's
        memory root, with steps from ``step`` on (an abandoned timeline's) removed by the
        node leader; for a background save its side coordinator (:attr:`background`, None:
        run blocking). Never raises: a failure is kept for :meth:`check` (inside the
        session's agreement) and ``durable`` returned, where nothing will be written."""
        nodes = self.tiers.nodes()
        coordinator = self.tiers.coordinator
        self.background = None if blocking else self.tiers.side()
        try:
            root = self.tier.root
            if nodes.is_leader(coordinator.rank):
                self.tier.clear_from(step)
        except Exception as exc:
            self.error = exc
            return durable
        if nodes.partner[coordinator.rank] is None and not self.tiers.said_single:
            self.tiers.said_single = True
            if coordinator.rank == 0:
                log.warning(
                    "zerostate: the memory tier has one node (set GROUP_RANK per node under "
                    "torchrun): steps in memory have no replica on another node"
                )
        return root

    def newest(self) -> int | None:
        """This node's newest committed memory step (None: none, or a directory that is not
        this run's): a save that names no step takes the one after it, or after the durable
        root's newest where that is newer."""
        try:
            root = self.tier.open(create=False)
            steps = root.steps() if root is not None else []
        except Exception as exc:  # noqa: BLE001 - refused again, with its reason, in prepare()
            log.debug("zerostate: no memory steps of %s counted: %s", self.tier.path, exc)
            return None
        return steps[-1] if steps else None

    def check(self) -> None:
        """Raise what :meth:`prepare` met."""
        if self.error is not None:
            raise self.error

    def finish_background(
        self, copy: Any, writer: Any, shards: dict, step: int, keep_last: int | None
    ) -> None:
        """The background thread's part: the deferred snapshot copy, then :meth:`finish` on
        the side group, then the durable copy's turn."""
        assert self.background is not None
        if copy is not None:
            copy()
        self.finish(self.background, writer, shards, step)
        self.persist_maybe(step, keep_last)

    def finish(self, coordinator: Coordinator, writer: Any, shards: dict, step: int) -> None:
        """Write, replicate and commit (every phase agreed on ``coordinator``'s group)."""
        tier, nodes, rank = self.tier, self.tiers.nodes(), coordinator.rank
        error, own = None, []
        try:
            writer.write(shards)
            own = self._own_files(step, rank)
        except Exception as exc:
            error = exc
        coordinator.agree(error, f"writing memory step {step}")
        try:
            partner = nodes.partner[rank]
            sends = {partner: pack(own)} if partner is not None else {}
            got = exchange_pairs(coordinator, sends, nodes.source_of(rank))
            for src, data in got.items():
                self._write_replica(step, src, data)
            tier.sync()
        except Exception as exc:
            error = exc
        coordinator.agree(error, f"replicating memory step {step}")
        try:
            self._spread_manifests(coordinator, nodes, step, own[0][1])
        except Exception as exc:
            error = exc
        coordinator.agree(error, f"spreading the manifests of memory step {step}")
        meta: Any = None
        try:
            if rank == 0:
                writer.commit(wait=False)
                meta = pack(self._meta_files(step))
        except Exception as exc:
            error = exc
        # Every rank joins the broadcast, rank 0 also when its commit failed (it sends
        # nothing): a collective one rank skips leaves the others waiting in it until the
        # process group's timeout, and pairs their next collectives with the wrong ones.
        meta = broadcast_bytes(coordinator, meta, 0)
        try:
            if meta and rank != 0 and nodes.is_leader(rank):
                files = unpack(meta, f"metadata of memory step {step} from rank 0")
                for rel, data in files:  # the commit record comes last in the bundle
                    tier.write(step, rel, data)
                tier.sync()
        except Exception as exc:
            error = exc
        if meta:
            # Rank 0 committed before it sent the bundle: node 0 holds the whole step (its
            # ranks' rows and the other nodes' replicas), and a load assembles it from there
            # even when another node's copy of the record is missing. Say so, not "nothing
            # was committed".
            held = (
                f"; step {step} is committed in node 0's memory tier, which holds every "
                "rank's rows, so a load can still resume it"
            )
            if error is not None:
                cause = error
                error = CheckpointError(
                    f"committing memory step {step} on rank {rank}'s node failed: {cause}{held}"
                )
                error.__cause__ = cause
            coordinator = coordinator.with_errors(coordinator.error_cls, held)
        coordinator.agree(error, f"committing memory step {step}")
        if nodes.is_leader(rank):
            keep = self.tiers.keep_last
            try:
                pinned, running = self.tiers.persist_step, self.tiers.persisting
                if pinned is not None and running is not None and not running.done():
                    keep = max(keep, step - pinned + 1)  # never the step being persisted
                tier.retain(keep, step)
            except Exception as exc:  # retention must not fail a good save
                log.warning("zerostate: memory-tier retention in %s failed: %s", tier.path, exc)

    def _own_files(self, step: int, rank: int) -> list[tuple[str, bytes]]:
        """This rank's manifest (first) and rows, as written into this node's memory."""
        manifest = self.tier.read(step, fmt.manifest_path(rank))
        doc = fmt.parse_document(manifest, "zerostate_manifest", f"manifest of rank {rank}")
        groups = doc.get("rows")
        if not isinstance(groups, dict):
            raise CheckpointError(f"memory step {step}: rank {rank}'s manifest lacks rows")
        files = [(fmt.manifest_path(rank), manifest)]
        for group in sorted(groups):
            rel = row_path(fmt.validate_name(group, what="group"), rank)
            files.append((rel, self.tier.read(step, rel)))
        return files

    def _write_replica(self, step: int, src: int, data: memoryview) -> None:
        """Check and write rank ``src``'s files: its manifest, then rows at the sizes the
        manifest states, under the paths this rank derives for ``src``."""
        where = f"replica of rank {src}'s memory step {step}"
        files = dict(unpack(data, where))
        mpath = fmt.manifest_path(src)
        if mpath not in files:
            raise CheckpointError(f"{where}: no manifest")
        manifest = fmt.parse_document(bytes(files.pop(mpath)), "zerostate_manifest", where)
        if (manifest.get("step"), manifest.get("rank")) != (step, src):
            raise CheckpointError(f"{where}: the manifest names another step or rank")
        rows = manifest.get("rows")
        if not isinstance(rows, dict):
            raise CheckpointError(f"{where}: the manifest lacks rows")
        expected = {}
        for group, entry in rows.items():
            record = format2.parse_row(entry, f"{where}: group {str(group)[:200]!r}")
            expected[row_path(fmt.validate_name(group, what="group"), src)] = record
        if set(files) != set(expected):
            raise CheckpointError(f"{where}: files {sorted(files)[:5]} are not its rows")
        for rel, content in files.items():
            record = expected[rel]
            if record is None or len(content) != record.nbytes:
                raise CheckpointError(f"{where}: {rel} is {len(content)} bytes, not as recorded")
            self.tier.write(step, rel, content)
        self.tier.write(step, mpath, data=fmt.group_document({"zerostate_manifest": manifest}))

    def _spread_manifests(
        self, coordinator: Coordinator, nodes: Nodes, step: int, mine: bytes
    ) -> None:
        """Every node leader writes the manifests of the ranks its node has none of."""
        rank, world = coordinator.rank, coordinator.world_size
        node = nodes.node_of[rank]
        has = set(nodes.ranks(node))
        for r in nodes.ranks(node):
            has.update(nodes.source_of(r))
        leaders = sorted({nodes.leader(n) for n in set(nodes.node_of)})
        sends: dict[int, bytes | bytearray] = {}
        for leader in leaders:
            theirs = set(nodes.ranks(nodes.node_of[leader]))
            for r in nodes.ranks(nodes.node_of[leader]):
                theirs.update(nodes.source_of(r))
            if rank not in theirs:
                sends[leader] = mine
        recvs = [r for r in range(world) if r not in has] if nodes.is_leader(rank) else []
        got = exchange_pairs(coordinator, sends, recvs)
        for src, data in got.items():
            where = f"manifest of rank {src} of memory step {step}"
            manifest = fmt.parse_document(bytes(data), "zerostate_manifest", where)
            if (manifest.get("step"), manifest.get("rank")) != (step, src):
                raise CheckpointError(f"{where} names another step or rank")
            self.tier.write(step, fmt.manifest_path(src), data)
        self.tier.sync()

    def _meta_files(self, step: int) -> list[tuple[str, bytes]]:
        """Rank 0: the documents its writer wrote, then the commit record (last)."""
        raw, record = self.tier.record(step)
        files = [(rel, self.tier.read(step, rel)) for rel in sorted(record.files)]
        return [*files, (fmt.COMMIT_PATH, raw)]

    # ---------------------------------------------------------------- durable copy
    def persist_maybe(self, step: int, keep_last: int | None) -> Future | None:
        """Every ``durable_every`` memory saves: copy ``step`` to the durable root on the
        background thread. Returns its future (None: not this time)."""
        tiers = self.tiers
        count = tiers.save_counts.get(self.durable.location, 0) + 1
        tiers.save_counts[self.durable.location] = count
        if not self.durable_every or count % self.durable_every:
            return None
        tiers.wait()  # one persistence at a time; surfaces the previous one's error
        if tiers.executor is None:
            tiers.executor = ThreadPoolExecutor(1, thread_name_prefix="zs-persist")
        rank, world = tiers.coordinator.rank, tiers.coordinator.world_size
        tiers.persist_step = step
        tiers.persisting = tiers.executor.submit(
            self._persist, step, rank, world, keep_last, tiers.timeout_s
        )
        return tiers.persisting

    def _persist(
        self, step: int, rank: int, world: int, keep_last: int | None, timeout_s: float
    ) -> None:
        """Background: the store's commit protocol, from the memory copy's files. A rank
        whose part fails leaves an abort note in the step, as an async save's writer does
        ([Note: failing together] in zerostate.checkpoint), so that the others stop waiting
        for its manifest or the commit record at once instead of at the timeout."""
        tag: int | None = None
        try:
            raw, record = self.tier.record(step)
            tag = crc32c.crc32c(raw)  # this save's record: notes of other attempts differ
            self._copy_to_durable(step, rank, world, keep_last, timeout_s, raw, record, tag)
        except Exception as exc:
            if tag is not None:
                self._abort_note(step, rank, tag, exc)
            raise

    def _abort_note(self, step: int, rank: int, tag: int, error: BaseException) -> None:
        write_abort_note(self.durable.storage, fmt.step_dir(step), rank, {"record_crc": tag}, error)

    def _raise_if_aborted(self, step: int, rank: int, world: int, tag: int) -> None:
        found = find_abort_note(
            self.durable.storage, fmt.step_dir(step), rank, world, {"record_crc": tag}
        )
        if found is not None:
            other, error = found
            raise CheckpointError(
                f"persisting memory step {step} to {self.durable.url}: rank {other} failed "
                f"to copy its part ({error}); nothing was committed"
            )

    def _copy_to_durable(
        self,
        step: int,
        rank: int,
        world: int,
        keep_last: int | None,
        timeout_s: float,
        raw: bytes,
        record: Any,
        tag: int,
    ) -> None:
        # Not beside a removal of retired steps ([Note: retention off the save's path]).
        self.durable.wait_for_retention()
        storage, directory = self.durable.storage, fmt.step_dir(step)
        own = [
            row_path(g, rank) for g, rows in sorted(record.rows.items()) if rows[rank] is not None
        ]

        def put(rel: str, data: bytes) -> None:
            path = f"{directory}/{rel}"
            if storage.has_directories:
                storage.makedirs([path.rsplit("/", 1)[0]])
            storage.write(path, [data])

        if rank == 0:
            for rel in sorted(record.files):
                put(rel, self.tier.read(step, rel))
        for rel in own:
            put(rel, self.tier.read(step, rel))
        storage.sync_dirs()
        put(fmt.manifest_path(rank), self.tier.read(step, fmt.manifest_path(rank)))
        storage.sync_dirs()
        deadline, delay = time.monotonic() + timeout_s, 0.01
        if rank != 0:  # done when the step is: as an async save's ranks, they wait for it
            while not self.durable.is_committed(step):
                self._raise_if_aborted(step, rank, world, tag)
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"persisting memory step {step} to {self.durable.url}: rank {rank} "
                        f"waited {timeout_s:g}s for rank 0's commit record"
                    )
                time.sleep(delay)
                delay = min(delay * 1.5, 0.5)
            return
        pending = set(range(world))
        while pending:
            for r in sorted(pending):
                try:
                    data = storage.read(f"{directory}/{fmt.manifest_path(r)}")
                except FileNotFoundError:
                    continue
                expected = record.manifests[r]
                if len(data) == expected.nbytes and crc32c.crc32c(data) == expected.crc32c:
                    pending.discard(r)
            if pending:
                self._raise_if_aborted(step, rank, world, tag)
            if pending and time.monotonic() > deadline:
                raise CheckpointError(
                    f"persisting memory step {step} to {self.durable.url}: after {timeout_s:g}s "
                    f"ranks {sorted(pending)[:20]} have not copied their part"
                )
            if pending:
                time.sleep(delay)
                delay = min(delay * 1.5, 0.5)
        put(fmt.COMMIT_PATH, raw)
        storage.sync_dirs()
        self.durable.memory.own = True
        if keep_last is not None:
            self.durable.prune(keep_last=keep_last, partial_below=step)
