"""The latest committed step is found from the newest step down, a batch of commit-record
checks at a time, and always agrees with the full scan."""

from __future__ import annotations

import random

import pytest

from zerostate.errors import CheckpointNotFoundError
from zerostate.store import format as fmt
from zerostate.store import root as root_mod
from zerostate.store.root import CheckpointRoot
from zerostate.store.storage import open_storage


def _layout(path, committed, partial):
    for step in [*committed, *partial]:
        d = path / fmt.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / "model").mkdir(exist_ok=True)
        if step in committed:
            record = d / fmt.COMMIT_PATH
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_bytes(b"{}")


def _counting_root(path, monkeypatch) -> tuple[CheckpointRoot, list[str]]:
    storage = open_storage(str(path))
    asked: list[str] = []
    real = storage.exists
    monkeypatch.setattr(storage, "exists", lambda p: asked.append(p) or real(p))
    return CheckpointRoot(storage), asked


def test_many_steps_cost_one_batch(tmp_path, monkeypatch):
    _layout(tmp_path, committed=range(1, 201), partial=range(201, 206))
    root, asked = _counting_root(tmp_path, monkeypatch)
    assert root.latest_step() == 200
    assert len(asked) == root_mod.LATEST_BATCH  # the newest batch, not all 205 steps
    assert all(fmt.step_dir(s) in "".join(asked) for s in range(205, 205 - len(asked), -1))


def test_partial_steps_above_the_latest_span_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(root_mod, "LATEST_BATCH", 4)
    _layout(tmp_path, committed=[3, 9], partial=[10, 11, 12, 13, 14, 15])
    root, asked = _counting_root(tmp_path, monkeypatch)
    assert root.latest_step() == 9
    assert len(asked) == 8  # 15..12, then 11, 10, 9 and 3 in the second batch


def test_no_committed_step_names_the_partial_ones(tmp_path):
    _layout(tmp_path, committed=[], partial=[2, 4, 6, 8, 10, 12, 14])
    with pytest.raises(CheckpointNotFoundError, match=r"uncommitted steps: \[6, 8, 10, 12, 14\]"):
        CheckpointRoot(open_storage(str(tmp_path))).latest_step()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed step"):
        CheckpointRoot(open_storage(str(empty))).latest_step()


@pytest.mark.parametrize("seed", range(6))
def test_it_agrees_with_the_full_scan(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(root_mod, "LATEST_BATCH", rng.choice([1, 2, 3, 16]))
    steps = rng.sample(range(1, 400), rng.randint(1, 40))
    committed = [s for s in steps if rng.random() < 0.4] or [steps[0]]
    _layout(tmp_path, committed=committed, partial=[s for s in steps if s not in committed])
    root = CheckpointRoot(open_storage(str(tmp_path)))
    assert root.latest_step() == root.scan()[0][-1] == max(committed)
