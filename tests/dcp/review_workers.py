"""Workers of tests/dcp/test_api_review.py (module level: the pool pickles them by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def _state() -> dict:
    torch.manual_seed(0)
    return {k: torch.randn(64) for k in ("a", "b", "c", "d")}


def _committed(root: str) -> list[int]:
    from zerostate.store import open_checkpoint

    try:
        return list(open_checkpoint(root).steps())
    except Exception:  # noqa: BLE001
        return []


def _try(fn) -> dict:
    t0 = time.monotonic()
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001
        return {"type": type(exc).__name__, "message": str(exc)[:300], "s": time.monotonic() - t0}
    return {"type": None, "value": got, "s": time.monotonic() - t0}


def write_fails(rank: int, world_size: int, root: str, blocking: bool, where: str) -> dict:
    """``where``: 'write' (rank 1's write raises) or 'commit' (rank 0's commit record)."""
    import zerostate
    from zerostate.store import writer as writer_mod

    torch.set_num_threads(1)
    os.environ["ZEROSTATE_COMMIT_TIMEOUT_S"] = "30"
    state = _state()
    cls = writer_mod.StepWriter
    orig_write, orig_commit = cls.write, cls._write_commit_record

    def bad_write(self, shards):
        raise OSError("disk full (injected)")

    def bad_commit(self, manifests):
        raise OSError("commit refused (injected)")

    if where == "write" and rank == 1:
        cls.write = bad_write
    if where == "commit" and rank == 0:
        cls._write_commit_record = bad_commit
    try:

        def first():
            h = zerostate.save(state, root, blocking=blocking)
            if not blocking:
                h.wait()
                return h.step
            return h

        out = {"first": _try(first)}
    finally:
        cls.write, cls._write_commit_record = orig_write, orig_commit
    out["committed_after_first"] = _committed(root)
    out["second"] = _try(lambda: zerostate.save(state, root))
    out["third"] = _try(lambda: zerostate.save(state, root))
    out["committed"] = _committed(root)
    return out


def persist_fails_on_rank1(rank: int, world_size: int, tmp: str, root: str) -> dict:
    """A blocking memory save whose copy to ``root`` fails on rank 1: how long each rank
    takes to raise."""
    import zerostate
    from zerostate.checkpoint import tiers as tiers_mod

    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["ZEROSTATE_MEMORY_DIR"] = os.path.join(tmp, f"shm-node{rank}")
    os.environ["ZEROSTATE_COMMIT_TIMEOUT_S"] = "20"
    if rank == 1:  # rank 1's copy to the root cannot read its memory files
        orig_read = tiers_mod.MemoryTier.read

        def bad_read(self, step, rel):
            if threading_name().startswith("zs-persist"):
                raise OSError("memory copy unreadable (injected)")
            return orig_read(self, step, rel)

        tiers_mod.MemoryTier.read = bad_read
    state = _state()
    out = {
        "result": _try(lambda: zerostate.save(state, root, tier="memory", memory_durable_every=1))
    }
    out["committed"] = _committed(root)
    return out


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def durable_every_of_each_save(rank: int, world_size: int, tmp: str, root: str) -> dict:
    """Two non-blocking memory saves in a row, the first with memory_durable_every=2 (its
    count is 1: no copy to the root), the second with 1 while the first still runs in the
    background. Which steps reach the root."""
    import zerostate
    from zerostate.api import _TIERS
    from zerostate.checkpoint import tiers as tiers_mod

    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["ZEROSTATE_MEMORY_DIR"] = os.path.join(tmp, f"shm-node{rank}")
    finish = tiers_mod.MemorySave.finish

    def slow_finish(self, *args, **kwargs):
        time.sleep(1.0)  # the first save is still in the background when the second starts
        return finish(self, *args, **kwargs)

    tiers_mod.MemorySave.finish = slow_finish
    try:
        state = _state()
        zerostate.save(state, root, tier="memory", memory_durable_every=2, blocking=False)
        h = zerostate.save(state, root, tier="memory", memory_durable_every=1, blocking=False)
        h.wait()
    finally:
        tiers_mod.MemorySave.finish = finish
    for tiers in _TIERS.values():
        tiers.wait()
    return {"committed": _committed(root)}


def memory_saves_during_a_copy(rank: int, world_size: int, tmp: str, root: str) -> dict:
    """Non-blocking memory saves with memory_durable_every=1: the second starts while the
    first step's copy to ``root`` is under way (its commit record comes late)."""
    import zerostate
    from zerostate.api import _ROOTS, _TIERS
    from zerostate.store import format as fmt

    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["ZEROSTATE_MEMORY_DIR"] = os.path.join(tmp, f"shm-node{rank}")
    storage = _ROOTS.open(root).storage
    write, target = type(storage).write, f"{fmt.step_dir(0)}/{fmt.COMMIT_PATH}"

    def slow_commit(self, path, data, *args, **kwargs):
        if path == target:
            time.sleep(1.0)
        return write(self, path, data, *args, **kwargs)

    type(storage).write = slow_commit
    out: dict[str, Any] = {}
    try:
        state = _state()
        zerostate.save(state, root, tier="memory", memory_durable_every=1, blocking=False)
        manifest = os.path.join(root, fmt.step_dir(0), fmt.manifest_path(rank))
        deadline = time.monotonic() + 30
        while not os.path.exists(manifest) and time.monotonic() < deadline:
            time.sleep(0.01)  # the copy of step 0 is under way
        h = zerostate.save(state, root, tier="memory", memory_durable_every=1, blocking=False)
        out["second"] = _try(h.wait)
        out["persist"] = _try(lambda: [t.wait() for t in _TIERS.values()])
    finally:
        type(storage).write = write
    out["committed"] = _committed(root)
    return out
