"""Retention after a save retires steps in two parts ([Note: retention off the save's path]
in zerostate/store/root.py): the retired steps stop being committed before the save
returns, and their data is removed on a thread that every later write or deletion of the
root waits for."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerostate.dcp import StorageWriter
from zerostate.store import CheckpointRoot, open_checkpoint, save_tensors
from zerostate.store import format as fmt

REPO = Path(__file__).resolve().parents[2]


def _saved(tmp: Path, steps) -> CheckpointRoot:
    for step in steps:
        save_tensors(str(tmp), step, {"model/w": torch.full((1031,), float(step))})
    return CheckpointRoot.open(str(tmp))


class _HeldRemoval:
    """Makes the root's storage wait in ``remove_tree`` until released."""

    def __init__(self, storage, monkeypatch) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        original = storage.remove_tree

        def held(path: str) -> None:
            self.entered.set()
            assert self.release.wait(30)
            original(path)

        monkeypatch.setattr(storage, "remove_tree", held)


def test_retired_steps_stop_being_committed_before_retain_returns(tmp_path, monkeypatch):
    root = _saved(tmp_path, range(4))
    (tmp_path / fmt.step_dir(9)).mkdir()  # a crashed save's partial step, below the saved one
    held = _HeldRemoval(root.storage, monkeypatch)
    root.check_save(10)  # the save guard's listing, which retention reuses
    save_tensors(root.storage, 10, {"model/w": torch.zeros(3)})
    start = time.perf_counter()
    root.retain(10, keep_last=2)
    assert time.perf_counter() - start < 10  # returned while the removal is held
    assert held.entered.wait(10)
    # No longer committed for anyone (a new root object lists from storage) ...
    assert open_checkpoint(str(tmp_path)).steps() == [3, 10]
    for step in (0, 1, 2):
        assert not (tmp_path / fmt.step_dir(step) / fmt.COMMIT_PATH).exists()
    # ... while their data is still being removed.
    assert (tmp_path / fmt.step_dir(2)).exists()
    held.release.set()
    root.wait_for_retention()
    listed = sorted(p.name for p in tmp_path.iterdir())
    assert listed == [fmt.step_dir(3), fmt.step_dir(10)]


def test_the_next_save_guard_waits_for_the_removal(tmp_path, monkeypatch):
    root = _saved(tmp_path, range(3))
    held = _HeldRemoval(root.storage, monkeypatch)
    root.retain(2, keep_last=1)
    assert held.entered.wait(10)
    done = threading.Event()
    found: list = []

    def guard() -> None:
        found.append(root.check_save(None))
        done.set()

    thread = threading.Thread(target=guard)
    thread.start()
    assert not done.wait(0.5)  # the guard waits for the removal in flight
    held.release.set()
    thread.join(30)
    assert done.is_set() and found[0].step == 3 and found[0].committed == (2,)
    assert not (tmp_path / fmt.step_dir(0)).exists() and not (tmp_path / fmt.step_dir(1)).exists()


def test_a_failed_removal_is_logged_and_the_next_retention_removes_what_is_left(
    tmp_path, monkeypatch, caplog
):
    root = _saved(tmp_path, range(3))
    storage = root.storage
    original = storage.remove_tree

    def failing(path: str) -> None:
        raise OSError("the disk refused")

    monkeypatch.setattr(storage, "remove_tree", failing)
    with caplog.at_level(logging.WARNING, logger="zerostate.store.root"):
        root.retain(2, keep_last=1)
        root.wait_for_retention()
    assert "the disk refused" in caplog.text and "no longer committed" in caplog.text
    assert root.steps() == [2]
    assert (tmp_path / fmt.step_dir(0)).exists()  # left as partial steps
    monkeypatch.setattr(storage, "remove_tree", original)
    root.check_save(3)
    save_tensors(root.storage, 3, {"model/w": torch.zeros(3)})
    root.retain(3, keep_last=1)
    root.wait_for_retention()
    assert sorted(p.name for p in tmp_path.iterdir()) == [fmt.step_dir(3)]


def test_a_process_that_exits_right_after_a_save_removes_the_retired_steps_first(tmp_path):
    _saved(tmp_path, range(2))
    script = f"""
import time, torch
from zerostate.store import CheckpointRoot, save_tensors
root = CheckpointRoot.open({str(tmp_path)!r})
slow = root.storage.remove_tree
def remove_tree(path):
    time.sleep(0.5)  # a large step's data
    slow(path)
root.storage.remove_tree = remove_tree
root.check_save(2)
save_tensors(root.storage, 2, {{"model/w": torch.zeros(3)}})
root.retain(2, keep_last=1)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [fmt.step_dir(2)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # no process group: DCP says it assumes one
def test_dcp_writer_close_waits_for_the_removal(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    writer = StorageWriter(root, keep_last=1)
    state = {"w": torch.arange(1031.0)}
    dcp.save(state, storage_writer=writer, no_dist=True)
    held = _HeldRemoval(writer._open_root().storage, monkeypatch)
    dcp.save(state, storage_writer=writer, no_dist=True)  # retires step 0
    assert open_checkpoint(root).steps() == [1]
    assert (Path(root) / fmt.step_dir(0)).exists()
    threading.Timer(0.3, held.release.set).start()
    writer.close()
    assert not (Path(root) / fmt.step_dir(0)).exists()


def test_a_directory_sync_returns_only_once_every_earlier_change_is_durable(tmp_path, monkeypatch):
    """[Note: one directory sync at a time]: a second thread's sync_dirs must not return
    while the first is still fsyncing directories changed before the second began."""
    import zerostate.store.local as local

    storage = local.LocalStorage(str(tmp_path))
    storage.makedirs(["a", "b"])
    storage.write("a/x", [b"1"])
    slow_started, synced = threading.Event(), {}
    real_fsync = local.os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("/a"):
            slow_started.set()
            time.sleep(0.5)
        real_fsync(fd)
        synced[path] = time.perf_counter()

    monkeypatch.setattr(local.os, "fsync", fsync)
    first = threading.Thread(target=storage.sync_dirs)
    first.start()
    assert slow_started.wait(10)
    storage.write("b/y", [b"2"])  # changed while the first sync runs
    storage.sync_dirs()
    returned = time.perf_counter()
    first.join(10)
    a = next(v for k, v in synced.items() if k.endswith("/a"))
    b = next(v for k, v in synced.items() if k.endswith("/b"))
    assert a <= returned and b <= returned
