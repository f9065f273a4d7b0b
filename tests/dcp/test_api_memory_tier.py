"""``zerostate.save(state, root, tier="memory")``: the memory tier of the save session
([Note: memory tier] in zerostate.checkpoint.tiers) for any trainer's state, on two simulated
nodes (a memory directory and a GROUP_RANK per rank, as torchrun's agents give them);
``zerostate.load`` reads the step persisted to the durable root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import zerostate
from tests.dcp import session_workers, workers
from tests.dcp.test_api import assert_same
from tests.helpers_dist import run_distributed
from zerostate.store import open_checkpoint
from zerostate.store.memory_tier import run_id
from zerostate.store.storage import canonical_location

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_memory_tier_on_two_nodes_then_load_the_durable_copy(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(session_workers.memory_tier_saves, 2, str(tmp_path), root)
    for r in results:
        assert r["steps"] == [0, 1], r
        assert not r["durable_after_first"]  # memory only until the second save
    assert open_checkpoint(root).steps() == [1]  # every second memory save is persisted
    run = f"run-{run_id(canonical_location(root))}"
    for node in (0, 1):
        for step in (0, 1):
            base = Path(tmp_path, f"shm-node{node}", run, f"step-{step:08d}")
            assert (base / "_zerostate/commit/zarr.json").exists()
            # Its own rank's row and the other node's replica.
            assert sorted(p.name for p in (base / "dcp/c").iterdir()) == ["0", "1"]
    model, opt, sched = workers.ddp_parts(1, 0.5)
    assert zerostate.load({"model": model, "optim": opt, "sched": sched}, root) == 1
    assert_same(workers.ddp_state(model, opt, sched), results[0]["saved"])
    assert not os.path.exists(os.path.join(root, "step-00000000"))


def _same_state(a: dict, b: dict) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def test_zerostate_load_reads_the_memory_tier_then_replicas_then_the_root(tmp_path):
    """``zerostate.load`` finds the newest step as ``engine.load`` does: this node's memory,
    else the other nodes' replicas, else the durable root; rank 0 says which."""
    root = str(tmp_path / "ckpt")
    results = run_distributed(session_workers.memory_tier_loads, 2, str(tmp_path), root)
    for r in results:
        assert r["saved0"] == 0 and r["memory_steps"] == [1, 2], r
        assert (r["own"], r["replicas"], r["fallback"]) == (2, 2, 0), r
        assert _same_state(r["own_state"], r["memory_state"])
        assert _same_state(r["replicas_state"], r["memory_state"])
        assert _same_state(r["fallback_state"], r["saved0_state"])
        assert not _same_state(r["memory_state"], r["saved0_state"])  # the check can fail
    lines = results[0]
    assert "step 2 from the memory tier: 2 node(s) from their own memory" in lines["own_line"]
    assert "node(s) [1] from their peers' replicas" in lines["replicas_line"]
    assert "step 0 from the durable tier" in lines["fallback_line"], lines["fallback_line"]
    assert open_checkpoint(root).steps() == [0]  # the memory steps never reached the root
