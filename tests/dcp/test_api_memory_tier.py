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
