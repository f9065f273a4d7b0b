"""The reader's batches ([Note: read batches] in zerostate/dcp/common.py): whatever their
size, every box lands whole and checked, boxes narrower than their stored chunk included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import zerostate.dcp.reader as reader_mod
from zerostate.dcp import StorageReader, StorageWriter


def _state() -> dict:
    torch.manual_seed(3)
    return {
        "a": torch.randn(257, 131),
        "b": torch.randn(3, 5, 7).to(torch.bfloat16),
        "c": torch.arange(100_003, dtype=torch.int64),
        "d": torch.randn(()),
        "e": torch.randn(1, 4099),
        "nested": {"f": torch.randn(33, 2), "step": 11},
    }


@pytest.mark.parametrize("batch_nbytes", [1, 513, 4096, 1 << 20, 32 << 20])
def test_every_batch_size_loads_the_state_bit_identical(tmp_path, monkeypatch, batch_nbytes):
    state = _state()
    dcp.save(state, storage_writer=StorageWriter(tmp_path), no_dist=True)
    monkeypatch.setattr(reader_mod, "READ_BATCH_NBYTES", batch_nbytes)
    target = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }
    target["nested"] = {"f": torch.zeros(33, 2), "step": 0}
    dcp.load(target, storage_reader=StorageReader(tmp_path), no_dist=True)
    for key in "abcde":
        assert torch.equal(target[key], state[key]), key
    assert torch.equal(target["nested"]["f"], state["nested"]["f"])
    assert target["nested"]["step"] == 11


@pytest.mark.parametrize("batch_nbytes", [1, 700, 32 << 20])
def test_boxes_narrower_than_their_chunk_across_batches(tmp_path, monkeypatch, batch_nbytes):
    """A target that is a column slice of each stored 2-D tensor (a DTensor-free way to ask
    for part of every row): read in batches of any size, each box is the saved columns."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    state = {"a": torch.randn(41, 10), "b": torch.randn(7, 6)}
    dcp.save(state, storage_writer=StorageWriter(tmp_path), no_dist=True)
    monkeypatch.setattr(reader_mod, "READ_BATCH_NBYTES", batch_nbytes)
    halves = {k: torch.zeros(v.shape[0], v.shape[1] // 2) for k, v in state.items()}

    class RightHalves(DefaultLoadPlanner):
        """Asks for the right half of every 2-D tensor: boxes narrower than the chunk."""

        def create_local_plan(self):
            from torch.distributed.checkpoint.planner import LoadPlan

            items = []
            for key, value in halves.items():
                md = self.metadata.state_dict_metadata[key]
                box = ChunkStorageMetadata(
                    offsets=torch.Size([0, value.shape[1]]), sizes=value.shape
                )
                items += create_read_items_for_chunk_list(key, md, [box])
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            out = halves[read_item.dest_index.fqn]
            pairs = zip(read_item.dest_offsets, read_item.lengths, strict=True)
            for dim, (at, n) in enumerate(pairs):
                out = out.narrow(dim, at, n)
            return out

        def commit_tensor(self, read_item, tensor):
            pass  # resolve_tensor returned a view of the target

    dcp.load(
        {k: torch.zeros_like(v) for k, v in state.items()},
        storage_reader=StorageReader(tmp_path),
        planner=RightHalves(),
        no_dist=True,
    )
    for key, value in state.items():
        assert torch.equal(halves[key], value[:, value.shape[1] // 2 :]), key
