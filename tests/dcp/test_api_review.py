"""Review: failure paths of zerostate.save."""

from __future__ import annotations

import pytest

from tests.dcp import review_workers
from tests.helpers_dist import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("where", ["write", "commit"])
def test_one_rank_failing_to_write_or_commit_fails_every_rank(tmp_path, blocking, where):
    root = str(tmp_path / "ckpt")
    results = run_distributed(review_workers.write_fails, 2, root, blocking, where)
    print(results)
    for r in results:
        assert r["first"]["type"] is not None, r
        assert r["first"]["s"] < 20, r
        assert r["committed_after_first"] == [], r
    assert results[0]["committed"] == results[1]["committed"]


def test_a_durable_save_does_not_delete_the_memory_steps_copy_in_flight(tmp_path, monkeypatch):
    """A non-blocking memory save whose step is being copied to the root in the background,
    then a durable save of a later step to the same root: the durable save's retention
    (partial steps below its own) must not delete the copy while it is being written."""
    import time

    import torch

    import zerostate
    from zerostate.api import _ROOTS
    from zerostate.store import format as fmt
    from zerostate.store import open_checkpoint

    root = str(tmp_path / "ckpt")
    monkeypatch.setenv("ZEROSTATE_MEMORY_DIR", str(tmp_path / "shm"))
    storage = _ROOTS.open(root).storage
    target = f"{fmt.step_dir(5)}/{fmt.COMMIT_PATH}"
    write = type(storage).write

    def slow_commit(self, path, data, *args, **kwargs):
        if path == target:  # the copy's commit record comes late
            time.sleep(1.0)
        return write(self, path, data, *args, **kwargs)

    monkeypatch.setattr(type(storage), "write", slow_commit)
    state = {"t": torch.arange(100.0)}
    handle = zerostate.save(state, root, 5, tier="memory", memory_durable_every=1, blocking=False)
    manifest = tmp_path / "ckpt" / fmt.step_dir(5) / fmt.manifest_path(0)
    deadline = time.monotonic() + 30
    while not manifest.exists() and time.monotonic() < deadline:  # the copy is under way
        time.sleep(0.01)
    assert zerostate.save({"t": torch.zeros(100)}, root, 6) == 6
    handle.wait()
    assert open_checkpoint(root).steps() == [5, 6]
    got = {"t": torch.empty(100)}
    import shutil

    shutil.rmtree(tmp_path / "shm")  # load step 5 from the root, not from memory
    assert zerostate.load(got, root, 5) == 5
    assert torch.equal(got["t"], state["t"])


def test_one_rank_failing_to_copy_a_memory_step_to_the_root_fails_the_others_at_once(tmp_path):
    """Blocking memory save with a durable copy; rank 1's copy fails. Rank 0 must not poll
    for rank 1's manifest until the commit timeout (20 s here), nothing is committed."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(review_workers.persist_fails_on_rank1, 2, str(tmp_path), root)
    print(results)
    for r in results:
        assert r["result"]["type"] is not None, r
        assert r["result"]["s"] < 10, r
        assert r["committed"] == [], r


def test_each_memory_save_copies_to_the_root_by_its_own_memory_durable_every(tmp_path):
    """A save's memory_durable_every applies to that save, not to the save still running
    in the background when it is called (else ranks whose background saves are at
    different points could disagree on whether a step is copied)."""
    root = str(tmp_path / "ckpt")
    (result,) = run_distributed(review_workers.durable_every_of_each_save, 1, str(tmp_path), root)
    assert result["committed"] == [1], result


def test_a_memory_save_does_not_delete_the_previous_steps_copy_in_flight(tmp_path):
    """The save guard of a memory save (step None) checks the step after the root's newest
    committed one: the step being copied there. It must not remove it as a crashed save's
    partial directory: memory saves write nothing into the root."""
    root = str(tmp_path / "ckpt")
    (result,) = run_distributed(review_workers.memory_saves_during_a_copy, 1, str(tmp_path), root)
    assert result["second"]["type"] is None, result
    assert result["persist"]["type"] is None, result
    assert result["committed"] == [0, 1], result
