"""[Note: one scan per save]: a blocking save lists the checkpoint root once (the save
guard's scan) and retention reuses that listing, checking again only the commit records of
partial steps it is about to delete."""

from __future__ import annotations

import collections

import pytest
import torch
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from zerostate.store import format as fmt
from zerostate.store.local import LocalStorage
from zerostate.store.root import CheckpointRoot
from zerostate.store.storage import open_storage


def _count(monkeypatch) -> collections.Counter:
    """Requests on local storage: root listings, commit-record checks and reads."""
    counts: collections.Counter = collections.Counter()
    real_list, real_exists_many = LocalStorage.list_dir, LocalStorage.exists_many
    real_read = LocalStorage.read

    def list_dir(self, path):
        counts["root listings" if path in ("", ".") else "other listings"] += 1
        return real_list(self, path)

    def exists_many(self, paths):
        counts["commit checks"] += sum(p.endswith(fmt.COMMIT_PATH) for p in paths)
        return real_exists_many(self, paths)

    def read(self, path, *args, **kwargs):
        counts["commit reads" if path.endswith(fmt.COMMIT_PATH) else "other reads"] += 1
        return real_read(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "list_dir", list_dir)
    monkeypatch.setattr(LocalStorage, "exists_many", exists_many)
    monkeypatch.setattr(LocalStorage, "read", read)
    return counts


def _train(engine, gen):
    loss = engine(torch.randn(3, 9, generator=gen)).square().mean()
    engine.backward(loss)
    engine.step()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("keep_last", [None, 2])
def test_a_blocking_save_lists_the_root_once(tmp_path, monkeypatch, keep_last):
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Linear(17, 5))
    engine = zerostate.Engine(model, stage=2, lr=1e-2)
    (tmp_path / fmt.step_dir(1)).mkdir()  # a crashed save's partial step
    for step in range(2, 7):
        _train(engine, gen)
        counts = _count(monkeypatch)
        engine.save(str(tmp_path), step=step, keep_last=keep_last)
        monkeypatch.undo()
        assert counts["root listings"] == 1, (step, counts)
        # every step directory's record once, plus the crashed step's again before it goes
        on_disk = step - 1 if keep_last is None else min(step - 1, keep_last + 1)
        assert counts["commit checks"] <= on_disk + 1, (step, counts)
    # close() waits for the last save's removal of the steps it retired ([Note: retention
    # off the save's path]); until then a retired step lists as partial.
    engine.close()
    committed, partial = CheckpointRoot(open_storage(str(tmp_path))).scan()
    assert partial == []  # the crashed step went with the first save
    assert committed == ([2, 3, 4, 5, 6] if keep_last is None else [5, 6])


def test_a_step_committed_after_the_scan_is_not_pruned_as_partial(tmp_path):
    for step in (3, 5):
        (tmp_path / fmt.step_dir(step)).mkdir()
    root = CheckpointRoot(open_storage(str(tmp_path)))
    assert root.check_save(7).ok  # lists 3 and 5 as partial
    record = tmp_path / fmt.step_dir(3) / fmt.COMMIT_PATH
    record.parent.mkdir(parents=True)
    record.write_bytes(b"{}")  # step 3 commits after the listing
    (tmp_path / fmt.step_dir(7)).mkdir()
    old, stale = root.prune(keep_last=None, partial_below=7, saved=7)
    assert (old, stale) == ([], [5])
    assert (tmp_path / fmt.step_dir(3)).is_dir() and not (tmp_path / fmt.step_dir(5)).exists()


def test_prune_without_a_save_still_lists(tmp_path):
    for step in (1, 2):
        (tmp_path / fmt.step_dir(step)).mkdir()
    root = CheckpointRoot(open_storage(str(tmp_path)))
    assert root.prune(keep_last=None, partial_below=2, saved=None) == ([], [1])
    assert root.prune(keep_last=None, partial_below=3, saved=5) == ([], [2])  # no save scan
