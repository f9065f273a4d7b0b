"""torch.distributed.checkpoint through zerostate's storage plug-ins (``zerostate.dcp``).

One FSDP2 + AdamW run on 2 gloo ranks saves the same state with ``dcp.save`` (twice) and
``dcp.async_save`` through our ``StorageWriter``, and with DCP's ``FileSystemWriter``. Loads
through our ``StorageReader`` at 2 ranks, at another sharding (a.weight by columns) and in
one process without torch.distributed give exactly what ``FileSystemReader`` gives from
DCP's own files. A flipped byte is refused naming the tensor (DCP's reader loads its
damaged file silently).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.dcp import workers
from tests.helpers_dist import run_distributed
from zerostate.store import open_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dcp")
    ours, theirs = base / "ours", base / "theirs"
    results = run_distributed(workers.save_fsdp2, 2, str(ours), str(theirs), None)
    return {"ours": ours, "theirs": theirs, "results": results}


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_saves_to_one_root_advance_the_step(saved):
    # dcp.save, dcp.save, dcp.async_save into one root: steps 0, 1, 2 on every rank.
    assert [r["steps"] for r in saved["results"]] == [[0, 1, 2], [0, 1, 2]]
    root = open_checkpoint(str(saved["ours"]))
    assert root.steps() == [0, 1, 2]
    with root.step() as step:
        # Each rank's pieces are in one row object of the group "dcp".
        assert sorted((g, r) for g, r, _ in step.row_objects()) == [("dcp", 0), ("dcp", 1)]


@pytest.mark.parametrize("layout", ["shard0", "shard1"])
def test_two_ranks_load_what_filesystem_reader_loads(saved, layout):
    ours = run_distributed(workers.load, 2, "ours", str(saved["ours"]), layout, None)[0]
    theirs = run_distributed(workers.load, 2, "theirs", str(saved["theirs"]), layout, None)[0]
    assert_same_state(ours, theirs)
    # Not vacuous: the saved values arrived (rank 0 held rows 0-2 of a.weight).
    saved_rows = saved["results"][0]["a_weight_local"].view(torch.float32).view(3, 8)
    assert torch.equal(ours["model/a.weight"][:3], saved_rows)


def test_one_process_without_distributed_loads_what_filesystem_reader_loads(saved):
    # No process group in this process: DCP's no_dist path, a plain (unsharded) model.
    ours = workers.load(0, 1, "ours", str(saved["ours"]), "plain", None)
    theirs = workers.load(0, 1, "theirs", str(saved["theirs"]), "plain", None)
    assert_same_state(ours, theirs)
    for step in (0, 1):  # every step written holds the same state
        assert_same_state(workers.load(0, 1, "ours", str(saved["ours"]), "plain", None, step), ours)


def _flip(path: Path, tensor_bytes: bytes) -> None:
    """Flip one bit inside a tensor's bytes in a file: the first 16-byte window of them found
    exactly once (a row object puts a checksum after every inner chunk, so the whole run
    of bytes need not be contiguous there)."""
    data = bytearray(path.read_bytes())
    for start in range(0, len(tensor_bytes) - 16 + 1, 4):
        window = tensor_bytes[start : start + 16]
        at = data.find(window)
        if at >= 0 and data.find(window, at + 1) < 0:
            data[at + 8] ^= 0x10
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"{path}: the tensor's bytes are not there")


def test_flipped_byte_is_refused_naming_the_tensor(saved, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    shutil.copytree(saved["ours"], ours)
    shutil.copytree(saved["theirs"], theirs)
    # Rank 1's bytes of model.a.weight, in rank 1's row object of the newest step and in
    # DCP's file of rank 1.
    needle = saved["results"][1]["a_weight_local"].numpy().tobytes()
    _flip(ours / "step-00000002" / "dcp" / "c" / "1" / "0", needle)
    _flip(theirs / "__1_0.distcp", needle)

    # DCP wraps each rank's error in its CheckpointException; ours is the one inside.
    with pytest.raises(
        CheckpointException, match=r"CorruptCheckpointError: model\.a\.weight .*damaged"
    ):
        workers.load(0, 1, "ours", str(ours), "plain", None)
    # DCP's own reader loads its damaged file without a word: one weight is different.
    damaged = workers.load(0, 1, "theirs", str(theirs), "plain", None)
    intact = workers.load(0, 1, "theirs", str(saved["theirs"]), "plain", None)
    assert not torch.equal(damaged["model/a.weight"], intact["model/a.weight"])
    assert torch.equal(damaged["model/b.weight"], intact["model/b.weight"])


@pytest.mark.s3
def test_s3_save_and_load(s3_server, saved):
    bucket, options = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    results = run_distributed(workers.save_fsdp2, 2, url, "", options)
    assert [r["steps"] for r in results] == [[0, 1, 2], [0, 1, 2]]
    ours = workers.load(0, 1, "ours", url, "plain", options)
    theirs = workers.load(0, 1, "theirs", str(saved["theirs"]), "plain", None)
    assert_same_state(ours, theirs)


def test_async_save_with_process_staging(tmp_path):
    # DCP pickles the writer into its staging process, which saves from there; the ranks
    # must be torchrun's (the harness's daemonic workers may not start processes).
    root = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "tests.dcp.workers", "async-process", str(root)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert open_checkpoint(str(root)).steps() == [0]
    loaded = workers.load(0, 1, "ours", str(root), "plain", None)
    rows = [
        torch.frombuffer(bytearray(Path(f"{root}.rank{r}.bin").read_bytes()), dtype=torch.float32)
        for r in (0, 1)
    ]
    assert torch.equal(loaded["model/a.weight"].reshape(-1), torch.cat(rows))
