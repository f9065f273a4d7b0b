"""The checkpoint roots of one engine: each location opened once and kept for its life.

[Note: one root per location]
An engine saves to and loads from a few roots, many times. Each one is opened at its first
use as one :class:`~zerostate.store.root.CheckpointRoot` and kept until ``engine.close()``:
every later save or load there uses the same storage client (on an object store, the same
connection pool and credentials), the same listing logic and the same save-guard memory.
A root is found by where it is, not by how it was spelled: the key is its canonical location
(``canonical_location``: ``ckpt``, ``./ckpt/`` and its absolute path are one root; ``s3a://``
is ``s3://``) together with how it is reached (an fsspec chain, the storage options). Two
roots of one location reached two ways (other storage options, say) are two storage clients
but one place, so they share one :class:`~zerostate.store.root.SaveMemory`: a load through
one makes a save through the other this run's own. Roots of different locations never share
it: a save into root B never trusts what this engine did in root A ([Note: save target] in
zerostate.store.root).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from zerostate.errors import CheckpointNotFoundError
from zerostate.store.base import Storage
from zerostate.store.root import CheckpointRoot, SaveMemory
from zerostate.store.storage import canonical_location, open_storage


class EngineRoots:
    """The roots one engine used ([Note: one root per location])."""

    def __init__(self) -> None:
        # location -> [(how it was reached, its root)]; few roots, few ways each
        self._roots: dict[str, list[tuple[Any, CheckpointRoot]]] = {}
        self._memories: dict[str, SaveMemory] = {}
        self._lock = threading.Lock()

    def open(self, path: Any, storage_options: dict | None = None) -> CheckpointRoot:
        """The engine's root at ``path`` (a path, fsspec URL or open Storage), opened at the
        first call for its location and way of reaching it (nothing is read yet)."""
        location, reached = _identify(path, storage_options)
        with self._lock:
            entries = self._roots.setdefault(location, [])
            for how, root in entries:
                if _same(how, reached):
                    return root
            memory = self._memories.setdefault(location, SaveMemory())
            storage = path if isinstance(path, Storage) else open_storage(path, storage_options)
            root = CheckpointRoot(storage, memory=memory)
            entries.append((reached, root))
            return root

    def memory(self, path: Any) -> SaveMemory:
        """The save guard's memory of the location at ``path`` (opens nothing)."""
        location, _ = _identify(path, None)
        with self._lock:
            return self._memories.setdefault(location, SaveMemory())

    def __len__(self) -> int:
        """How many root objects are open (one per location and way of reaching it)."""
        with self._lock:
            return sum(len(entries) for entries in self._roots.values())

    def close(self) -> None:
        """Release every root (``engine.close()``): storage clients hold no files open
        between calls, so releasing them is dropping them. The memories go too: a closed
        engine saves nothing more. Each root's removal of retired steps finishes first
        ([Note: retention off the save's path] in zerostate/store/root.py)."""
        with self._lock:
            roots = [root for entries in self._roots.values() for _, root in entries]
            self._roots.clear()
            self._memories.clear()
        for root in roots:
            root.wait_for_retention()


def _identify(path: Any, storage_options: dict | None) -> tuple[str, Any]:
    """``(canonical location, how it is reached)`` of a root as ``engine.save`` is given it."""
    if isinstance(path, Storage):
        return path.location, path
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise CheckpointNotFoundError(f"checkpoint root must be a path or URL, got {path!r}")
    head = text.split("://", 1)[0]
    chain = head[: head.rindex("::") + 2] if "::" in head else ""  # fsspec caching layers
    return canonical_location(text), (chain, storage_options or None)


def _same(how: Any, reached: Any) -> bool:
    if isinstance(how, Storage) or isinstance(reached, Storage):
        return how is reached
    try:
        return bool(how == reached)
    except Exception:  # storage options whose values refuse comparison: a root of its own
        return False
