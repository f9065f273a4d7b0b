"""Large objects on local disk written past the page cache when asked ([Note: direct
writes] in zerostate/store/local.py): every byte lands, the file has its exact size, and a
filesystem without direct I/O gets the page-cache write instead."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

import zerostate
from zerostate.errors import StorageError
from zerostate.store import local
from zerostate.store.local import LocalStorage

BLOCK = local._DIRECT_BLOCK


def _parts(rng: random.Random, total: int) -> list[bytes]:
    parts, left = [], total
    while left:
        n = min(left, rng.choice([1, 4, 37, 4096, 8196, 65536, 1 << 20]))
        parts.append(rng.randbytes(n))
        left -= n
    return parts


@pytest.fixture
def direct_flags(monkeypatch):
    """Every object written directly; the flags of each open are recorded."""
    monkeypatch.setattr(local, "DIRECT_MIN_NBYTES", 0)
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "1")
    seen: list[int] = []
    real_open = os.open

    def recording(path, flags, *args):
        seen.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", recording)
    return seen


@pytest.mark.parametrize(
    "size", [0, 1, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + BLOCK // 2 + 3]
)
def test_a_direct_write_holds_every_byte_at_its_size(tmp_path, direct_flags, size):
    parts = _parts(random.Random(size), size)
    storage = LocalStorage(str(tmp_path))
    storage.write("obj", parts)
    assert (tmp_path / "obj").read_bytes() == b"".join(parts)
    assert not (tmp_path / "obj.partial").exists()
    assert any(f & os.O_DIRECT for f in direct_flags), "not written directly"
    assert storage.direct_writes


def test_a_filesystem_without_direct_io_gets_page_cache_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "DIRECT_MIN_NBYTES", 0)
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "1")
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "direct I/O not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", no_direct)
    storage = LocalStorage(str(tmp_path))
    parts = _parts(random.Random(1), BLOCK + 5)
    storage.write("obj", parts)
    assert (tmp_path / "obj").read_bytes() == b"".join(parts)
    assert not storage.direct_writes  # asked once, not again for every object


@pytest.mark.parametrize("at_block", [0, 1])
def test_a_refused_direct_write(tmp_path, direct_flags, monkeypatch, at_block):
    """Refused at the first block: the object is written through the page cache instead.
    Refused after a block went through: an error, and no object under the name."""
    real_pwrite = os.pwrite
    calls = []

    def refusing(fd, data, offset):
        calls.append(offset)
        if len(calls) == at_block + 1:
            raise OSError(errno.EINVAL, "alignment")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", refusing)
    storage = LocalStorage(str(tmp_path))
    parts = _parts(random.Random(2), 2 * BLOCK + 9)
    if at_block == 0:
        storage.write("obj", parts)
        assert (tmp_path / "obj").read_bytes() == b"".join(parts)
        assert not storage.direct_writes
    else:
        with pytest.raises(StorageError, match="obj"):
            storage.write("obj", parts)
        assert not (tmp_path / "obj").exists()


def test_direct_writes_are_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(local.DIRECT_WRITES_ENV, raising=False)
    assert not LocalStorage(str(tmp_path)).direct_writes
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "1")
    assert LocalStorage(str(tmp_path)).direct_writes
    assert not LocalStorage(str(tmp_path), direct_writes=False).direct_writes
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "0")
    assert LocalStorage(str(tmp_path), direct_writes=True).direct_writes


def test_a_step_written_directly_loads_every_checked_byte(tmp_path, direct_flags):
    """A saved step whose rows went past the page cache loads (every chunk checked against
    its crc32c on the way) as the saved tensors, odd shapes and dtypes included."""
    torch.manual_seed(0)
    state = {
        "a": torch.randn(1031, 517),
        "b": torch.randn(3, 5, 7).to(torch.bfloat16),
        "c": torch.arange(12345, dtype=torch.int64),
        "d": torch.randn(()),
    }
    zerostate.save(state, str(tmp_path / "root"))
    assert any(f & os.O_DIRECT for f in direct_flags)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    assert zerostate.load(loaded, str(tmp_path / "root")) == 0
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
