"""S3 specifics: client defaults with bounded waits, HEAD-only existence checks, multipart
uploads of concurrently sent parts, and the empty directory markers some servers keep.
Free functions of an s3fs filesystem; ``fsspec_storage.S3Storage`` puts them together."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from zerostate.store.base import Buffer

#: URL schemes s3fs serves.
S3_PROTOCOLS = frozenset({"s3", "s3a"})
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


def is_s3_url(url: str) -> bool:
    """Whether s3fs serves ``url`` directly (a chained ``cache::s3://`` URL is not)."""
    return url.split("://", 1)[0] in S3_PROTOCOLS


def with_s3_defaults(url: str, storage_options: dict | None) -> dict:
    """Bounded waits for S3: a server that stops answering must end in an error within
    minutes, not the hours that stacked client retries and 60 s read timeouts add up to.
    Options the caller sets win; the storage's retry policy adds the outer retries."""
    options = dict(storage_options or {})
    if not is_s3_url(url):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 30)
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options


def object_exists(fs: Any, target: str) -> bool:
    """One HEAD: s3fs's ``exists()`` follows a 404 with a listing to look for a directory
    of that name, a second round trip that an object check never needs."""
    bucket, _, key = target.partition("/")
    try:
        fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return False
    return True


def parallel_multipart(fs: Any, target: str, make_parts: Callable[[], Iterable[Buffer]]) -> None:
    """One S3 object from parts uploaded concurrently (a single PUT stream is slow on
    S3 servers): at most ``2 * MULTIPART_THREADS`` parts of ``MULTIPART_PART_NBYTES``
    are in memory. An error aborts the upload, so no partial object ever appears."""
    part_nbytes, threads = MULTIPART_PART_NBYTES, MULTIPART_THREADS
    bucket, _, key = target.partition("/")
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = upload["UploadId"]

    def send(number: int, body: bytes) -> dict:
        out = fs.call_s3(
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
        with ThreadPoolExecutor(threads, thread_name_prefix="zs-part") as pool:
            inflight: list[Future] = []
            pending: deque[memoryview] = deque()
            size, number = 0, 0
            for part in make_parts():
                view = memoryview(part).cast("B")
                pending.append(view)
                size += view.nbytes
                while size >= part_nbytes:
                    body = take(pending, part_nbytes)
                    size -= part_nbytes
                    if len(inflight) >= 2 * threads:
                        done.append(inflight.pop(0).result())
                    number += 1
                    inflight.append(pool.submit(send, number, body))
            if size or not number:
                number += 1
                inflight.append(pool.submit(send, number, take(pending, size)))
            done += [f.result() for f in inflight]
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": sorted(done, key=lambda p: p["PartNumber"])},
        )
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # the original error is the one worth reporting
            pass
        raise
    fs.invalidate_cache(target.rsplit("/", 1)[0])


def delete_empty_dirs(fs: Any, target: str) -> None:
    """S3 servers backed by a real filer (SeaweedFS, for one) keep empty "directories"
    after their objects are deleted; a leftover step directory would look like a partial
    step forever. Delete them as ``<key>/`` markers, deepest first."""
    dirs, queue = [], [target]
    while queue:
        d = queue.pop()
        fs.invalidate_cache(d)
        try:
            entries = fs.ls(d, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        dirs.append(d)
        queue.extend(e["name"] for e in entries if e.get("type") == "directory")
    for d in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
        bucket, _, key = d.partition("/")
        if key:
            try:
                fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
            except FileNotFoundError:
                pass


def take(views: deque[memoryview], nbytes: int) -> bytes:
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
