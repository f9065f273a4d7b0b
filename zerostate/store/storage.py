"""One storage interface over local disk and fsspec URLs (``s3://``, ``memory://``, ...).

Paths handed to a :class:`Storage` are ``/``-separated and relative to the checkpoint root;
callers validate them (see ``format.validate_name``) before they get here.

[Note: durability]
``write`` returns once the object is complete and durable, except for directory entries on
local disk: a local write goes to ``<name>.partial``, is fsynced and renamed over
``<name>``; the directories whose entries changed are fsynced once per batch by
``sync_dirs`` (fsyncing the directory after every chunk would serialise the writes).
Object stores have no directories: an upload (s3fs ``pipe``) is durable when it returns.
"""

from __future__ import annotations

import errno
import os
import posixpath
import select
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec

from zerostate.errors import (
    CheckpointNotFoundError,
    ConfigError,
    StorageError,
    UnsafeNameError,
    ZerostateError,
)

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

# Errors that no retry can fix: give them back at once.
_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EINVAL,
    errno.ENOSPC,
    errno.EROFS,
    errno.EEXIST,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EDQUOT,
    errno.ENAMETOOLONG,
}
_WRITE_SLICE = 64 << 20  # os.write moves at most ~2 GiB per call; slices keep calls short
#: Objects larger than this are streamed (multipart) instead of joined into one buffer.
STREAM_THRESHOLD = 128 << 20
STREAM_BLOCK = 64 << 20
#: Modules whose exceptions are network / service failures a retry may cure.
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http")
#: Client errors that name a setting to fix (credentials, region, a bad parameter).
_CONFIG_ERRORS = {"ParamValidationError", "NoCredentialsError", "PartialCredentialsError",
                  "NoRegionError", "InvalidRegionError", "UnknownServiceError",
                  "InvalidConfigError"}  # fmt: skip


def _is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: connection trouble, timeouts, throttling, 5xx answers.
    Programming errors and bad arguments (ValueError, KeyError, TypeError, RuntimeError...)
    fail at once: retrying them only delays the real message."""
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS and not isinstance(exc, PermissionError)
    if isinstance(exc, TimeoutError):
        return True
    if any(cls.__name__ in _CONFIG_ERRORS for cls in type(exc).__mro__):
        return False
    module = type(exc).__module__.split(".", 1)[0]
    return module in _NETWORK_MODULES


#: S3 rows above SINGLE_PUT_NBYTES go up as a multipart upload of parts sent concurrently;
#: smaller ones as one PUT of the joined row (one request instead of parts plus create and
#: complete; on SeaweedFS a 25 MiB row went up 1.15x faster, benchmarks/bench_scale.py).
#: Rows of different groups still go up side by side, so a rank keeps several streams open.
#: At 32 MiB the 44 MiB rows of the S3 benchmark went up as 6 parts each and a save took
#: 1.13x the time of raw s3fs puts of its bytes; at 64 MiB, 0.96x (median of 6 alternating
#: rounds in one run): the server spends less per byte on one request than on parts.
SINGLE_PUT_NBYTES = 64 << 20
MULTIPART_PART_NBYTES = 8 << 20
MULTIPART_THREADS = 4
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}
#: Spellings of one backend that address the same objects.
_PROTOCOL_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "abfss": "abfs", "az": "abfs"}


# [Note: event loops across fork]
# fsspec runs every S3 request on one event loop thread. A forked child (a DataLoader
# worker, a crash-test child) inherits that loop's epoll descriptor, and an epoll instance
# is shared across fork: when the child drops the parent's s3fs filesystem (fsspec clears
# its instance cache in a new process), the filesystem's finaliser closes the parent's
# pooled connections through the inherited loop, and each close unregisters a socket from
# the epoll instance the parent still waits on. The parent's next request on such a
# connection then never sees its answer and hangs. So the child gets a private epoll for
# the inherited loop's selector before anything can run there; closing the copy leaves
# the parent's instance untouched. (kqueue, on macOS, is not inherited.)
_loop_at_fork: list[Any] = [None]


def _note_loop_before_fork() -> None:
    asyn = getattr(fsspec, "asyn", None)
    _loop_at_fork[0] = asyn.loop[0] if asyn is not None else None


def _forget_loop_after_fork() -> None:
    _loop_at_fork[0] = None


def _detach_inherited_loop() -> None:
    loop, _loop_at_fork[0] = _loop_at_fork[0], None
    selector = getattr(loop, "_selector", None)
    inherited = getattr(selector, "_selector", None)
    if hasattr(select, "epoll") and isinstance(inherited, select.epoll):
        try:
            selector._selector = select.epoll()
            inherited.close()
        except OSError:  # out of descriptors: the child keeps the shared instance
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_note_loop_before_fork,
        after_in_parent=_forget_loop_after_fork,
        after_in_child=_detach_inherited_loop,
    )


class Storage(ABC):
    """Byte objects under a root. Thread-safe: the writer and reader call it from pools."""

    #: True when paths are real directories (local disk): writers create them up front.
    has_directories: bool = False

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def url_of(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` at ``path``, atomically and durably."""

    @abstractmethod
    def read(self, path: str) -> bytes:
        """The whole object; ``FileNotFoundError`` if absent."""

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` (writable byte views) with the object's bytes in order, when the
        object is exactly as long as they are together; return the object's size either
        way. ``FileNotFoundError`` if absent. Lets readers land bytes in their final place
        without an intermediate copy."""
        data = self.read(path)
        if len(data) == sum(p.nbytes for p in parts):
            offset = 0
            for part in parts:
                part[:] = data[offset : offset + part.nbytes]
                offset += part.nbytes
        return len(data)

    def write_stream(
        self, path: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int
    ) -> None:
        """Like :meth:`write` for an object of ``nbytes`` whose pieces come from an
        iterable, consumed once (``make_parts`` is called again if a retry starts over),
        so a large object streams out with bounded memory."""
        self.write(path, list(make_parts()))

    def read_range_into(self, path: str, offset: int, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` with the object's bytes from ``offset`` on, in order; return how
        many bytes were read (fewer when the object ends early). ``FileNotFoundError`` if
        absent."""
        data = memoryview(self.read(path))[offset : offset + sum(p.nbytes for p in parts)]
        return _scatter(data, parts)

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object exists at ``path`` now (no stale cache: ranks poll with it).
        Only asked of objects, never of directories."""

    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each path, in order; object stores ask concurrently, so a
        scan of many steps costs about one round trip instead of one per step."""
        if len(paths) < 2 or self.has_directories:
            return [self.exists(p) for p in paths]
        with ThreadPoolExecutor(min(len(paths), 16), thread_name_prefix="zs-exists") as pool:
            return list(pool.map(self.exists, paths))

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names of the entries directly under ``path``; empty if it does not exist."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete one object; absent is fine."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; absent is fine."""

    def makedirs(self, paths: Sequence[str]) -> None:
        """Create directories (local disk); a no-op where directories do not exist."""
        return None  # nothing to do on stores without directories

    def sync_dirs(self) -> None:
        """Make the directory entries of earlier writes durable (see [Note: durability])."""
        return None  # nothing to do on stores without directories

    def check_writable(self) -> None:
        """Raise :class:`StorageError` with the fix when the root cannot be written at all."""
        return None  # nothing to do on stores without directories

    def check_readable(self) -> None:
        """Raise :class:`CheckpointNotFoundError` (or :class:`StorageError`) naming the cause
        when the root cannot hold a checkpoint to read. Creates nothing."""
        return None  # stores without directories: an absent root just lists as empty

    @property
    def location(self) -> str:
        """Canonical identity of the root (see :func:`canonical_location`)."""
        return canonical_location(self.url)

    _attempts = 5

    def _retry(self, what: str, path: str, fn: Callable[[], T], attempts: int | None = None) -> T:
        attempts = attempts or self._attempts
        delay = 0.1
        for attempt in range(attempts):
            try:
                return fn()
            except (FileNotFoundError, ZerostateError):
                raise  # a missing object is an answer; our own errors are already clear
            except Exception as exc:
                # Network clients raise their own classes (botocore's EndpointConnectionError
                # is no OSError); all of them end up as one StorageError naming the URL.
                if not _is_transient(exc) or attempt == attempts - 1:
                    raise StorageError(
                        f"{what} {self.url_of(path)} failed"
                        + (f" after {attempt + 1} attempts" if attempt else "")
                        + f": {type(exc).__name__}: {exc}"
                    ) from exc
            time.sleep(delay)
            delay = min(delay * 4, 3.0)
        raise AssertionError("unreachable")


class LocalStorage(Storage):
    has_directories = True

    def __init__(self, root: str) -> None:
        root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        super().__init__(root)
        self.root = root
        self._lock = threading.Lock()
        self._dirty_dirs: set[str] = set()

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _contained(self, path: str) -> str:
        """``_abs(path)``, refused when links make it resolve outside the root: a hostile
        checkpoint must not make a reader (or a writer) touch files elsewhere."""
        target = self._abs(path)
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(target)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise UnsafeNameError(
                f"{target} resolves to {real}, outside the checkpoint root {real_root} (a "
                "link out of the checkpoint); zerostate does not follow such links"
            )
        return target

    def check_writable(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StorageError(
                f"checkpoint root {self.root} is a file, not a directory: name a directory"
            )
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create checkpoint directory {self.root}: {exc}") from exc

    def check_readable(self) -> None:
        if os.path.isdir(self.root):
            return
        if os.path.exists(self.root):
            raise CheckpointNotFoundError(
                f"{self.root} is a file, not a checkpoint directory: pass the checkpoint "
                "root (the directory holding step-* directories)"
            )
        raise CheckpointNotFoundError(
            f"no checkpoint at {self.root}: the directory does not exist; check the path"
        )

    def makedirs(self, paths: Sequence[str]) -> None:
        for path in paths:
            target = self._abs(path)
            if os.path.isdir(target):
                continue
            # Record every directory this creates: each new entry lives in its parent.
            missing = []
            cur = target
            while not os.path.isdir(cur):
                missing.append(cur)
                cur = os.path.dirname(cur)
            try:
                os.makedirs(target, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create directory {target}: {exc}") from exc
            with self._lock:
                self._dirty_dirs.update(os.path.dirname(m) for m in missing)

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        self.write_stream(path, lambda: views, sum(v.nbytes for v in views))

    def sync_dirs(self) -> None:
        with self._lock:
            dirs, self._dirty_dirs = sorted(self._dirty_dirs, key=len, reverse=True), set()
        for d in dirs:
            try:
                fd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                continue  # removed since (e.g. a concurrent delete): nothing to persist
            except OSError as exc:
                raise StorageError(f"fsync of directory {d} failed: {exc}") from exc

    def read(self, path: str) -> bytes:
        target = self._contained(path)
        try:
            with open(target, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise FileNotFoundError(errno.ENOENT, "not found", target) from exc
        except OSError as exc:
            raise StorageError(f"reading {target} failed: {exc}") from exc

    def read_into(self, path: str, parts: Sequence[memoryview]) -> int:
        target = self._contained(path)
        try:
            with open(target, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != sum(p.nbytes for p in parts):
                    return size
                for part in parts:
                    got = 0
                    while got < part.nbytes:
                        n = f.readinto(part[got:])
                        if not n:
                            return got  # shrank while reading: reported as truncated
                        got += n
                return size
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise FileNotFoundError(errno.ENOENT, "not found", target) from exc
        except OSError as exc:
            raise StorageError(f"reading {target} failed: {exc}") from exc

    def write_stream(
        self, path: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int
    ) -> None:
        target = self._contained(path)
        partial = target + ".partial"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(partial, flags, 0o644)
            try:
                batch: list[memoryview] = []
                size = 0
                for part in make_parts():
                    view = memoryview(part).cast("B")
                    if view.nbytes:
                        batch.append(view)
                        size += view.nbytes
                    # One writev per batch: small pieces (checksums, short tensors) cost
                    # no syscall each, and no batch is joined into a copy.
                    if len(batch) >= _IOV_BATCH or size >= _WRITE_SLICE:
                        _writev_all(fd, batch)
                        batch, size = [], 0
                _writev_all(fd, batch)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(partial, target)
        except OSError as exc:
            raise StorageError(f"writing {target} failed: {exc}") from exc
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(target))

    def read_range_into(self, path: str, offset: int, parts: Sequence[memoryview]) -> int:
        target = self._contained(path)
        try:
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise FileNotFoundError(errno.ENOENT, "not found", target) from exc
        except OSError as exc:
            raise StorageError(f"reading {target} failed: {exc}") from exc
        try:
            done, i = 0, 0
            pending = [p for p in parts if p.nbytes]
            while i < len(pending):
                n = os.preadv(fd, pending[i : i + _IOV_BATCH], offset + done)
                if n == 0:
                    break  # the object ends early: the caller reports it as truncated
                done += n
                while i < len(pending) and n >= pending[i].nbytes:
                    n -= pending[i].nbytes
                    i += 1
                if n:
                    pending[i] = pending[i][n:]
            return done
        except OSError as exc:
            raise StorageError(f"reading {target} failed: {exc}") from exc
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, path: str) -> None:
        target = self._abs(path)
        try:
            os.remove(target)
        except FileNotFoundError:
            return
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(target))

    def remove_tree(self, path: str) -> None:
        target = self._abs(path)
        errors: list[str] = []

        def record(function, failed_path, exc_info) -> None:
            exc = exc_info[1]
            if not isinstance(exc, FileNotFoundError):  # removed concurrently: fine
                errors.append(f"{failed_path}: {exc.strerror or exc}")

        if os.path.islink(target):
            os.unlink(target)  # a link is removed, never what it points to
        else:
            shutil.rmtree(target, onerror=record)
        if os.path.lexists(target):
            shown = "; ".join(errors[:3]) or "it reappeared while being removed"
            raise StorageError(f"could not remove {target}: {shown}")
        with self._lock:
            self._dirty_dirs.add(os.path.dirname(target))


def _with_s3_defaults(url: str, storage_options: dict | None) -> dict:
    """Bounded waits for S3: a server that stops answering must end in an error within
    minutes, not the hours that stacked client retries and 60 s read timeouts add up to.
    Options the caller sets win; ``_retry`` above adds the outer retries."""
    options = dict(storage_options or {})
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 30)
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options


class FsspecStorage(Storage):
    """Any fsspec filesystem; object stores (S3 and friends) are the case that matters."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **_with_s3_defaults(url, storage_options))
        except (ImportError, ValueError, TypeError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self.protocols = {protocol} if isinstance(protocol, str) else set(protocol)
        if self.protocols & {"s3", "s3a"} and hasattr(self.fs, "retries"):
            # s3fs retries timeouts 5 times inside each call; _retry adds the outer,
            # backed-off attempts, so keep the inner loop short (see _with_s3_defaults).
            self.fs.retries = min(int(self.fs.retries), 2)
        self._attempts = 3 if self.protocols & _OBJECT_STORE_PROTOCOLS else 5

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def check_writable(self) -> None:
        self.check_readable()  # the bucket must exist either way; the check writes nothing

    def check_readable(self) -> None:
        if not self.protocols & _OBJECT_STORE_PROTOCOLS:
            return
        bucket = self.root.split("/", 1)[0]
        exists = self._retry("checking bucket", "", lambda: self.fs.exists(bucket))
        if not exists:
            raise StorageError(
                f"bucket {bucket!r} of {self.url} does not exist (or these credentials cannot "
                "see it): create the bucket first or fix the URL / storage_options"
            )

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        target = self._abs(path)
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)

        def put() -> None:
            try:
                if total <= STREAM_THRESHOLD:
                    self.fs.pipe_file(target, b"".join(views))
                else:
                    self._stream(target, views)
            except FileNotFoundError as exc:
                # On an object store the only missing thing a PUT can hit is the bucket.
                raise StorageError(
                    f"writing {self.url_of(path)} failed: {exc}; does the bucket exist?"
                ) from exc

        self._retry("writing", path, put)

    def _stream(self, target: str, views: list[memoryview]) -> None:
        # Big objects go up as a multipart upload in STREAM_BLOCK pieces, so a thread
        # holds one piece rather than a joined copy of the whole chunk.
        f = self.fs.open(target, "wb", block_size=STREAM_BLOCK)
        try:
            for view in views:
                for offset in range(0, view.nbytes, STREAM_BLOCK):
                    f.write(view[offset : offset + STREAM_BLOCK])
        except BaseException:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()  # abort the upload: never complete a partial object
            raise
        f.close()  # completes the upload: durable once this returns

    def write_stream(
        self, path: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int
    ) -> None:
        target = self._abs(path)

        def put() -> None:
            try:
                if self.protocols & {"s3", "s3a"} and nbytes > max(
                    SINGLE_PUT_NBYTES, MULTIPART_PART_NBYTES
                ):
                    self._parallel_multipart(target, make_parts)
                    return
                if nbytes <= STREAM_THRESHOLD:
                    self.fs.pipe_file(target, b"".join(make_parts()))
                    return
                # A multipart upload: the client holds one STREAM_BLOCK part at a time.
                f = self.fs.open(target, "wb", block_size=STREAM_BLOCK)
                try:
                    for part in make_parts():
                        f.write(part)
                except BaseException:
                    discard = getattr(f, "discard", None)
                    if discard is not None:
                        discard()  # abort the upload: never complete a partial object
                    raise
                f.close()
            except FileNotFoundError as exc:
                raise StorageError(
                    f"writing {self.url_of(path)} failed: {exc}; does the bucket exist?"
                ) from exc

        self._retry("writing", path, put)

    def _parallel_multipart(self, target: str, make_parts: Callable[[], Iterable[Buffer]]) -> None:
        """One S3 object from parts uploaded concurrently (a single PUT stream is slow on
        S3 servers): at most ``2 * MULTIPART_THREADS`` parts of ``MULTIPART_PART_NBYTES``
        are in memory. An error aborts the upload, so no partial object ever appears."""
        bucket, _, key = target.partition("/")
        upload = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = upload["UploadId"]

        def send(number: int, body: bytes) -> dict:
            out = self.fs.call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
            return {"PartNumber": number, "ETag": out["ETag"]}

        try:
            done: list[dict] = []
            with ThreadPoolExecutor(MULTIPART_THREADS, thread_name_prefix="zs-part") as pool:
                inflight: list[Future] = []
                pending: deque[memoryview] = deque()
                size, number = 0, 0
                for part in make_parts():
                    view = memoryview(part).cast("B")
                    pending.append(view)
                    size += view.nbytes
                    while size >= MULTIPART_PART_NBYTES:
                        body = _take(pending, MULTIPART_PART_NBYTES)
                        size -= MULTIPART_PART_NBYTES
                        if len(inflight) >= 2 * MULTIPART_THREADS:
                            done.append(inflight.pop(0).result())
                        number += 1
                        inflight.append(pool.submit(send, number, body))
                if size or not number:
                    number += 1
                    inflight.append(pool.submit(send, number, _take(pending, size)))
                done += [f.result() for f in inflight]
            self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": sorted(done, key=lambda p: p["PartNumber"])},
            )
        except BaseException:
            try:
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                )
            except Exception:  # the original error is the one worth reporting
                pass
            raise
        self.fs.invalidate_cache(target.rsplit("/", 1)[0])

    def read_range_into(self, path: str, offset: int, parts: Sequence[memoryview]) -> int:
        end = offset + sum(p.nbytes for p in parts)
        target = self._abs(path)

        def cat() -> bytes:
            if end == offset:
                return b""
            try:
                return self.fs.cat_file(target, start=offset, end=end)
            except OSError as exc:
                # S3 answers a range that starts past the end with 416 (EINVAL here): the
                # object is shorter than that, which the caller reports as truncation.
                if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                    return b""
                raise

        return _scatter(memoryview(self._retry("reading", path, cat)), parts)

    def read(self, path: str) -> bytes:
        return self._retry("reading", path, lambda: self.fs.cat_file(self._abs(path)))

    def exists(self, path: str) -> bool:
        target = self._abs(path)
        if self.protocols & {"s3", "s3a"}:
            # One HEAD: s3fs's exists() follows a 404 with a listing to look for a
            # directory of that name, a second round trip that an object check never needs.
            bucket, _, key = target.partition("/")

            def head() -> bool:
                try:
                    self.fs.call_s3("head_object", Bucket=bucket, Key=key)
                except FileNotFoundError:
                    return False
                return True

            return self._retry("checking", path, head)
        self.fs.invalidate_cache(target.rsplit("/", 1)[0])
        return bool(self._retry("checking", path, lambda: self.fs.exists(target)))

    def list_dir(self, path: str) -> list[str]:
        target = self._abs(path)
        self.fs.invalidate_cache(target)

        def ls() -> list[Any]:
            try:
                return self.fs.ls(target, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []

        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in self._retry("listing", path, ls)}
        return sorted(n for n in names if n)

    def remove(self, path: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm_file(self._abs(path))
            except FileNotFoundError:
                pass

        self._retry("deleting", path, rm)
        self.fs.invalidate_cache(self._abs(path).rsplit("/", 1)[0])

    def remove_tree(self, path: str) -> None:
        target = self._abs(path)

        def rm() -> None:
            try:
                self.fs.rm(target, recursive=True)
            except FileNotFoundError:
                pass

        self._retry("deleting", path, rm)
        if "s3" in self.protocols:
            self._retry("deleting", path, lambda: self._delete_empty_dirs(target))
        self.fs.invalidate_cache(target)

    def _delete_empty_dirs(self, target: str) -> None:
        # S3 servers backed by a real filer (SeaweedFS, for one) keep empty "directories"
        # after their objects are deleted; a leftover step directory would look like a
        # partial step forever. Delete them as ``<key>/`` markers, deepest first.
        dirs, queue = [], [target]
        while queue:
            d = queue.pop()
            self.fs.invalidate_cache(d)
            try:
                entries = self.fs.ls(d, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                continue
            dirs.append(d)
            queue.extend(e["name"] for e in entries if e.get("type") == "directory")
        for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
            bucket, _, key = d.partition("/")
            if key:
                try:
                    self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
                except FileNotFoundError:
                    pass


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
    protocol = _PROTOCOL_ALIASES.get(protocol, protocol)
    key = posixpath.normpath("/" + rest.lstrip("/")).lstrip("/")
    return f"{protocol}://{key}".rstrip("/") if key else f"{protocol}://"


Location = str | os.PathLike | Storage


def location_contains(outer: Location, inner: Location) -> bool:
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


def locations_overlap(a: Location, b: Location) -> bool:
    """Whether two roots are the same location or one lies inside the other: writing or
    deleting under one may then destroy what the other holds."""
    return location_contains(a, b) or location_contains(b, a)


def _location(root: Location) -> str:
    return root.location if isinstance(root, Storage) else canonical_location(root)


_IOV_BATCH = 512  # below every platform's IOV_MAX


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views[:_IOV_BATCH])  # releases the GIL
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


def _take(views: deque[memoryview], nbytes: int) -> bytes:
    """The first ``nbytes`` of the queued views, as one buffer (the views are consumed)."""
    out = []
    while nbytes:
        view = views[0]
        if view.nbytes <= nbytes:
            out.append(views.popleft())
            nbytes -= view.nbytes
        else:
            out.append(view[:nbytes])
            views[0] = view[nbytes:]
            nbytes = 0
    return b"".join(out)


def _scatter(data: memoryview, parts: Sequence[memoryview]) -> int:
    pos = 0
    for part in parts:
        take = min(part.nbytes, data.nbytes - pos)
        if take <= 0:
            break
        part[:take] = data[pos : pos + take]
        pos += take
    return pos


def open_storage(root: Any, storage_options: dict | None = None) -> Storage:
    """Local disk for plain paths and ``file://``; fsspec for every other URL."""
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
