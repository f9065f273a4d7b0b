"""Where a checkpoint root is: one canonical spelling per location, and containment."""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

from zerostate.errors import ConfigError

if TYPE_CHECKING:  # store.base asks this module for canonical_location: no import back
    from zerostate.store.base import Storage

    _Root = str | os.PathLike | Storage

#: Spellings of one backend that address the same objects.
PROTOCOL_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "abfss": "abfs", "az": "abfs"}


def canonical_location(root: str | os.PathLike) -> str:
    """One spelling per storage location, for telling whether two roots are the same.

    Local paths (plain or ``file://``) become ``file://`` + the real path: symlinks, ``..``,
    ``~`` and relative paths resolved. URLs become ``protocol://bucket/key`` with the
    protocol lower-cased and aliases merged (``s3a`` -> ``s3``), empty and ``.`` segments
    dropped, ``..`` applied and no trailing slash. The endpoint is deliberately not part of
    it: two spellings of one server cannot be told apart, so equal bucket and key on two
    endpoints count as the same place (the safe answer when deleting is at stake).
    """
    text = os.fspath(root)
    if not isinstance(text, str):
        raise ConfigError(f"checkpoint root must be a path or URL, got {root!r}")
    while "::" in text.split("://", 1)[0]:
        text = text.split("::", 1)[1]  # fsspec chaining: the target URL comes last
    protocol, sep, rest = text.partition("://")
    if not sep or protocol.lower() in ("file", "local"):
        path = os.path.expanduser(rest if sep else text)
        return "file://" + os.path.realpath(path)
    protocol = protocol.lower()
    protocol = PROTOCOL_ALIASES.get(protocol, protocol)
    key = posixpath.normpath("/" + rest.lstrip("/")).lstrip("/")
    return f"{protocol}://{key}".rstrip("/") if key else f"{protocol}://"


def location_contains(outer: _Root, inner: _Root) -> bool:
    """Whether ``inner`` is ``outer`` or lies anywhere under it (as locations, see
    :func:`canonical_location`). Local paths are also compared by inode, which catches
    what text cannot (bind mounts, case-insensitive file systems)."""
    a, b = _location(outer), _location(inner)
    if b == a or b.startswith(a.rstrip("/") + "/"):
        return True
    if not (a.startswith("file://") and b.startswith("file://")):
        return False
    try:
        target = os.stat(a.removeprefix("file://"))
    except OSError:
        return False
    cur = b.removeprefix("file://")
    while True:
        try:
            if os.path.samestat(os.stat(cur), target):
                return True
        except OSError:
            pass  # not created yet: its existing ancestors still count
        parent = os.path.dirname(cur)
        if parent == cur:
            return False
        cur = parent


def locations_overlap(a: _Root, b: _Root) -> bool:
    """Whether two roots are the same location or one lies inside the other: writing or
    deleting under one may then destroy what the other holds."""
    return location_contains(a, b) or location_contains(b, a)


def _location(root: _Root) -> str:
    if isinstance(root, str | os.PathLike):
        return canonical_location(root)
    return root.location  # a Storage
