"""[Note: filled gaps] in reader_v2.py: a local stream reads through a short gap between
two runs of one row object, and only a short one, and only on local storage."""

from __future__ import annotations

import os

import pytest
import torch

from zerostate.errors import CheckpointError
from zerostate.store import local, open_checkpoint, reader_v2, save_tensors

NUMEL = 64 * 1024  # float32: 256 KiB in one row of one tensor


@pytest.fixture
def step(tmp_path):
    gen = torch.Generator().manual_seed(3)
    tensor = torch.randn(NUMEL, generator=gen)
    save_tensors(str(tmp_path), 1, {"w": tensor}, world_size=1)
    st = open_checkpoint(str(tmp_path)).step(1)
    yield st, tensor, tmp_path
    st.close()


def _layout(st):
    plan = st._plans[st.tensors["w"].group]
    ((lo, hi, slot),) = plan.spans(0)
    assert (lo, slot.itemsize) == (0, 4)  # one tensor at the row's start
    per_chunk = plan.inner // 4
    assert NUMEL // per_chunk >= 16, plan.inner  # enough chunks for the runs below
    return plan, per_chunk


def _record_reads(monkeypatch):
    """``(path, offset, nbytes)`` of every local read of a row object."""
    reads, path_of = [], {}
    real_open, real_preadv = os.open, local._preadv_all

    def open_(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        path_of[fd] = path
        return fd

    def preadv(fd, offset, views):
        n = real_preadv(fd, offset, views)
        if "/c/" in path_of.get(fd, ""):
            reads.append((path_of[fd], offset, sum(v.nbytes for v in views)))
        return n

    monkeypatch.setattr(local.os, "open", open_)
    monkeypatch.setattr(local, "_preadv_all", preadv)
    return reads


def _covered(reads):
    """Merged byte intervals the reads covered."""
    out = []
    for _, lo, n in sorted(reads, key=lambda r: r[1]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], lo + n)
        else:
            out.append([lo, lo + n])
    return [tuple(i) for i in out]


# chunk runs [0, 4) and [6, 7) and [12, 14): the first gap (2 chunks) is no longer than
# the run before it (4), the second (5 chunks) is longer than its run (1)
RUNS = [(0, 4), (6, 7), (12, 14)]


def _read(st, per_chunk):
    requests = [("w", a * per_chunk, b * per_chunk, None) for a, b in RUNS]
    return requests, st.read_many(requests)


@pytest.mark.parametrize("fill", [True, False], ids=["default", "off"])
def test_a_gapped_local_read_is_exact_and_fills_only_short_gaps(step, monkeypatch, fill):
    st, tensor, _ = step
    plan, per_chunk = _layout(st)
    if not fill:  # the default fills
        monkeypatch.setattr(reader_v2, "FILL_GAPS", False)
    reads = _record_reads(monkeypatch)
    requests, outs = _read(st, per_chunk)
    for (_, lo, hi, _), out in zip(requests, outs, strict=True):
        assert torch.equal(out, tensor[lo:hi])
    stored = plan.stored_chunk_nbytes
    data = [r for r in reads if r[1] < plan.num_inner * stored]  # the index is read apart
    spans = _covered(data)
    if fill:  # [0, 7) read through, then the long gap is jumped
        assert spans == [(0, 7 * stored), (12 * stored, 14 * stored)], spans
    else:
        assert spans == [(0, 4 * stored), (6 * stored, 7 * stored), (12 * stored, 14 * stored)]


def test_no_fill_without_local_storage(step, monkeypatch):
    """A backend that reads ahead but is not local streams too, and never fills."""
    st, tensor, _ = step
    plan, per_chunk = _layout(st)
    monkeypatch.setattr(local.LocalStorage, "reads_locally", False)
    assert st._storage.reads_ahead and not st._storage.reads_locally
    reads = _record_reads(monkeypatch)
    requests, outs = _read(st, per_chunk)
    for (_, lo, hi, _), out in zip(requests, outs, strict=True):
        assert torch.equal(out, tensor[lo:hi])
    stored = plan.stored_chunk_nbytes
    data = [r for r in reads if r[1] < plan.num_inner * stored]
    assert _covered(data) == [(0, 4 * stored), (6 * stored, 7 * stored), (12 * stored, 14 * stored)]


def test_a_row_cut_inside_a_filled_gap_still_names_the_damage(step):
    """The fill meets the end of the file and stops quietly; the next run's read reports
    the short row as it would without the fill."""
    st, _, root = step
    plan, per_chunk = _layout(st)
    (row,) = [p for p in root.rglob("*") if p.is_file() and "/c/" in str(p)]
    with open(row, "r+b") as f:
        f.truncate(5 * plan.stored_chunk_nbytes)  # inside the gap [4, 6)
    with pytest.raises(CheckpointError) as err:
        _read(st, per_chunk)
    with_fill = str(err.value)
    reader_v2.FILL_GAPS = False
    try:
        with pytest.raises(CheckpointError) as err:
            _read(st, per_chunk)
    finally:
        reader_v2.FILL_GAPS = True
    assert with_fill == str(err.value)
