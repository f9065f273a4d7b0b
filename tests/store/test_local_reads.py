"""Local ranged reads land every byte in place however the kernel splits them."""

from __future__ import annotations

import os
import random

import pytest

from zerostate.store import local
from zerostate.store.local import LocalStorage


def _views(sizes):
    return [memoryview(bytearray(n)) for n in sizes]


def _short_preadv(limit, record):
    """A ``preadv`` that does what a kernel may do: fill only the first ``limit`` bytes of
    the request (all of it when ``limit`` is None). ``record(buffers)`` sees every call."""
    real = os.preadv

    def preadv(fd, buffers, offset):
        record(buffers)
        if limit is None:
            return real(fd, buffers, offset)
        scratch = bytearray(min(limit, sum(b.nbytes for b in buffers)))
        n = real(fd, [scratch], offset)
        pos = 0
        for b in buffers:
            take = min(b.nbytes, n - pos)
            b[:take] = scratch[pos : pos + take]
            pos += take
        return n

    return preadv


@pytest.mark.parametrize("limit", [1, 5, 7, 1000, None])
def test_short_preadv_results_resume_where_they_stopped(tmp_path, monkeypatch, limit):
    data = bytes(range(256)) * 40
    (tmp_path / "obj").write_bytes(data)
    storage = LocalStorage(str(tmp_path))
    calls = []
    monkeypatch.setattr(local.os, "preadv", _short_preadv(limit, lambda b: calls.append(len(b))))
    monkeypatch.setattr(local, "_IOV_BATCH", 4)
    sizes = [3, 0, 16, 1, 250, 4, 4, 4, 9, 0, 2000, 13]
    parts = _views(sizes)
    got = storage.read_range_into("obj", 123, parts)
    assert got == sum(sizes)
    assert b"".join(bytes(p) for p in parts) == data[123 : 123 + sum(sizes)]
    assert max(calls) <= 4
    if limit is None:  # whole batches: one call per batch of non-empty views
        assert len(calls) == 3


@pytest.mark.parametrize("limit", [3, 100, None])
@pytest.mark.parametrize("read_slice", [1, 64, 1000])
def test_no_read_moves_more_than_a_slice(tmp_path, monkeypatch, limit, read_slice):
    """[Note: read size]: views larger than a slice are cut, several small ones share one."""
    data = os.urandom(9000)
    (tmp_path / "obj").write_bytes(data)
    storage = LocalStorage(str(tmp_path))
    calls = []
    record = lambda b: calls.append(sum(x.nbytes for x in b))  # noqa: E731
    monkeypatch.setattr(local.os, "preadv", _short_preadv(limit, record))
    monkeypatch.setattr(local, "_READ_SLICE", read_slice)
    sizes = [1, 2500, 7, 7, 7, 64, 65, 3000, 1]
    parts = _views(sizes)
    assert storage.read_range_into("obj", 17, parts) == sum(sizes)
    assert b"".join(bytes(p) for p in parts) == data[17 : 17 + sum(sizes)]
    assert max(calls) <= read_slice
    if limit is None and read_slice == 1000:
        # 1 + 999 | 1000 | 501 + 7 + 7 + 7 + 64 + 65 + 349 | 1000 | 1000 | 651 + 1
        assert calls == [1000, 1000, 1000, 1000, 1000, 652]


def test_a_read_past_the_end_stops_at_the_end(tmp_path):
    (tmp_path / "obj").write_bytes(b"0123456789")
    storage = LocalStorage(str(tmp_path))
    parts = _views([4, 4, 4])
    assert storage.read_range_into("obj", 3, parts) == 7
    assert b"".join(bytes(p) for p in parts) == b"3456789" + bytes(5)


def test_a_resharding_read_streams_each_row_object_once_in_order(tmp_path, monkeypatch):
    """[Note: local read order]: each row object in file order through one descriptor,
    with no readahead hint ([Note: read size])."""
    import torch
    from _store_helpers import make_tensors

    from zerostate.layout.partition import even_layout
    from zerostate.store import open_checkpoint, save_tensors

    tensors = make_tensors()
    save_tensors(str(tmp_path), 1, tensors, world_size=2, min_shard_numel=8)
    opened, reads, hints, path_of = [], [], [], {}
    real_open, real_preadv = os.open, local._preadv_all

    def open_(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        opened.append(path)
        path_of[fd] = path  # fd numbers are reused once closed
        return fd

    monkeypatch.setattr(local.os, "open", open_)
    monkeypatch.setattr(local.os, "posix_fadvise", lambda fd, o, n, advice: hints.append(advice))
    monkeypatch.setattr(local, "_preadv_all", lambda fd, o, v: reads.append((path_of[fd], o)) or
                        real_preadv(fd, o, v))  # fmt: skip
    st = open_checkpoint(str(tmp_path)).step(1)
    for rank in range(3):
        opened.clear(), reads.clear(), hints.clear()
        requests = []
        for name, info in st.tensors.items():
            lo, hi = even_layout(info.numel, 3).owned_range(rank)
            requests.append((name, lo, hi, None))
        outs = st.read_many(requests)
        for (name, lo, hi, _), out in zip(requests, outs, strict=True):
            assert torch.equal(out, tensors[name].reshape(-1)[lo:hi]), name
        rows = [p for p in opened if "/c/" in p]
        assert rows and len(rows) == len(set(rows)), rows  # each row object opened once
        assert hints == []
        by_row: dict[str, list[int]] = {}
        for path, offset in reads:
            by_row.setdefault(path, []).append(offset)
        assert set(by_row) == set(rows)
        assert all(offsets == sorted(offsets) for offsets in by_row.values()), by_row
    st.close()


@pytest.mark.parametrize("seed", range(4))
def test_vector_writes_keep_every_byte_in_order_across_short_writes(tmp_path, monkeypatch, seed):
    """``_writev_all`` over thousands of views (more than one batch), empty ones included,
    with a writev that stops at random points, sometimes inside a view: the file holds
    every byte once, in order."""
    rng = random.Random(seed)
    parts = [rng.randbytes(rng.choice([0, 1, 4, 37, 8192])) for _ in range(1500)]
    real_writev = os.writev

    def short(fd, buffers):
        total = sum(memoryview(b).nbytes for b in buffers)
        keep = rng.randrange(1, total + 1) if total else 0
        out, left = [], keep
        for b in buffers:  # the first `keep` bytes of the batch, as the kernel would
            view = memoryview(b).cast("B")
            out.append(view[:left])
            left -= min(left, view.nbytes)
        return real_writev(fd, out)

    monkeypatch.setattr(local.os, "writev", short)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        local._writev_all(fd, [memoryview(p) for p in parts])
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)
