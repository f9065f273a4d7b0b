"""A forked child must not break the parent's S3 connections (see [Note: event loops
across fork] in zerostate.store.storage): data-loader workers fork, and a child that
drops the parent's s3fs filesystem used to unregister the parent's sockets from the epoll
instance both share, so the parent's next save or load waited forever for an answer."""

from __future__ import annotations

import asyncio
import gc
import os
import select
import sys

import fsspec.asyn
import pytest

from zerostate.store.storage import open_storage


def _watched_sockets() -> dict[int, int]:
    """Descriptor -> inode of what the fsspec event loop's epoll instance watches (from
    /proc: ``tfd: FD events: .. data: .. pos:0 ino:HEX sdev:..``)."""
    epoll_fd = fsspec.asyn.loop[0]._selector._selector.fileno()
    with open(f"/proc/self/fdinfo/{epoll_fd}") as f:
        lines = [line.split() for line in f if line.startswith("tfd:")]
    return {int(fields[1]): int(_field(fields, "ino:"), 16) for fields in lines}


def _field(fields: list[str], prefix: str) -> str:
    return next(f[len(prefix) :] for f in fields if f.startswith(prefix))


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _unwatched_but_open(before: dict[int, int]) -> list[int]:
    """Descriptors the loop watched before that this process still holds open (same
    inode) but the loop no longer watches: what a child closing them through the shared
    epoll instance leaves behind. A connection the parent's own loop closed meanwhile
    (an idle connection's keep-alive ran out, a server of an earlier test went away)
    is closed here too, so it does not count: the loop thread runs on while the child
    does, and which pooled connections it drops in that time is not this test's to fix."""
    after = _watched_sockets()
    return [fd for fd, ino in before.items() if fd not in after and _inode(fd) == ino]


@pytest.mark.s3
@pytest.mark.skipif(
    not (hasattr(select, "epoll") and sys.platform.startswith("linux")),
    reason="an epoll instance is what a fork shares (Linux); kqueue is not inherited",
)
def test_forked_child_leaves_the_parents_s3_connections_alone(s3_server):
    import s3fs

    bucket, options = s3_server.new_bucket("fork")
    storage = open_storage(f"s3://{bucket}/ckpt", options)
    storage.write("a", [b"x" * 100])
    assert storage.list_dir("") == ["a"]
    del storage  # fsspec's instance cache now holds the filesystem's last reference
    gc.collect()
    before = _watched_sockets()
    assert len(before) >= 2  # the loop's wake-up pipe and at least one pooled connection

    pid = os.fork()
    if pid == 0:  # child: what a data-loader worker reading from S3 does
        code = 1
        try:
            child = s3fs.S3FileSystem(**options)  # a new process clears the inherited cache

            async def collect() -> None:
                gc.collect()  # finalisers of the parent's filesystem run on this loop
                await asyncio.sleep(0.2)

            fsspec.asyn.sync(child.loop, collect)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status

    assert _unwatched_but_open(before) == []
    storage = open_storage(f"s3://{bucket}/ckpt", options)
    storage.write("b", [b"y" * 100])
    assert sorted(storage.list_dir("")) == ["a", "b"]
