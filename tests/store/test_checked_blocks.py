"""Local reads of small inner chunks go through checked blocks ([Note: checked blocks] in
``reader_v2.py``): the bytes equal those of the in-place read, a damaged chunk is named as
the in-place read names it, and a short row ends the read the same way."""

from __future__ import annotations

import os
import random
import struct

import crc32c
import pytest
import torch
from _store_helpers import make_tensors, write_step

from zerostate.errors import CorruptCheckpointError
from zerostate.store import open_checkpoint, reader_v2
from zerostate.store.rows import row_path

# Odd sizes: several rows of 256-byte inner chunks each, pieces that start and end inside
# chunks, a tensor smaller than one chunk and one of one element.
SHAPES = {
    "model/a": ((37, 211), torch.float32),
    "model/b": ((3001,), torch.float32),
    "model/c": ((7,), torch.float32),
    "model/d": ((1,), torch.float32),
    "model/e": ((129, 65), torch.bfloat16),
    "optim/exp_avg/a": ((37, 211), torch.float32),
    "optim/exp_avg/b": ((3001,), torch.float32),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("blocks") / "ckpt"
    tensors = make_tensors(3, shapes=SHAPES)
    write_step(str(root), 1, tensors, world_size=2)
    return root, tensors


def _in_place(monkeypatch):
    monkeypatch.setattr(reader_v2, "MIN_BLOCK_CHUNKS", 10**9)


def _blocks_of(monkeypatch, chunks: int | None):
    """Blocks of ``chunks`` stored chunks (None: the default size), counting block reads."""
    calls = []
    real = reader_v2.StepReaderV2._read_blocks

    def spy(self, plan, *args):
        calls.append(plan.inner)
        return real(self, plan, *args)

    monkeypatch.setattr(reader_v2.StepReaderV2, "_read_blocks", spy)
    monkeypatch.setattr(reader_v2, "MIN_BLOCK_CHUNKS", 4)
    if chunks is not None:
        monkeypatch.setattr(reader_v2, "BLOCK_NBYTES", chunks * (256 + 4))
    return calls


def _requests(st, rng):
    out = []
    for name, info in sorted(st.tensors.items()):
        n = info.numel
        out.append((name, 0, n))
        for _ in range(4):
            a = rng.randrange(n)
            out.append((name, a, rng.randrange(a, n) + 1))
    return out


def _read(st, requests):
    return [t.clone() for t in st.read_many([(n, a, b, None) for n, a, b in requests])]


@pytest.mark.parametrize("chunks", [4, 5, 9, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_reads_equal_in_place_reads_and_the_source(saved, monkeypatch, chunks, seed):
    root, tensors = saved
    st = open_checkpoint(str(root)).step(1)
    assert {p.inner for p in st._plans.values()} == {256}
    requests = _requests(st, random.Random(seed))
    with monkeypatch.context() as m:
        _in_place(m)
        expected = _read(st, requests)
    calls = _blocks_of(monkeypatch, chunks)
    got = _read(st, requests)
    assert calls, "the block path was not taken"
    for (name, a, b), want, have in zip(requests, expected, got, strict=True):
        assert torch.equal(have, want), (name, a, b)
        assert torch.equal(have, tensors[name].reshape(-1)[a:b]), (name, a, b)


def _row_file(root, group="model", rank=0):
    st = open_checkpoint(str(root)).step(1)
    return root / f"step-{1:08d}" / row_path(group, rank), st._plans[group]


def _error(root, monkeypatch, name, blocks: bool) -> str:
    with monkeypatch.context() as m:
        if blocks:
            _blocks_of(m, 4)
        else:
            _in_place(m)
        st = open_checkpoint(str(root)).step(1)
        with pytest.raises(CorruptCheckpointError) as info:
            st.read(name)
    return str(info.value)


@pytest.mark.parametrize("where", ["payload", "checksum"])
@pytest.mark.parametrize("chunk", [0, 5, 6, 11])
def test_a_damaged_chunk_is_named_as_in_place_reads_name_it(
    saved, tmp_path, monkeypatch, where, chunk
):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, plan = _row_file(root)
    stored = plan.stored_chunk_nbytes
    data = bytearray(path.read_bytes())
    at = chunk * stored + (17 if where == "payload" else plan.inner + 2)
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    # model/a is the group's first tensor and fills its first chunks of rank 0's row.
    in_place = _error(root, monkeypatch, "model/a", blocks=False)
    in_blocks = _error(root, monkeypatch, "model/a", blocks=True)
    assert f"inner chunk {chunk}, fails its checksum" in in_blocks
    assert in_blocks == in_place


def test_two_damaged_chunks_name_the_first(saved, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, plan = _row_file(root)
    data = bytearray(path.read_bytes())
    for chunk in (6, 7):  # the same block of 4
        data[chunk * plan.stored_chunk_nbytes + 3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "inner chunk 6," in _error(root, monkeypatch, "model/a", blocks=True)


@pytest.mark.parametrize("keep_chunks", [0, 3, 6])
def test_a_short_row_ends_the_read_as_in_place_reads_end_it(
    saved, tmp_path, monkeypatch, keep_chunks
):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, plan = _row_file(root)
    data = path.read_bytes()
    path.write_bytes(data[: keep_chunks * plan.stored_chunk_nbytes + 100])
    in_place = _error(root, monkeypatch, "model/a", blocks=False)
    in_blocks = _error(root, monkeypatch, "model/a", blocks=True)
    assert "ends early" in in_blocks
    assert in_blocks == in_place


def test_a_missing_row_is_reported_as_in_place_reads_report_it(saved, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, _ = _row_file(root)
    os.unlink(path)
    in_place = _error(root, monkeypatch, "model/a", blocks=False)
    assert _error(root, monkeypatch, "model/a", blocks=True) == in_place
    assert "is missing" in in_place


@pytest.mark.parametrize("size", [256, 300, 8192])
def test_a_blocks_checksum_is_one_value_for_each_length(size):
    rng = random.Random(size)
    residues = reader_v2._residues(size, 6)
    assert len(set(residues)) == len(residues)
    for k in range(7):
        for _ in range(3):
            payloads = [rng.randbytes(size) for _ in range(k)]
            block = b"".join(p + struct.pack("<I", crc32c.crc32c(p)) for p in payloads)
            assert crc32c.crc32c(block) == residues[k]
            if k:
                damaged = bytearray(block)
                damaged[rng.randrange(len(block))] ^= 1 << rng.randrange(8)
                assert crc32c.crc32c(bytes(damaged)) != residues[k]


def _verify_error(root) -> str:
    st = open_checkpoint(str(root)).step(1)
    with pytest.raises(CorruptCheckpointError) as info:
        st.verify()
    return str(info.value)


def _damaged_chunks(message: str, what: str) -> list[int]:
    import re

    row = "rank 0's row of group 'model'"
    return sorted(
        int(m.group(1))
        for line in message.split("; ")
        if row in line
        for m in [re.search(rf"inner chunk (\d+), {what}", line)]
        if m
    )


@pytest.mark.parametrize("chunks", [4, None])
def test_verify_names_every_damaged_chunk(saved, tmp_path, monkeypatch, chunks):
    import shutil

    if chunks is not None:
        monkeypatch.setattr(reader_v2, "BLOCK_NBYTES", chunks * (256 + 4))
    open_checkpoint(str(saved[0])).step(1).verify()  # the pristine step passes
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, plan = _row_file(root)
    data = bytearray(path.read_bytes())
    damaged = [1, 2, 9, 40]  # two in one block of 4, one in another, one further on
    for chunk in damaged:
        data[chunk * plan.stored_chunk_nbytes + (chunk % plan.inner)] ^= 0x10
    path.write_bytes(bytes(data))
    assert _damaged_chunks(_verify_error(root), "fails its checksum") == damaged


def test_verify_names_the_chunks_a_short_row_lacks(saved, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(reader_v2, "BLOCK_NBYTES", 4 * (256 + 4))
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path, plan = _row_file(root)
    count = len([j for a, b in plan.present(0) for j in range(a, b)])
    keep = count - 3
    path.write_bytes(path.read_bytes()[: keep * plan.stored_chunk_nbytes + 100])
    message = _verify_error(root)
    assert _damaged_chunks(message, "is cut short") == list(range(keep, count))
    assert _damaged_chunks(message, "fails its checksum") == []
    assert "shard index is damaged" in message
