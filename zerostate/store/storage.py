"""One storage interface over local disk and fsspec URLs (``s3://``, ``memory://``, ...).

The pieces live in their own modules; this one opens a root and keeps every name callers
import from here:

- ``base.py``: the :class:`Storage` interface, its capability flags ([Note: storage
  capabilities]), :class:`ByteRange`, [Note: durability];
- ``retry.py``: which errors are retried and how ([Note: storage retries]);
- ``local.py``: :class:`LocalStorage`;
- ``fsspec_storage.py``: :class:`FsspecStorage` and :class:`S3Storage`, the fsspec event
  loop across fork ([Note: event loops across fork]);
- ``s3.py``: S3 client defaults, multipart uploads, HEAD-only checks;
- ``location.py``: :func:`canonical_location` and containment of roots.

``zerostate.testing.StorageTests`` is the conformance suite every backend passes.
"""

from __future__ import annotations

import os
import time  # noqa: F401 - tests patch zerostate.store.storage.time.sleep
from typing import Any

from zerostate.errors import CheckpointNotFoundError, ConfigError
from zerostate.store.base import Buffer, ByteRange, Storage
from zerostate.store.fsspec_storage import (
    OBJECT_STORE_PROTOCOLS,
    STREAM_BLOCK,
    STREAM_THRESHOLD,
    FsspecStorage,
    S3Storage,
)
from zerostate.store.local import LocalStorage
from zerostate.store.location import (
    canonical_location,
    location_contains,
    locations_overlap,
)
from zerostate.store.retry import RetryPolicy, is_transient
from zerostate.store.s3 import (
    MULTIPART_PART_NBYTES,
    MULTIPART_THREADS,
    SINGLE_PUT_NBYTES,
    with_s3_defaults,
)

#: Old private spellings, for code that still imports them from here.
_is_transient = is_transient
#: A checkpoint root as callers name it: a path, a URL or an open Storage.
Location = str | os.PathLike | Storage
_with_s3_defaults = with_s3_defaults

__all__ = [
    "MULTIPART_PART_NBYTES",
    "MULTIPART_THREADS",
    "OBJECT_STORE_PROTOCOLS",
    "SINGLE_PUT_NBYTES",
    "STREAM_BLOCK",
    "STREAM_THRESHOLD",
    "Buffer",
    "ByteRange",
    "FsspecStorage",
    "LocalStorage",
    "Location",
    "RetryPolicy",
    "S3Storage",
    "Storage",
    "canonical_location",
    "is_transient",
    "location_contains",
    "locations_overlap",
    "open_storage",
]


def open_storage(root: Any, storage_options: dict | None = None) -> Storage:
    """Local disk for plain paths and ``file://``; fsspec for every other URL (an
    :class:`S3Storage` for ``s3://``). An open :class:`Storage` is returned as it is."""
    if isinstance(root, Storage):
        if storage_options:
            raise ConfigError("storage_options were given with an already open Storage")
        return root
    root = os.fspath(root)
    if not isinstance(root, str) or not root:
        raise CheckpointNotFoundError(f"checkpoint root must be a path or URL, got {root!r}")
    if "://" not in root or root.startswith("file://"):
        if storage_options:
            raise ConfigError(
                f"storage_options were given for the local path {root!r}; they apply to "
                "fsspec URLs only: drop them or use a URL"
            )
        return LocalStorage(root)
    return FsspecStorage(root, storage_options)
