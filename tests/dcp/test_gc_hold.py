"""The objects of the process are held out of the collector's walks while a save or a load
runs through our DCP writer or reader, and put back when it ends, failed or not ([Note: the
heap held out of collections] in zerostate/dcp/common.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from zerostate.dcp import StorageReader, StorageWriter
from zerostate.dcp.common import GcHold


@pytest.fixture(autouse=True)
def _clean_collector():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    gc.unfreeze()
    gc.enable()


def test_holds_nest_and_the_last_release_puts_the_heap_back():
    first, second = GcHold(), GcHold()
    first.hold()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    first.hold()  # twice on one holder counts once
    second.hold()
    first.release()
    assert gc.get_freeze_count() == frozen, "released while another hold is on"
    second.release()
    assert gc.get_freeze_count() == 0
    second.release()  # a release without a hold does nothing
    assert gc.get_freeze_count() == 0


def test_a_holder_gone_without_its_release_does_not_keep_the_heap_frozen():
    """A save that failed between hooks leaves its writer's hold; once the writer is freed,
    the next release in the process puts the heap back."""
    leaked, other = GcHold(), GcHold()
    leaked.hold()
    other.hold()
    del leaked
    gc.collect()
    assert gc.get_freeze_count() > 0
    other.release()
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_own_objects_keeps_them_frozen():
    gc.freeze()
    frozen = gc.get_freeze_count()
    hold = GcHold()
    hold.hold()
    assert gc.get_freeze_count() <= frozen, "froze the process's objects a second time"
    hold.release()
    # Still frozen, nothing more. Not equal: a frozen object that dies meanwhile (another
    # test's thread finishing in this process) leaves the count.
    assert 0 < gc.get_freeze_count() <= frozen


def test_a_collector_that_is_off_is_left_alone():
    gc.disable()
    hold = GcHold()
    hold.hold()
    assert gc.get_freeze_count() == 0
    hold.release()
    assert not gc.isenabled()


class _Seen(DefaultSavePlanner):
    """Records the frozen count DCP's own planning ran under."""

    counts: list[int] = []

    def create_global_plan(self, all_plans):
        _Seen.counts.append(gc.get_freeze_count())
        return super().create_global_plan(all_plans)


class _SeenLoad(DefaultLoadPlanner):
    counts: list[int] = []

    def create_global_plan(self, global_plan):
        _SeenLoad.counts.append(gc.get_freeze_count())
        return super().create_global_plan(global_plan)


def test_a_save_and_a_load_hold_the_heap_while_they_run_and_only_then(tmp_path):
    state = {"w": torch.randn(37, 5), "b": torch.arange(7), "step": 3}
    _Seen.counts.clear()
    dcp.save(state, storage_writer=StorageWriter(tmp_path), planner=_Seen(), no_dist=True)
    assert _Seen.counts and _Seen.counts[0] > 0, "DCP's global plan ran with the heap walked"
    assert gc.get_freeze_count() == 0, "the save left the heap frozen"
    target = {"w": torch.zeros(37, 5), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    _SeenLoad.counts.clear()
    dcp.load(target, storage_reader=StorageReader(tmp_path), planner=_SeenLoad(), no_dist=True)
    assert _SeenLoad.counts and _SeenLoad.counts[0] > 0
    assert gc.get_freeze_count() == 0, "the load left the heap frozen"
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3


def test_a_failed_save_or_load_puts_the_heap_back(tmp_path):
    writer = StorageWriter(tmp_path)
    with pytest.raises(CheckpointException, match="meta device"):  # DCP wraps our error
        dcp.save({"w": torch.empty(3, device="meta")}, storage_writer=writer, no_dist=True)
    assert gc.get_freeze_count() == 0
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)  # the writer still works
    assert gc.get_freeze_count() == 0
    with pytest.raises(CheckpointException, match="Size mismatch"):  # DCP refuses it
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(tmp_path), no_dist=True)
    assert gc.get_freeze_count() == 0
