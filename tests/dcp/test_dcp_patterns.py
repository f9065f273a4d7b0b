"""The patterns torch's own checkpoint tests use (test_file_system_checkpoint*.py,
test_dtensor_resharding.py, e2e/test_e2e_save_and_load.py), through our ``StorageWriter`` /
``StorageReader``:

- uneven ``Shard(0)`` boxes: 7 rows over 3 ranks (3 + 3 + 1), loaded over 2 (4 + 3);
- enumerable shard boxes: a ShardedTensor with several uneven boxes per rank, out of rank
  order (``EnumerableShardingSpec``), and a DTensor whose local tensor holds several column
  blocks (``LocalShardsWrapper``);
- resharding rowwise (``Shard(0)``) to columnwise (``Shard(1)``) on load;
- Statefuls holding bytes: raw ``bytes`` and a ``torch.save``-d ``io.BytesIO``; plain
  non-tensor values (``[1]``, ``"string"``);
- saving into one root again and again, each save loaded back at once and again later;
- ``no_dist=True`` in one process, and on one rank while a process group is up.

Each load gives what ``FileSystemReader`` gives from DCP's own files of the same state, and
that is the saved state (rebuilt from its seeds)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.dcp import workers
from tests.helpers_dist import run_distributed
from zerostate.dcp import StorageReader, StorageWriter, describe_step
from zerostate.store import open_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
TENSORS = ("uneven", "grid", "enum", "blocks")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dcp-patterns")
    ours, theirs = str(base / "ours"), str(base / "theirs")
    assert [r["step"] for r in run_distributed(workers.save_patterns, 3, ours, theirs)] == [0] * 3
    return {"ours": ours, "theirs": theirs}


def assert_pattern_state(got: dict, version: int) -> None:
    """``got`` holds version ``version`` of every pattern value, exactly."""
    for key in TENSORS:
        want = workers.pattern_tensor(key, version)
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    assert got["blob"] == bytes([version]) * 3 + b"\x00\x80\x04 raw"
    step, losses, position = got["train"]
    assert (step, losses) == (version, [0.5 * version, 1.25])
    assert position is not None and position > 0  # torch.save left the buffer at its end
    assert got["values"] == {"bytes0": [version], "bytes1": f"string {version}"}


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_boxes_are_stored_as_planned(saved):
    with open_checkpoint(saved["ours"]).step() as step:
        entries = {e["key"]: e for e in describe_step(step)}
    boxes = {k: sorted((c["offsets"], c["sizes"], c["rank"]) for c in e["chunks"])
             for k, e in entries.items() if e["kind"] == "tensor"}  # fmt: skip
    assert boxes["uneven"] == [([0, 0], [3, 5], 0), ([3, 0], [3, 5], 1), ([6, 0], [1, 5], 2)]
    # Enumerable: five boxes, two ranks with two each, as the plan places them.
    assert boxes["enum"] == [
        ([row, 0], [rows, 20], rank) for row, rows, rank in workers.ENUM_PLANS[3]
    ]
    # Several local column blocks per rank: four blocks of 5 columns on three ranks.
    assert boxes["blocks"] == [
        ([0, 0], [10, 5], 0), ([0, 5], [10, 5], 1), ([0, 10], [10, 5], 2), ([0, 15], [10, 5], 0)
    ]  # fmt: skip
    assert {e["kind"] for k, e in entries.items() if k.startswith(("blob", "train.losses"))} == {
        "value"
    }


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_two_ranks_load_other_boxes_as_filesystem_reader_does(saved, layout):
    # rows: 7 rows come back as 4 + 3, the enumerable boxes as another enumerable plan;
    # columns: the rowwise grid loads columnwise, the enumerable boxes interleaved.
    ours = run_distributed(workers.load_patterns, 2, "ours", saved["ours"], layout)[0]
    theirs = run_distributed(workers.load_patterns, 2, "theirs", saved["theirs"], layout)[0]
    assert_same(ours, theirs)
    assert_pattern_state(ours, 1)


def test_one_process_no_dist_save_and_load(saved, tmp_path):
    # torch's test_read_write_only_tensor: no_dist=True, no process group at all.
    state = workers.plain_patterns(0)
    dcp.load(state, storage_reader=StorageReader(saved["ours"]), no_dist=True)
    ours = workers.pattern_result(state)
    theirs_state = workers.plain_patterns(0)
    dcp.load(theirs_state, storage_reader=dcp.FileSystemReader(saved["theirs"]), no_dist=True)
    assert_same(ours, workers.pattern_result(theirs_state))
    assert_pattern_state(ours, 1)

    root = str(tmp_path / "one")
    writer = StorageWriter(root)
    dcp.save(workers.plain_patterns(3), storage_writer=writer, no_dist=True)
    assert writer.step == 0
    state = workers.plain_patterns(0)
    dcp.load(state, storage_reader=StorageReader(root), no_dist=True)
    assert_pattern_state(workers.pattern_result(state), 3)


def test_no_dist_on_one_rank_while_a_group_is_up(tmp_path):
    root = str(tmp_path / "rank0")
    results = run_distributed(workers.no_dist_save, 2, root)
    for got in results:
        assert_pattern_state(got, 2)
    assert open_checkpoint(root).steps() == [0]
    with open_checkpoint(root).step() as step:  # one rank wrote every box whole
        assert [r for _, r, _ in step.row_objects()] == [0]


def test_saving_into_one_root_again_and_again(tmp_path):
    root = str(tmp_path / "again")
    rounds = 3
    results = run_distributed(workers.resave_patterns, 2, root, rounds)[0]
    assert [r["step"] for r in results] == list(range(rounds))
    assert open_checkpoint(root).steps() == list(range(rounds))
    for i, entry in enumerate(results):
        assert_pattern_state(entry["loaded"], i + 1)  # the newest step, at once
        assert_pattern_state(entry["again"], i + 1)  # that step by number, later


def test_saves_with_dcps_plan_caching_each_get_their_own_step(tmp_path):
    # DCP's plan caching replays a rank's last plan, our storage data included: the second
    # save wrote under the first one's step before each save was planned afresh.
    results = run_distributed(
        workers.cached_plan_saves, 2, str(tmp_path / "ours"), str(tmp_path / "theirs")
    )
    for result in results:
        assert result["steps"] == [0, 1, 2, 3]
        assert result["warned"] == 1  # once per process: caching has no effect here
    assert open_checkpoint(str(tmp_path / "ours")).steps() == [0, 1, 2, 3]
    for i in range(4):  # ours and DCP's own files, saved alternately under one cache key
        assert_pattern_state(results[0]["ours"][i], i + 1)
        assert_pattern_state(results[0]["dcp"][i], i + 1)


def test_async_save_stages_a_sharded_tensor(tmp_path):
    # The stager took every tensor for a plain one and failed on a ShardedTensor (torch:
    # "'__get__' not supported for ShardedTensor"); its copy must not follow the original.
    results = run_distributed(workers.async_sharded_save, 2, str(tmp_path / "root"))
    for key in ("uneven", "grid", "enum"):
        want = workers.pattern_tensor(key, 1)
        assert torch.equal(results[0][key], want), key


def test_a_plan_from_dcps_cache_is_refused_before_anything_is_written(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlan

    from zerostate.errors import CheckpointError

    writer = StorageWriter(str(tmp_path / "root"))
    writer.set_up_storage_writer(True, rank=0)
    with pytest.raises(CheckpointError, match="DCP's plan cache"):
        writer.prepare_local_plan(SavePlan([], usable=False))
    with pytest.raises(CheckpointError, match="DCP's plan cache"):
        writer.prepare_global_plan([SavePlan([]), SavePlan([], usable=False)])
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_bytes_values_reach_the_planner_as_plain_data(saved):
    # The blob comes back as bytes and the BytesIO as a BytesIO: data, never interpreted.
    state = workers.plain_patterns(0)
    dcp.load(state, storage_reader=StorageReader(saved["ours"]))
    assert type(state["blob"].state["blob"]) is bytes
    assert isinstance(state["train"].losses, list)
    buffer = io.BytesIO()
    torch.save([0.5, 1.25], buffer)
    assert state["train"].position == buffer.tell()
