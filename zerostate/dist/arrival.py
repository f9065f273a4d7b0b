"""Arriving at a collective call together, with a deadline: the protocol, over the process
group's key-value store (reached through :mod:`zerostate.dist.collectives`).

[Note: arrival deadline]
A collective call (save, load, full_state_dict) entered by only some ranks would block
them inside the first torch collective until the process group's timeout (30 minutes by
default, and NCCL may never return). So each such call first announces itself in the
process group's key-value store (the TCPStore torchrun and init_process_group set up),
outside the group's collectives, and waits for every rank's announcement with a
deadline. Each rank also counts itself in (an atomic add); the last one in sets the
verdict "ok", the others block in the store (wait, no polling) until a verdict exists or
their deadline passes, when they set it to the list of ranks still missing. The verdict
is decided once (compare_set keeps the first one written), and every rank abides
by the stored verdict, so a rank arriving just after another gave up fails too instead of
entering a collective alone. Calls are numbered per group on each rank; a rank that never
entered one call fails its next call against the stale verdict, which puts the numbering
back in step. Each rank names its call, so ranks in different calls (one in save, one in
load) fail with a message naming both.

The store lives in one process: rank 0 under a plain init_process_group, the agent under
torchrun. When nothing collective follows the call (full_state_dict at stage 0, a script
that ends right after), rank 0 could read the verdict, return, and exit, taking the store
with it while another rank still reads. So every rank counts itself out once it has read
all it needs, the last one out says so, and rank 0 waits (bounded) for that word.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from zerostate.dist import collectives
from zerostate.errors import CollectiveTimeoutError, DistributedMismatchError

_ARRIVALS: dict[tuple[int, ...], int] = {}


def arrive(what: str, *, group: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait until every rank of ``group`` entered call ``what``; see [Note: arrival deadline].

    Raises :class:`~zerostate.errors.CollectiveTimeoutError` on every rank that entered
    when some rank did not within ``timeout_s`` seconds, and
    :class:`~zerostate.errors.DistributedMismatchError` when ranks entered different calls.
    """
    store = collectives.kv_store() if collectives.is_initialized() else None
    if store is None:
        return
    ranks = collectives.group_ranks(group, world_size)
    seq = _ARRIVALS.get(ranks, 0) + 1
    _ARRIVALS[ranks] = seq
    base = f"zerostate/arrive/{collectives.digest(ranks) & 0xFFFFFFFF:08x}"
    prefix = f"{base}/{seq}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], what)
        verdict = _await_verdict(store, keys, prefix, world_size, timeout_s)
        calls = [c.decode() for c in store.multi_get(keys)] if verdict == "ok" else []
        _forget(store, f"{base}/{seq - 2}", rank)
        if verdict == "ok":  # a missing rank may never come: rank 0 must not wait for it
            _leave(store, prefix, rank, world_size, timeout_s)
    except NotImplementedError:
        return  # a store without compare_set: the collectives themselves will have to do
    except collectives.NETWORK_ERROR as exc:
        raise CollectiveTimeoutError(
            f"{what}: lost the process group's key-value store while waiting for the other "
            f"ranks ({exc}); the process hosting it (torchrun's agent, or rank 0 of a plain "
            "init_process_group) has probably exited, see its error"
        ) from None
    if verdict == "ok":
        differ = {r: c for r, c in enumerate(calls) if c != what}
        if differ:
            raise DistributedMismatchError(
                f"rank {rank} called {what} while rank(s) {sorted(differ)} called "
                f"{sorted(set(differ.values()))}; every rank must make the same collective "
                "calls in the same order"
            )
        return
    missing = verdict.removeprefix("missing:")
    raise CollectiveTimeoutError(
        f"{what} is collective, but rank(s) {missing} of {world_size} did not enter it within "
        f"{timeout_s:g} s (rank {rank} did); call it on every rank (not under `if rank == "
        "0:`), or raise collective_timeout_s if those ranks are just slow"
    )


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    """Block in the store until ``key`` exists (no polling); False at the deadline."""
    try:
        store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
    except collectives.NETWORK_ERROR:
        raise
    except collectives.WAIT_TIMEOUT:
        return False
    return True


def _await_verdict(
    store: Any, keys: list[str], prefix: str, world_size: int, timeout_s: float
) -> str:
    # The last rank to count itself in decides "ok"; the others block on the verdict key.
    # compare_set keeps whichever verdict came first: a rank arriving after the others
    # gave up reads their "missing" verdict, never overwrites it.
    verdict_key = f"{prefix}/verdict"
    if store.add(f"{prefix}/count", 1) >= world_size:
        return store.compare_set(verdict_key, "", "ok").decode()
    if _wait(store, verdict_key, timeout_s):
        return store.get(verdict_key).decode()
    missing = ",".join(str(r) for r, k in enumerate(keys) if not store.check([k]))
    return store.compare_set(verdict_key, "", f"missing:{missing}").decode()


def _forget(store: Any, old_prefix: str, rank: int) -> None:
    # Every rank has left call seq - 2 once anyone passed call seq - 1's verdict.
    try:
        store.delete_key(f"{old_prefix}/{rank}")
        if rank == 0:
            for name in ("verdict", "count", "left", "all-left"):
                store.delete_key(f"{old_prefix}/{name}")
    except (RuntimeError, NotImplementedError):
        pass


def _leave(store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
    # See [Note: arrival deadline]: the last store access of every rank but 0 is this add
    # (and, for the last one out, the set that wakes rank 0); rank 0, which may host the
    # store, returns only once all are out, or a rank died in between, which the bounded
    # wait tolerates: the call's verdict is already agreed.
    if store.add(f"{prefix}/left", 1) >= world_size:
        store.set(f"{prefix}/all-left", "1")
        return
    if rank == 0:
        _wait(store, f"{prefix}/all-left", min(timeout_s, 30.0))
