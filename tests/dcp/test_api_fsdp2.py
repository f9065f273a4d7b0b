"""``zerostate.save`` / ``zerostate.load`` of an FSDP2 model and its optimizer: the state's
DTensors go through the save session as DCP's planner lays them out ([Note: zerostate.save
through the session] in zerostate.dcp.source) and load at other layouts and world sizes."""

from __future__ import annotations

import pytest

from tests.dcp import session_workers
from tests.dcp.test_api import assert_same
from tests.helpers_dist import run_distributed
from zerostate.store import open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_an_fsdp2_state_loads_at_other_layouts_bit_identical(tmp_path):
    """Saved non-blocking at 2 ranks (uneven ``Shard(0)``; the next step runs while the
    save is in flight), loaded at 3 ranks, by columns at 2, and in one process unsharded:
    the full state as of the save call each time."""
    root = str(tmp_path / "ckpt")
    saved = run_distributed(session_workers.fsdp2_api_save, 2, root)
    assert [r["step"] for r in saved] == [0, 0]
    for world_size, layout in ((3, "shard0"), (2, "shard1"), (1, "plain")):
        got = run_distributed(session_workers.fsdp2_api_load, world_size, root, layout)[0]
        assert got["step"] == 0, (world_size, layout)
        assert_same(got["full"], saved[0]["full"], f"{world_size} {layout}")


def test_an_fsdp2_state_saved_at_four_ranks_loads_at_three_and_one(tmp_path):
    """Four ranks: each writes its row from its own pieces and the row view rank 0 sent it
    ([Note: row views] in zerostate.store.rows); every rank's row, then loads elsewhere."""
    root = str(tmp_path / "ckpt")
    saved = run_distributed(session_workers.fsdp2_api_save, 4, root, timeout=600)
    assert [r["step"] for r in saved] == [0] * 4
    with open_checkpoint(root).step(0) as step:
        assert sorted(r for _, r, _ in step.row_objects()) == [0, 1, 2, 3]
        step.verify()
    for world_size, layout in ((3, "shard0"), (1, "plain")):
        got = run_distributed(
            session_workers.fsdp2_api_load, world_size, root, layout, timeout=600
        )[0]
        assert got["step"] == 0, (world_size, layout)
        assert_same(got["full"], saved[0]["full"], f"{world_size} {layout}")
