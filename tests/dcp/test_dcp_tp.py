"""The torchtitan way with one argument changed: a transformers Llama (GQA, odd sizes) with
tensor parallelism (``parallelize_module``) and FSDP2 per layer on 4 gloo ranks
(dp_shard 2 x tp 2), AdamW, saved with ``dcp.save`` through our ``StorageWriter`` and through
DCP's ``FileSystemWriter``. Its 2-D boxes (rows over tp and dp for column-parallel weights,
columns over tp for row-parallel ones) load through our ``StorageReader`` at dp_shard 2 and
in one process without FSDP exactly as ``FileSystemReader`` loads DCP's files."""

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
    results = run_distributed(workers.save_fsdp2_tp, 4, str(ours), str(theirs), timeout=600)
    assert [r["step"] for r in results] == [0, 0, 0, 0]
    return {"ours": str(ours), "theirs": str(theirs)}


def test_boxes_are_two_dimensional_and_every_rank_writes_one_row(saved):
    with open_checkpoint(saved["ours"]).step() as step:
        assert sorted(r for _, r, _ in step.row_objects()) == [0, 1, 2, 3]
        from zerostate.dcp import describe_step

        entries = {e["key"]: e for e in describe_step(step)}
    o_proj = entries["model.model.layers.0.self_attn.o_proj.weight"]
    assert o_proj["shape"] == [workers.LLAMA_HIDDEN, workers.LLAMA_HIDDEN]
    # Row-parallel: columns split over tp, rows over dp: four boxes on four ranks.
    assert len(o_proj["chunks"]) == 4
    assert {c["offsets"][1] for c in o_proj["chunks"]} == {0, workers.LLAMA_HIDDEN // 2}
    assert sorted(c["rank"] for c in o_proj["chunks"]) == [0, 1, 2, 3]


def test_one_process_without_fsdp_loads_what_filesystem_reader_loads(saved):
    ours = workers.load_llama(0, 1, "ours", saved["ours"], "plain")
    theirs = workers.load_llama(0, 1, "theirs", saved["theirs"], "plain")
    assert_same_state(ours, theirs)
    fresh = workers.llama()  # not vacuous: the saved values arrived
    assert not torch.equal(ours["model/lm_head.weight"], fresh.lm_head.weight)


@pytest.mark.slow
def test_dp_shard_2_loads_what_filesystem_reader_loads(saved):
    ours = run_distributed(workers.load_llama, 2, "ours", saved["ours"], "dp", timeout=600)[0]
    theirs = run_distributed(workers.load_llama, 2, "theirs", saved["theirs"], "dp", timeout=600)
    assert_same_state(ours, theirs[0])
