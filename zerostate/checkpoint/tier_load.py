"""Loading through the memory tier: the newest step any tier can assemble, the rows a node
lacks fetched from another node's copy, the fallback to the durable root ([Note: memory
tier] in zerostate.checkpoint.tiers)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c

from zerostate.checkpoint.tiers import MemoryTiers
from zerostate.checkpoint.transfer import exchange_pairs, pack, unpack
from zerostate.errors import CheckpointError
from zerostate.store import format as fmt
from zerostate.store import format2
from zerostate.store.memory_tier import MemoryTier, MemoryTierRefused
from zerostate.store.root import CheckpointRoot
from zerostate.store.rows import row_path

log = logging.getLogger(__name__)
_HOLDINGS = 4  # memory steps each rank reports at a load


# --------------------------------------------------------------------------- loading
@dataclass(frozen=True, slots=True)
class Choice:
    step: int
    world_size: int
    record_crc: int
    #: node -> ranks of the step it holds
    held: dict[int, frozenset[int]]


def choose(
    tiers: MemoryTiers,
    durable: CheckpointRoot,
    step: int | None,
    settle: Callable[[], None],
    verify: bool = False,
) -> tuple[Choice | None, str]:
    """Collective: the memory step to load (None: the durable root's) and why. ``verify``:
    a node holds only the ranks whose rows its leader re-read and found intact
    (:meth:`~zerostate.store.memory_tier.MemoryTier.intact_ranks`), for a second try after
    a load met a damaged copy."""
    coordinator = tiers.coordinator
    tier, nodes = tiers.tier(durable.location), tiers.nodes()
    holdings, note, error = [], "", None
    try:
        settle()  # the save in flight, and the durable copy, finish first: their errors
        tiers.wait()  # are every rank's
    except Exception as exc:
        error = exc
    try:
        holdings = tier.holdings(_HOLDINGS)
    except MemoryTierRefused as exc:
        note = str(exc)
        log.warning("zerostate: memory tier refused, not read: %s", exc)
    except (CheckpointError, OSError) as exc:
        log.warning("zerostate: memory tier of %s unreadable, not read: %s", tier.path, exc)
    row = [1 if error is not None else 0, 1 if note else 0]
    for i in range(_HOLDINGS):
        h = holdings[i] if i < len(holdings) else None
        row += [h.step, h.world_size, h.record_crc] if h else [-1, -1, -1]
    rows = coordinator.exchange(row)
    coordinator.raise_if_failed(
        error,
        [bool(r[0]) for r in rows],
        "the save in flight or the memory tier's copy to the durable root",
    )
    if all(r[2] < 0 for r in rows):  # no memory step anywhere: the root's, as always
        return None, "the memory tier holds no step" + (
            " of this run" if any(r[1] for r in rows) else ""
        )
    latest = -1
    if coordinator.rank == 0 and step is None:
        try:
            latest = durable.latest_step()
        except (CheckpointError, OSError):  # no root yet, or none readable: memory only
            latest = -1
    durable_latest = coordinator.exchange([latest])[0][0]
    seen: dict[int, set[tuple[int, int]]] = {}
    for r in rows:
        for i in range(_HOLDINGS):
            s, ws, crc = r[2 + 3 * i : 5 + 3 * i]
            if s >= 0:
                seen.setdefault(s, set()).add((ws, crc))
    refused = sum(r[1] for r in rows)
    candidates = sorted(seen, reverse=True)
    if step is not None:
        candidates = [s for s in candidates if s == step]
    else:
        candidates = [s for s in candidates if s >= durable_latest]
    why = "the memory tier holds no step" + (" of this run" if refused else "")
    for s in candidates:
        if len(seen[s]) != 1:
            why = f"memory step {s} differs between nodes (saved twice); not used"
            continue
        ((ws, crc),) = seen[s]
        mine = next((h for h in holdings if h.step == s and h.record_crc == crc), None)
        ranks = mine.ranks if mine else frozenset()
        if verify:  # the leader reads the node's copy once; the others add nothing to it
            ranks = _intact(tier, s, ranks) if nodes.is_leader(coordinator.rank) else frozenset()
        words = (ws + 61) // 62
        mask = [0] * words
        for r in ranks:
            mask[r // 62] |= 1 << (r % 62)
        masks = coordinator.exchange(mask)
        held: dict[int, set[int]] = {}
        for r, m in enumerate(masks):
            got = {w * 62 + b for w in range(words) for b in range(62) if m[w] >> b & 1}
            held.setdefault(nodes.node_of[r], set()).update(got)
        if set().union(*held.values()) >= set(range(ws)):
            return Choice(s, ws, crc, {n: frozenset(v) for n, v in held.items()}), ""
        why = f"memory step {s} cannot be assembled: rows of some ranks are on no node"
    if step is None and durable_latest >= 0 and seen and max(seen) < durable_latest:
        why = f"the memory tier's newest step is older than the root's step {durable_latest}"
    return None, why


def _intact(tier: MemoryTier, step: int, held: frozenset[int]) -> frozenset[int]:
    if not held:
        return held
    try:
        return tier.intact_ranks(step, tier.record(step)[1])
    except (CheckpointError, OSError):
        return frozenset()


def assemble(tiers: MemoryTiers, durable: CheckpointRoot, choice: Choice) -> list[int]:
    """Collective: copy to each node's leader the rows (and, where it lacks the step, the
    metadata) of ``choice`` it does not hold, from the lowest rank of a node that does.
    Returns the nodes that fetched something."""
    coordinator = tiers.coordinator
    tier, nodes, rank = tiers.tier(durable.location), tiers.nodes(), coordinator.rank
    step, ws = choice.step, choice.world_size
    node_ids = sorted(set(nodes.node_of))
    everything = frozenset(range(ws))
    holder_node = {s: next(n for n in node_ids if s in choice.held.get(n, ())) for s in range(ws)}
    # (source rank, destination rank, what) in one order every rank computes alike.
    items: list[tuple[int, int, int]] = []
    fetched = []
    for n in node_ids:
        missing = sorted(everything - choice.held.get(n, frozenset()))
        if not missing:
            continue
        fetched.append(n)
        dst = nodes.leader(n)
        donor = nodes.leader(holder_node[missing[0]])
        items.append((donor, dst, -1))  # the metadata: documents, manifests, commit record
        items += [(nodes.leader(holder_node[s]), dst, s) for s in missing]
    if not items:
        return []
    error, record = None, None
    try:
        if any(src == rank for src, _, _ in items):
            _, record = tier.record(step)
    except Exception as exc:
        error = exc
    coordinator.agree(error, f"reading memory step {step} for another node")
    pending_commit: bytes | None = None
    for src, dst, what in items:
        data = bytearray()
        try:
            if rank == src:
                data = pack(_files_of(tier, step, record, what))
        except Exception as exc:
            error = exc
        coordinator.agree(error, f"sending memory step {step}'s rows to rank {dst}")
        got = exchange_pairs(
            coordinator, {dst: data} if rank == src else {}, [src] if rank == dst else []
        )
        try:
            if rank == dst:
                where = f"memory step {step} from rank {src}"
                files = unpack(got[src], where)
                if what == -1:
                    record, pending_commit = _check_meta(files, step, choice.record_crc, where)
                    for rel, content in files[:-1]:
                        tier.write(step, rel, content)
                else:
                    for rel, content in _check_rows(files, record, what, where):
                        tier.write(step, rel, content)
        except Exception as exc:
            error = exc
        coordinator.agree(error, f"receiving memory step {step} on rank {dst}")
    try:
        if pending_commit is not None:
            tier.sync()
            tier.write(step, fmt.COMMIT_PATH, pending_commit)  # last: the step is whole here
            tier.sync()
    except Exception as exc:
        error = exc
    coordinator.agree(error, f"restoring memory step {step}")
    return fetched


def _files_of(
    tier: MemoryTier, step: int, record: format2.StepRecord | None, what: int
) -> list[tuple[str, bytes]]:
    assert record is not None
    if what == -1:
        rels = sorted(record.files) + [fmt.manifest_path(r) for r in range(record.world_size)]
        raw, _ = tier.record(step)
        return [(rel, tier.read(step, rel)) for rel in rels] + [(fmt.COMMIT_PATH, raw)]
    return [
        (row_path(g, what), tier.read(step, row_path(g, what)))
        for g, rows in sorted(record.rows.items())
        if rows[what] is not None
    ]


def _check_meta(
    files: list[tuple[str, memoryview]], step: int, record_crc: int, where: str
) -> tuple[format2.StepRecord, bytes]:
    if not files or files[-1][0] != fmt.COMMIT_PATH:
        raise CheckpointError(f"{where}: no commit record")
    raw = bytes(files[-1][1])
    if crc32c.crc32c(raw) != record_crc:
        raise CheckpointError(f"{where}: not the commit record the nodes agreed on")
    doc = fmt.parse_document(raw, "zerostate_commit", where)
    record = format2.parse_commit_record(doc, step, where)
    expected = dict(record.files)
    expected.update({fmt.manifest_path(r): m for r, m in enumerate(record.manifests)})
    if {rel for rel, _ in files[:-1]} != set(expected):
        raise CheckpointError(f"{where}: the documents are not those the record lists")
    for rel, content in files[:-1]:
        entry = expected[rel]
        if len(content) != entry.nbytes or crc32c.crc32c(bytes(content)) != entry.crc32c:
            raise CheckpointError(f"{where}: {rel} differs from the commit record")
    return record, raw


def _check_rows(
    files: list[tuple[str, memoryview]], record: format2.StepRecord | None, src: int, where: str
) -> list[tuple[str, memoryview]]:
    if record is None:
        raise CheckpointError(f"{where}: rows arrived before the commit record")
    expected = {
        row_path(g, src): rows[src].nbytes  # type: ignore[union-attr]
        for g, rows in record.rows.items()
        if rows[src] is not None
    }
    if {rel for rel, _ in files} != set(expected):
        raise CheckpointError(f"{where}: rows {sorted(r for r, _ in files)[:5]} unexpected")
    for rel, content in files:
        if len(content) != expected[rel]:
            raise CheckpointError(f"{where}: {rel} is {len(content)} bytes, not as recorded")
    return files


def load(
    tiers: MemoryTiers,
    durable: CheckpointRoot,
    step: int | None,
    run: Callable[[Any, int | None], Any],
    settle: Callable[[], None],
) -> Any:
    """Collective: load the newest step any tier can assemble and say on rank 0 where it
    came from. ``run(storage, step)`` runs one ordinary load session, of the memory tier's
    storage or (``storage`` None) of the durable root as the caller named it."""
    choice, why = choose(tiers, durable, step, settle)
    if choice is not None:
        result, failed = _from_memory(tiers, durable, choice, run, "")
        if failed is None:
            return result
        # A copy failed its checks: the nodes re-read what they hold and load again from the
        # intact copies (a damaged row comes from its replica), else from the durable root.
        choice, why = choose(tiers, durable, step, lambda: None, verify=True)
        if choice is not None:
            result, again = _from_memory(tiers, durable, choice, run, f" after {failed}")
            if again is None:
                return result
            why = again
        else:
            why = f"{failed}; {why}"
    result = run(None, step)
    _report(
        tiers, f"{_durable_step(tiers, durable, step)}from the durable tier {durable.url} ({why})"
    )
    return result


def _durable_step(tiers: MemoryTiers, durable: CheckpointRoot, step: int | None) -> str:
    """Rank 0, which says it: ``"step N "`` of the durable step just loaded (its newest
    committed step, where none was named; one listing), or ``""`` where it cannot tell."""
    if tiers.coordinator.rank != 0:
        return ""
    if step is not None:
        return f"step {step} "
    try:
        return f"step {durable.latest_step()} "
    except (CheckpointError, OSError):
        return ""


def _from_memory(
    tiers: MemoryTiers,
    durable: CheckpointRoot,
    choice: Choice,
    run: Callable[[Any, int | None], Any],
    note: str,
) -> tuple[Any, str | None]:
    """Collective: ``(result, None)``, or ``(None, why)`` when the step failed to load (the
    engine left as it was)."""
    try:
        fetched = assemble(tiers, durable, choice)
        tier = tiers.tier(durable.location)
        result = run(tier.root.storage, choice.step)
    except Exception as exc:
        why = f"memory step {choice.step} failed to load ({exc})"
        if tiers.coordinator.rank == 0:
            log.warning("zerostate: %s; falling back", why)
        return None, why
    nodes = len(set(tiers.nodes().node_of))
    served = f"{nodes - len(fetched)} node(s) from their own memory"
    if fetched:
        served += f", node(s) {fetched} from their peers' replicas"
    _report(tiers, f"step {choice.step} from the memory tier: {served}{note}")
    durable.memory.own = True
    return result, None


def _report(tiers: MemoryTiers, text: str) -> None:
    tiers.last_report = f"zerostate: loaded {text}"
    if tiers.coordinator.rank == 0:  # one line, rank 0
        log.info("%s", tiers.last_report)
