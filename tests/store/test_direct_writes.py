"""Large objects on local disk written past the page cache, by default ([Note: direct
writes] in zerostate/store/local.py): every byte lands, the file has its exact size, and a
filesystem without direct I/O gets the page-cache write instead, whenever it refuses."""

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


@pytest.mark.parametrize("at_block", [0, 1, 2])
def test_a_refused_direct_write_is_written_again_through_the_page_cache(
    tmp_path, direct_flags, monkeypatch, at_block
):
    """Refused at the first block, after a block went through, or at the padded tail (a
    stricter alignment): the object is written again from its first byte through the page
    cache, holds every byte at its size, and the storage asks no more."""
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
    storage.write("obj", parts)
    assert (tmp_path / "obj").read_bytes() == b"".join(parts)
    assert not (tmp_path / "obj.partial").exists()
    assert len(calls) == at_block + 1, "blocks were written after the refusal"
    assert not storage.direct_writes
    direct_flags.clear()
    storage.write("obj2", parts)  # not asked again
    assert not any(f & os.O_DIRECT for f in direct_flags)
    assert (tmp_path / "obj2").read_bytes() == b"".join(parts)


def test_another_error_of_a_direct_write_fails_the_write(tmp_path, direct_flags, monkeypatch):
    """An I/O error is not a refusal: the write fails naming the object, and nothing is left
    under its name."""
    real_pwrite = os.pwrite
    calls = []

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "disk error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", failing)
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(StorageError, match="obj"):
        storage.write("obj", _parts(random.Random(3), 3 * BLOCK + 1))
    assert not (tmp_path / "obj").exists()
    assert storage.direct_writes


def test_direct_writes_are_on_unless_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv(local.DIRECT_WRITES_ENV, raising=False)
    assert LocalStorage(str(tmp_path)).direct_writes
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "0")
    assert not LocalStorage(str(tmp_path)).direct_writes
    assert LocalStorage(str(tmp_path), direct_writes=True).direct_writes
    monkeypatch.setenv(local.DIRECT_WRITES_ENV, "1")
    assert not LocalStorage(str(tmp_path), direct_writes=False).direct_writes


def test_large_objects_are_written_directly_by_default(tmp_path, monkeypatch):
    """At default settings an object of ``DIRECT_MIN_NBYTES`` goes past the page cache and a
    smaller one does not."""
    monkeypatch.delenv(local.DIRECT_WRITES_ENV, raising=False)
    seen: list[tuple[str, int]] = []
    real_open = os.open

    def recording(path, flags, *args):
        seen.append((os.path.basename(path), flags))
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", recording)
    storage = LocalStorage(str(tmp_path))
    big = _parts(random.Random(4), local.DIRECT_MIN_NBYTES)
    storage.write("big", big)
    storage.write("small", [b"x" * (local.DIRECT_MIN_NBYTES - 1)])
    direct = {name for name, flags in seen if flags & os.O_DIRECT}
    if storage.direct_writes:  # this filesystem takes direct I/O (not tmpfs before Linux 6.6)
        assert direct == {"big.partial"}
    else:
        assert direct <= {"big.partial"}
    assert (tmp_path / "big").read_bytes() == b"".join(big)


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
