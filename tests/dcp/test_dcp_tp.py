"""The torchtitan way with one argument changed: a transformers Llama (GQA, odd sizes) with
tensor parallelism (``parallelize_module``) and FSDP2 per layer on 4 gloo ranks
(dp_shard 2 x tp 2), AdamW, 3 steps; ``{"model", "optim"}`` from ``get_state_dict`` saved
with ``dcp.save`` and ``dcp.async_save`` (thread staging) through our ``StorageWriter``
(locally and on SeaweedFS S3), and with ``dcp.save`` through DCP's ``FileSystemWriter``.

Its 2-D boxes (rows over tp and then dp, FSDP2's strided shards, for column-parallel
weights; columns over tp for row-parallel ones) load through our ``StorageReader`` at
dp_shard 4, tp 2, dp_shard 2 and in one process without FSDP exactly as
``FileSystemReader`` loads DCP's files, that is exactly the state saved; the next 2 steps
from each load, on the same global batches, are equal too."""

from __future__ import annotations

import pytest
import torch

from tests.dcp import workers
from tests.dcp.test_dcp_storage import assert_same_state
from tests.helpers_dist import run_distributed
from zerostate.store import open_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dcp-tp")
    ours, theirs = base / "ours", base / "theirs"
    results = run_distributed(
        workers.train_save_llama, 4, str(ours), str(theirs), None, timeout=600
    )
    assert [r["steps"] for r in results] == [[0, 1]] * 4  # dcp.save, then dcp.async_save
    return {"ours": str(ours), "theirs": str(theirs), "full": results[0]["full"]}


def _sources(saved: dict, root: str, options: dict | None = None) -> list[tuple]:
    """Our save (step 0), our async save (step 1), DCP's save: loaded in that order."""
    theirs = ("theirs", saved["theirs"], None, None)
    return [("ours", root, 0, options), ("ours", root, 1, options), theirs]


def assert_resumed_alike(saved: dict, resumed: list[dict]) -> None:
    """Every load gave exactly the state saved (so exactly what FileSystemReader gave), and
    the 2 steps after each load ended equal; the steps changed every parameter."""
    *ours, theirs = resumed
    for got in ours:
        assert_same_state(got["loaded"], theirs["loaded"])
        assert_same_state(got["trained"], theirs["trained"])
    assert_same_state(theirs["loaded"], saved["full"])
    for key, value in theirs["trained"].items():
        if key.startswith("model/"):
            assert not torch.equal(value, theirs["loaded"][key]), key


def test_boxes_are_two_dimensional_and_every_rank_writes_one_row(saved):
    from zerostate.dcp import describe_step

    root = open_checkpoint(saved["ours"])
    for number in root.steps():
        with root.step(number) as step:
            assert sorted(r for _, r, _ in step.row_objects()) == [0, 1, 2, 3]
            entries = {e["key"]: e for e in describe_step(step)}
        o_proj = entries["model.model.layers.0.self_attn.o_proj.weight"]
        assert o_proj["shape"] == [workers.LLAMA_HIDDEN, workers.LLAMA_HIDDEN]
        # Row-parallel: columns split over tp, rows over dp: four boxes on four ranks.
        assert len(o_proj["chunks"]) == 4
        assert {c["offsets"][1] for c in o_proj["chunks"]} == {0, workers.LLAMA_HIDDEN // 2}
        assert sorted(c["rank"] for c in o_proj["chunks"]) == [0, 1, 2, 3]


def test_strided_shards_are_one_box_per_rank_in_tp_then_dp_order(saved):
    # Column-parallel weights: tp splits the rows, then FSDP2 splits each tp half over dp
    # (_StridedShard). Rank 2 * dp + tp holds rows tp * half + (its dp part of that half).
    from zerostate.dcp import describe_step

    with open_checkpoint(saved["ours"]).step() as step:
        entries = {e["key"]: e for e in describe_step(step)}
    gate = entries["model.model.layers.1.mlp.gate_proj.weight"]  # 90 rows: 45 + 45, 23 + 22
    boxes = sorted((c["rank"], c["offsets"], c["sizes"]) for c in gate["chunks"])
    hidden = workers.LLAMA_HIDDEN
    assert boxes == [
        (0, [0, 0], [23, hidden]),
        (1, [45, 0], [23, hidden]),
        (2, [23, 0], [22, hidden]),
        (3, [68, 0], [22, hidden]),
    ]
    # The AdamW moments of the same weight have the same boxes.
    moment = entries["optim.state.model.layers.1.mlp.gate_proj.weight.exp_avg"]
    assert sorted((c["rank"], c["offsets"], c["sizes"]) for c in moment["chunks"]) == boxes


def test_one_process_without_fsdp_resumes_as_filesystem_reader_does(saved):
    resumed = workers.resume_llama(0, 1, "plain", _sources(saved, saved["ours"]))
    assert_resumed_alike(saved, resumed)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "world_size"), [("dp", 4), ("tp", 2), ("dp", 2)])
def test_other_layouts_resume_as_filesystem_reader_does(saved, layout, world_size):
    sources = _sources(saved, saved["ours"])
    resumed = run_distributed(workers.resume_llama, world_size, layout, sources, timeout=600)
    assert_resumed_alike(saved, resumed[0])


@pytest.mark.s3
def test_s3_save_and_resume(s3_server, saved):
    # The same run saved on SeaweedFS: each step loads at dp_shard 2 as DCP's local files do.
    bucket, options = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    results = run_distributed(workers.train_save_llama, 4, url, "", options, timeout=600)
    assert [r["steps"] for r in results] == [[0, 1]] * 4
    assert_same_state(results[0]["full"], saved["full"])
    sources = _sources(saved, url, options)
    resumed = run_distributed(workers.resume_llama, 2, "dp", sources, timeout=600)
    assert_resumed_alike(saved, resumed[0])
