"""The storage interface: byte objects under a root, capability flags, byte ranges.

Paths handed to a :class:`Storage` are ``/``-separated and relative to the checkpoint root;
callers validate them (see ``format.validate_name``) before they get here.

[Note: durability]
``write`` returns once the object is complete and durable, except for directory entries on
backends with ``needs_dir_sync``: a local write goes to ``<name>.partial``, is fsynced and
renamed over ``<name>``; the directories whose entries changed are fsynced once per batch by
``sync_dirs`` (fsyncing the directory after every chunk would serialise the writes).
Object stores have no directories: an upload is durable when it returns.

[Note: storage capabilities]
What a backend can do is stated by class attributes, as zarr's ``Store`` does
(``supports_writes``, ``supports_partial_writes``...), and callers branch on them, never on
the backend's class or URL scheme:

- ``has_directories``: paths are real directories that must exist before objects are
  written into them (``makedirs``); object stores make them implicitly.
- ``needs_dir_sync``: a new directory entry is durable only once its directory is fsynced
  (``sync_dirs`` does it); without it ``sync_dirs`` is a no-op.
- ``supports_rename``: writes land under a temporary name and are renamed into place, so a
  crash never leaves a torn object (object stores get the same from whole-object PUTs).
- ``supports_range_reads``: a byte range costs only its own bytes (``read_range_into``);
  without it a range read fetches the whole object and slices it.
- ``supports_multipart``: large objects go up as parts uploaded concurrently, each of a
  bounded size, so memory stays bounded and one slow stream does not set the pace.
- ``listing_is_consistent``: ``list_dir`` right after a write shows it (read-after-write
  consistent listings: local disk, S3 since 2020); without it the commit protocol reads the
  objects it waits for instead of listing them.
- ``is_object_store``: a bucket-based service (S3 and friends): the bucket must exist
  before anything is written, and requests are slow enough to batch.
- ``reads_ahead``: ranged reads of one object in ascending order through one
  :meth:`Storage.open_ranges` handle are read ahead by the backend (local disk: the
  kernel's readahead), so a reader gains more from one ordered stream per object than
  from spreading the object's ranges over threads ([Note: local read order] in
  ``reader_v2.py``); without it (object stores) each range is its own request, best
  issued concurrently.
- ``reads_locally``: objects are files on this host, read through the page cache its
  processes share, so a range that several ranks read costs memory copies, not network
  transfers or requests ([Note: whole replicas at load] in ``zerostate/checkpoint/load.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from zerostate.errors import ConfigError
from zerostate.store.retry import RetryPolicy

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

#: Concurrent requests for batched metadata calls (``exists_many``) on object stores.
BATCH_THREADS = 16


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, stop)`` of an object; ``stop=None`` reads to the end. A range that
    runs past the end of the object gives the bytes there are (fewer, maybe none)."""

    start: int
    stop: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ConfigError(f"ByteRange.start must be an int >= 0, got {self.start!r}")
        if self.stop is not None and (
            not isinstance(self.stop, int) or isinstance(self.stop, bool) or self.stop < self.start
        ):
            raise ConfigError(
                f"ByteRange.stop must be None or an int >= start ({self.start}), got {self.stop!r}"
            )

    @property
    def nbytes(self) -> int | None:
        """Bytes asked for; None for "to the end"."""
        return None if self.stop is None else self.stop - self.start


class Storage(ABC):
    """Byte objects under a root. Thread-safe: the writer and reader call it from pools.

    A backend implements ``write``, ``read``, ``exists``, ``list_dir``, ``remove`` and
    ``remove_tree``; ``read_range_into`` (the one byte-range primitive, which every ranged
    read goes through) and ``write_stream`` where it can do better than the defaults.
    ``zerostate.testing.StorageTests`` is the conformance suite every backend passes."""

    # Capability flags: see [Note: storage capabilities]. Class attributes; a backend
    # whose answer depends on the URL (FsspecStorage) sets them on the instance.
    has_directories: bool = False
    needs_dir_sync: bool = False
    supports_rename: bool = False
    supports_range_reads: bool = False
    supports_multipart: bool = False
    listing_is_consistent: bool = True
    is_object_store: bool = False
    reads_ahead: bool = False
    reads_locally: bool = False

    #: Retries of transient failures (see [Note: storage retries] in ``retry.py``).
    retry_policy: RetryPolicy = RetryPolicy()

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def url_of(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    def capabilities(self) -> dict[str, bool]:
        """Every capability flag and its value (for messages, ``inspect`` and tests)."""
        names = (
            "has_directories",
            "needs_dir_sync",
            "supports_rename",
            "supports_range_reads",
            "supports_multipart",
            "listing_is_consistent",
            "is_object_store",
            "reads_ahead",
            "reads_locally",
        )
        return {n: bool(getattr(self, n)) for n in names}

    # ------------------------------------------------------------------ writing
    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` at ``path``, atomically and durably."""

    def write_stream(
        self, path: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int
    ) -> None:
        """Like :meth:`write` for an object of ``nbytes`` whose pieces come from an
        iterable, consumed once (``make_parts`` is called again if a retry starts over),
        so a large object streams out with bounded memory."""
        self.write(path, list(make_parts()))

    def makedirs(self, paths: Sequence[str]) -> None:
        """Create directories (``has_directories``); a no-op elsewhere."""
        return None  # nothing to do on stores without directories

    def sync_dirs(self) -> None:
        """Make the directory entries of earlier writes durable (``needs_dir_sync``; see
        [Note: durability])."""
        return None  # nothing to do on stores without directories

    # ------------------------------------------------------------------ reading
    @abstractmethod
    def read(self, path: str, byte_range: ByteRange | None = None) -> bytes:
        """The whole object, or the bytes of ``byte_range`` in it (fewer when the object
        ends early); ``FileNotFoundError`` if absent."""

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` (writable byte views) with the object's bytes in order, when the
        object is exactly as long as they are together; return the object's size either
        way. ``FileNotFoundError`` if absent. Lets readers land bytes in their final place
        without an intermediate copy."""
        data = self.read(path)
        if len(data) == sum(p.nbytes for p in parts):
            scatter(memoryview(data), parts)
        return len(data)

    def read_range_into(self, path: str, offset: int, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` with the object's bytes from ``offset`` on, in order; return how
        many bytes were read (fewer when the object ends early). ``FileNotFoundError`` if
        absent. The byte-range primitive: backends with ``supports_range_reads`` fetch
        only these bytes."""
        nbytes = sum(p.nbytes for p in parts)
        return scatter(memoryview(self.read(path, ByteRange(offset, offset + nbytes))), parts)

    def open_ranges(self, path: str) -> RangeReader:
        """A handle for several ranged reads of the object at ``path`` by one thread,
        usually in ascending order (see ``reads_ahead``); a context manager. Its
        ``read_into(offset, parts)`` is :meth:`read_range_into`; ``FileNotFoundError``
        comes from the first read, not from opening the handle."""
        return RangeReader(self, path)

    def _read_range(self, path: str, byte_range: ByteRange) -> bytes:
        """``read(path, byte_range)`` for backends whose primitive is ``read_range_into``."""
        if byte_range.stop is None:
            return bytes(memoryview(self.read(path))[byte_range.start :])
        buf = bytearray(byte_range.stop - byte_range.start)
        with memoryview(buf) as view:
            got = self.read_range_into(path, byte_range.start, [view])
            return bytes(view[:got])

    def size(self, path: str) -> int:
        """Bytes of the object at ``path``; ``FileNotFoundError`` if absent. Backends with
        a stat answer in one request; this default probes with one-byte range reads."""
        byte = memoryview(bytearray(1))
        if not self.exists(path):
            raise FileNotFoundError(f"{self.url_of(path)} does not exist")
        lo, hi = 0, 1
        while self.read_range_into(path, hi - 1, [byte]) == 1:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # lo bytes exist, hi do not
            mid = (lo + hi) // 2
            if self.read_range_into(path, mid - 1, [byte]) == 1:
                lo = mid
            else:
                hi = mid
        return lo

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object exists at ``path`` now (no stale cache: ranks poll with it).
        Only asked of objects, never of directories."""

    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each path, in order; object stores ask concurrently, so a
        scan of many steps costs about one round trip instead of one per step."""
        if len(paths) < 2 or not self.is_object_store:
            return [self.exists(p) for p in paths]
        workers = min(len(paths), BATCH_THREADS)
        with ThreadPoolExecutor(workers, thread_name_prefix="zs-exists") as pool:
            return list(pool.map(self.exists, paths))

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names of the entries directly under ``path``; empty if it does not exist."""

    # ----------------------------------------------------------------- deleting
    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete one object; absent is fine."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; absent is fine."""

    # ------------------------------------------------------------------- checks
    def check_writable(self) -> None:
        """Raise :class:`StorageError` with the fix when the root cannot be written at all."""
        return None  # nothing to check on stores without directories or buckets

    def check_readable(self) -> None:
        """Raise :class:`CheckpointNotFoundError` (or :class:`StorageError`) naming the cause
        when the root cannot hold a checkpoint to read. Creates nothing."""
        return None  # stores without directories: an absent root just lists as empty

    @property
    def location(self) -> str:
        """Canonical identity of the root (see ``storage.canonical_location``)."""
        from zerostate.store.location import canonical_location

        return canonical_location(self.url)

    #: Deprecated spelling of ``retry_policy.attempts``; a subclass may still set it.
    _attempts: ClassVar[int | None] = None

    def _retry(self, what: str, path: str, fn: Callable[[], T], attempts: int | None = None) -> T:
        policy = self.retry_policy
        attempts = attempts or self._attempts
        if attempts is not None and attempts != policy.attempts:
            policy = RetryPolicy(attempts, policy.first_delay_s, policy.factor, policy.max_delay_s)
        return policy.call(what, self.url_of(path), fn)


class RangeReader:
    """Ranged reads of one object (:meth:`Storage.open_ranges`); this default makes each
    read its own :meth:`Storage.read_range_into` request. Not shared between threads."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path

    def read_into(self, offset: int, parts: Sequence[memoryview]) -> int:
        return self.storage.read_range_into(self.path, offset, parts)

    def close(self) -> None:
        return None  # nothing held between reads

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scatter(data: memoryview, parts: Sequence[memoryview]) -> int:
    """Copy ``data`` into ``parts`` in order, as far as it goes; return the bytes copied."""
    pos = 0
    for part in parts:
        if pos >= data.nbytes:
            break
        take = min(part.nbytes, data.nbytes - pos)  # an empty part takes nothing
        part[:take] = data[pos : pos + take]
        pos += take
    return pos
