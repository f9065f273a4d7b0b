"""Crash injection for the store: run a save in a forked child and SIGKILL it at the k-th
storage operation.

The kill points sit below the store, at the calls that change storage: on local disk the
``os`` functions that write, sync, rename, create or delete; on S3 every request s3fs makes
(``S3FileSystem._call_s3``). Counting there makes the sweep independent of how the store
lays out its objects, so the same sweep checks every format version. A "torn" kill writes
half of the buffer of the write it interrupts first, as a crash mid-``write`` would.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

#: The os-level calls a local save can be interrupted at.
LOCAL_OPS = ("write", "pwrite", "writev", "fsync", "replace", "rename", "remove", "unlink",
             "rmdir", "mkdir", "ftruncate")  # fmt: skip
_WRITES = {"write", "pwrite"}


@dataclass(frozen=True)
class KillPoint:
    op_index: int  # 1-based index of the storage operation the child dies at
    torn: bool  # write half the buffer of that operation before dying


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_local(point: KillPoint | None, counter: list[int], lock: threading.Lock) -> None:
    for name in LOCAL_OPS:
        original = getattr(os, name, None)
        if original is None:
            continue

        def wrapped(*args, __name=name, __orig=original, **kwargs):
            with lock:
                counter[0] += 1
                hit = point is not None and counter[0] == point.op_index
            if hit:
                if point.torn and __name in _WRITES and len(args) >= 2:
                    data = memoryview(args[1]).cast("B")
                    __orig(args[0], data[: data.nbytes // 2], *args[2:], **kwargs)
                elif point.torn and __name == "writev" and len(args) >= 2 and args[1]:
                    first = memoryview(args[1][0]).cast("B")
                    __orig(args[0], [first[: first.nbytes // 2]])
                _die()
            return __orig(*args, **kwargs)

        setattr(os, name, wrapped)


def _arm_s3(point: KillPoint | None, counter: list[int], lock: threading.Lock) -> None:
    import s3fs
    from fsspec.asyn import sync_wrapper

    original = s3fs.S3FileSystem._call_s3

    async def wrapped(self, method, *args, **kwargs):
        with lock:
            counter[0] += 1
            hit = point is not None and counter[0] == point.op_index
        if hit:
            _die()
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = wrapped
    # s3fs binds its sync ``call_s3`` to the original coroutine when the class is made, so
    # requests made through it (multipart parts, HEAD checks) need the wrapper there too.
    s3fs.S3FileSystem.call_s3 = sync_wrapper(wrapped)


def run_in_child(
    scenario: Callable[[], None], point: KillPoint | None, *, s3: bool
) -> tuple[int, int]:
    """Fork, run ``scenario`` with storage operations counted (and the child killed at
    ``point``), and return ``(exit status, operations counted)``. ``point=None`` is a dry
    run that only counts."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(read_fd)
            counter, lock = [0], threading.Lock()
            (_arm_s3 if s3 else _arm_local)(point, counter, lock)
            try:
                scenario()
            except BaseException as exc:  # report, do not unwind into pytest
                os.write(2, f"scenario failed: {exc!r}\n".encode())
                code = 3
            os.write(write_fd, str(counter[0]).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    while True:
        data = os.read(read_fd, 64)
        if not data:
            break
        chunks.append(data)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    counted = int(b"".join(chunks) or b"-1")
    return status, counted
