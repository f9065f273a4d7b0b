"""What a save's coordinator sends each rank does not grow with the number of ranks.

Each rank's StorageWriter (``dcp.save``) and each rank's part of ``zerostate.save``'s plan
get that rank's own pieces and the row views that place them ([Note: row views] in
zerostate/store/rows.py), not the whole piece list: sent to every rank, that list made a
save's planning quadratic in ranks (at 256 ranks and 300 tensors, 76 s of pickling on the
coordinator and 2.2 GB scattered per save). Driven here in one process, as DCP's
``_save_state_dict`` drives a storage writer on N ranks, with the real planner
(``benchmarks/dcp_plan_scale.py``'s driver); the step is then loaded back whole and verified.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from benchmarks.dcp_plan_scale import drive_save
from zerostate.dcp import StorageReader
from zerostate.dcp.source import DcpSource
from zerostate.dcp.staging import StagingBuffers
from zerostate.store import open_checkpoint

SHAPES = [(3, 5), (17,), (0,), (2, 3, 4), (), (31, 7)]


def _rank_state(rank: int) -> dict[str, torch.Tensor]:
    """Keys of this rank only (nothing for DCP to de-duplicate), odd and empty shapes."""
    gen = torch.Generator().manual_seed(rank)
    state = {}
    for i, shape in enumerate(SHAPES):
        dtype = torch.bfloat16 if i % 3 == 1 else torch.float32
        state[f"r{rank}.t{i}"] = torch.randn(shape, generator=gen).to(dtype)
    return state


def test_what_each_rank_is_sent_by_dcp_save_does_not_grow_with_ranks(tmp_path):
    sizes = {}
    for world_size in (4, 32):
        root = str(tmp_path / f"w{world_size}")
        states = [_rank_state(r) for r in range(world_size)]
        sent = drive_save(states, root)["sent"]
        for r in range(1, world_size):
            assert {p.owner for p in pickle.loads(sent[r]).storage_data.pieces} == {r}
        sizes[world_size] = max(len(b) for b in sent[1:])
        expected = {k: v for s in states for k, v in s.items()}
        loaded = {k: torch.empty_like(v) for k, v in expected.items()}
        dcp.load(loaded, storage_reader=StorageReader(root), no_dist=True)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
        with open_checkpoint(root).step() as step:
            step.verify()
            assert len(list(step.row_objects())) == world_size  # one row object per rank
    # Eight times the ranks: each rank's part the same size (its own six pieces), where
    # the whole piece list would make it about eight times larger.
    assert sizes[32] < 1.25 * sizes[4], sizes


@pytest.mark.parametrize("world_size", [4, 32])
def test_what_zerostate_save_sends_each_rank_holds_its_own_pieces(tmp_path, world_size):
    states = [_rank_state(r) for r in range(world_size)]
    gathered, planners = [], []
    for r in range(world_size):
        planner = DefaultSavePlanner()
        planner.set_up_planner(states[r], StorageMeta(checkpoint_id=str(tmp_path)), r == 0)
        gathered.append((planner.create_local_plan(), {}))
        planners.append(planner)
    source = DcpSource(
        states[0], root=str(tmp_path), step=0, rank=0, world_size=world_size,
        staging=StagingBuffers(),
    )  # fmt: skip
    parts = source._global_plan(planners[0], gathered)
    assert parts[0].pieces == ()  # rank 0 keeps every piece itself
    for r in range(1, world_size):
        assert [p.owner for p in parts[r].pieces] == [r] * len(SHAPES)
        assert set(parts[r].views) == {"dcp"}
    # What rank 0 checks each manifest against: one digest per other rank.
    assert sorted(source._parts.digests) == list(range(1, world_size))
    assert len(source._parts.pieces[0]) == len(SHAPES) * world_size
