"""Any fsspec filesystem (``memory://``, ``gs://``, ...), and :class:`S3Storage` for
``s3://`` URLs, which adds the S3 specifics of ``s3.py``."""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import fsspec

from zerostate.errors import StorageError
from zerostate.store import s3
from zerostate.store.base import Buffer, ByteRange, Storage, scatter
from zerostate.store.retry import RetryPolicy

#: Objects larger than this are streamed (multipart) instead of joined into one buffer.
STREAM_THRESHOLD = 128 << 20
STREAM_BLOCK = 64 << 20
#: Bucket-based services: the bucket must exist, and requests are worth batching.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


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


class FsspecStorage(Storage):
    """Any fsspec filesystem; object stores (S3 and friends) are the case that matters.
    Constructing one for an ``s3://`` URL gives an :class:`S3Storage`."""

    supports_range_reads = True

    def __new__(cls, url: str = "", *args: Any, **kwargs: Any) -> FsspecStorage:
        if cls is FsspecStorage and isinstance(url, str) and s3.is_s3_url(url):
            cls = S3Storage
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **s3.with_s3_defaults(url, storage_options))
        except (ImportError, ValueError, TypeError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self.protocols = {protocol} if isinstance(protocol, str) else set(protocol)
        if self.protocols & OBJECT_STORE_PROTOCOLS:
            self.is_object_store = True
            self.retry_policy = RetryPolicy(attempts=3)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    # ------------------------------------------------------------------- checks
    def check_writable(self) -> None:
        self.check_readable()  # the bucket must exist either way; the check writes nothing

    def check_readable(self) -> None:
        if not self.is_object_store:
            return
        bucket = self.root.split("/", 1)[0]
        exists = self._retry("checking bucket", "", lambda: self.fs.exists(bucket))
        if not exists:
            raise StorageError(
                f"bucket {bucket!r} of {self.url} does not exist (or these credentials cannot "
                "see it): create the bucket first or fix the URL / storage_options"
            )

    # ------------------------------------------------------------------ writing
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        self.write_stream(path, lambda: views, sum(v.nbytes for v in views))

    def write_stream(
        self, path: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int
    ) -> None:
        target = self._abs(path)

        def put() -> None:
            try:
                self._upload(target, make_parts, nbytes)
            except FileNotFoundError as exc:
                # On an object store the only missing thing a PUT can hit is the bucket.
                raise StorageError(
                    f"writing {self.url_of(path)} failed: {exc}; does the bucket exist?"
                ) from exc

        self._retry("writing", path, put)

    def _upload(self, target: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int) -> None:
        """One attempt at writing the object (``write_stream`` retries it)."""
        if nbytes <= STREAM_THRESHOLD:
            self.fs.pipe_file(target, _gathered(make_parts(), nbytes))
            return
        # A multipart upload: the client holds one STREAM_BLOCK part at a time.
        f = self.fs.open(target, "wb", block_size=STREAM_BLOCK)
        try:
            for part in make_parts():
                view = memoryview(part).cast("B")
                for offset in range(0, view.nbytes, STREAM_BLOCK):
                    f.write(view[offset : offset + STREAM_BLOCK])
        except BaseException:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()  # abort the upload: never complete a partial object
            raise
        f.close()  # completes the upload: durable once this returns

    # ------------------------------------------------------------------ reading
    def read(self, path: str, byte_range: ByteRange | None = None) -> bytes:
        if byte_range is not None:
            return self._read_range(path, byte_range)
        return self._retry("reading", path, lambda: self.fs.cat_file(self._abs(path)))

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

        return scatter(memoryview(self._retry("reading", path, cat)), parts)

    def size(self, path: str) -> int:
        target = self._abs(path)
        self.fs.invalidate_cache(target.rsplit("/", 1)[0])

        def stat() -> int:
            info = self.fs.info(target)
            if info.get("type") == "directory":
                raise FileNotFoundError(errno.ENOENT, "not an object", self.url_of(path))
            return int(info["size"])

        return self._retry("checking", path, stat)

    def exists(self, path: str) -> bool:
        target = self._abs(path)
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

        # s3fs lists an empty directory (a marker some servers keep) as itself: not an entry.
        found = {str(p).rstrip("/") for p in self._retry("listing", path, ls)} - {target}
        return sorted({p.rsplit("/", 1)[-1] for p in found} - {""})

    # ----------------------------------------------------------------- deleting
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
        self.fs.invalidate_cache(target)


class S3Storage(FsspecStorage):
    """``s3://`` through s3fs: HEAD-only existence checks, concurrent multipart uploads,
    bounded client waits (see ``s3.py``)."""

    is_object_store = True
    supports_multipart = True
    retry_policy = RetryPolicy(attempts=3)

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url, storage_options)
        if hasattr(self.fs, "retries"):
            # s3fs retries timeouts 5 times inside each call; _retry adds the outer,
            # backed-off attempts, so keep the inner loop short (see s3.with_s3_defaults).
            self.fs.retries = min(int(self.fs.retries), 2)

    def exists(self, path: str) -> bool:
        target = self._abs(path)
        return self._retry("checking", path, lambda: s3.object_exists(self.fs, target))

    def _upload(self, target: str, make_parts: Callable[[], Iterable[Buffer]], nbytes: int) -> None:
        if nbytes > max(s3.SINGLE_PUT_NBYTES, s3.MULTIPART_PART_NBYTES):
            self._parallel_multipart(target, make_parts)
        else:
            self.fs.pipe_file(target, b"".join(make_parts()))

    def _parallel_multipart(self, target: str, make_parts: Callable[[], Iterable[Buffer]]) -> None:
        s3.parallel_multipart(self.fs, target, make_parts)

    def remove_tree(self, path: str) -> None:
        super().remove_tree(path)
        target = self._abs(path)
        self._retry("deleting", path, lambda: s3.delete_empty_dirs(self.fs, target))
        self.fs.invalidate_cache(target)


def _gathered(parts: Iterable[Buffer], nbytes: int) -> bytearray:
    """The parts of an ``nbytes`` object in one buffer, each copied in as it arrives and then
    let go. A row of small inner chunks comes as batches built for this object alone
    ([Note: batched small chunks] in rows.py): joining them would hold every batch and the
    joined copy at once, twice the object."""
    out = bytearray(nbytes)
    at = 0
    for part in parts:
        view = memoryview(part).cast("B")
        if at + view.nbytes > nbytes:
            raise StorageError(f"internal: an object of {nbytes} bytes was given more")
        out[at : at + view.nbytes] = view
        at += view.nbytes
    if at != nbytes:
        raise StorageError(f"internal: an object of {nbytes} bytes was given {at}")
    return out
