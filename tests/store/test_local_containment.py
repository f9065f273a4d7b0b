"""Local disk keeps every path inside the checkpoint root, without resolving the whole path
on every read ([Note: containment without realpath] in ``store/local.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from zerostate.errors import UnsafeNameError
from zerostate.layout.partition import TensorLayout, even_layout
from zerostate.store import rows
from zerostate.store.local import LocalStorage
from zerostate.store.rows import plan_groups

ROW = "step-00000001/model/c/0/0"
DEPTHS = ["step-00000001", "step-00000001/model", "step-00000001/model/c",
          "step-00000001/model/c/0", ROW]  # fmt: skip


def _tree(tmp_path):
    """A root holding ROW, and a directory outside it mirroring every level below."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / ROW).parent.mkdir(parents=True)
    (root / ROW).write_bytes(b"inside!!")
    (outside / ROW).parent.mkdir(parents=True)
    (outside / ROW).write_bytes(b"secret!!")
    return root, outside


def _link_out(root, outside, rel):
    """Replace ``root/rel`` (a directory or the object) by a link to ``outside/rel``."""
    target = root / rel
    if target.is_dir():
        os.rename(target, str(target) + ".moved")
    else:
        target.unlink()
    target.symlink_to(outside / rel, target_is_directory=(outside / rel).is_dir())


@pytest.mark.parametrize("rel", DEPTHS)
def test_a_link_out_at_any_depth_is_refused(tmp_path, rel):
    root, outside = _tree(tmp_path)
    storage = LocalStorage(str(root))
    assert storage.read(ROW) == b"inside!!"  # resolves and caches the root first
    _link_out(root, outside, rel)
    # Into the linked directory, or over the linked object.
    planted = ROW if rel == ROW else f"{rel}/planted"
    buf = memoryview(bytearray(8))
    for attempt in (
        lambda: storage.read(ROW),
        lambda: storage.read_range_into(ROW, 0, [buf]),
        lambda: storage.read_into(ROW, [buf]),
        lambda: storage.size(ROW),
        lambda: storage.write(planted, [b"x"]),
    ):
        with pytest.raises(UnsafeNameError, match="outside the checkpoint root"):
            attempt()
    assert bytes(buf) == bytes(8)
    assert not (outside / rel / "planted").exists()
    assert (outside / ROW).read_bytes() == b"secret!!"


@pytest.mark.parametrize("path", ["../outside/" + ROW, "step-00000001/../../outside/" + ROW])
def test_dot_dot_out_of_the_root_is_refused(tmp_path, path):
    root, _ = _tree(tmp_path)
    storage = LocalStorage(str(root))
    with pytest.raises(UnsafeNameError):
        storage.read(path)
    with pytest.raises(UnsafeNameError):
        storage.read_range_into(path, 0, [memoryview(bytearray(8))])


def test_links_and_dot_dot_that_stay_inside_are_followed(tmp_path):
    root, _ = _tree(tmp_path)
    (root / "alias").symlink_to(root / "step-00000001", target_is_directory=True)
    storage = LocalStorage(str(root))
    assert storage.read("alias/model/c/0/0") == b"inside!!"
    assert storage.read("step-00000001/model/../model/c/0/0") == b"inside!!"


def test_a_root_that_is_a_link_reads_normally(tmp_path):
    root, _ = _tree(tmp_path)
    link = tmp_path / "link-to-root"
    link.symlink_to(root, target_is_directory=True)
    storage = LocalStorage(str(link))
    buf = memoryview(bytearray(6))
    assert storage.read_range_into(ROW, 2, [buf]) == 6
    assert bytes(buf) == b"side!!"


def test_a_root_created_after_the_storage_is_resolved_when_it_exists(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    root = tmp_path / "root"
    storage = LocalStorage(str(root))
    with pytest.raises(FileNotFoundError):
        storage.read("x")
    root.symlink_to(real, target_is_directory=True)  # created later, as a link
    storage.write("x", [b"abc"])
    assert (real / "x").read_bytes() == b"abc"
    assert storage.read("x") == b"abc"


def test_plain_paths_cost_no_realpath(tmp_path, monkeypatch):
    root, _ = _tree(tmp_path)
    storage = LocalStorage(str(root))
    storage.read(ROW)  # the root is resolved once
    calls = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, **k: calls.append(p) or real(p, **k))
    buf = memoryview(bytearray(4))
    for _ in range(5):
        assert storage.read_range_into(ROW, 4, [buf]) == 4
    assert bytes(buf) == b"de!!" and calls == []


@pytest.mark.parametrize("block", [None, 1, 7])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 128])
def test_one_rank_row_size_equals_the_vectorised_sizes(world_size, block, monkeypatch):
    """``check_row`` sizes one rank's row; the writer sizes every rank at once, in blocks
    of slots (a slot per block, or a few, carry what is covered from block to block)."""
    if block is not None:
        monkeypatch.setattr(rows, "_SIZES_BLOCK", block * world_size)
    rng = np.random.default_rng(world_size)
    entries = [("g0/empty", even_layout(0, world_size), 4)]
    for k in range(40):
        numel = int(rng.integers(1, 5000))
        # Some tensors in fewer, larger chunks starting at other owners (small tensors).
        chunk = -(-numel // int(rng.integers(1, world_size + 1)))
        owner = int(rng.integers(0, world_size))
        layout = TensorLayout(numel, world_size, chunk, owner)
        entries.append((f"g{k % 3}/t{k:03d}", layout, int(rng.choice([1, 2, 4]))))
    for plan in plan_groups(entries, world_size).values():
        sizes = plan.object_sizes()
        assert [plan.object_nbytes(r) for r in range(world_size)] == sizes.tolist()
