"""Async saves write exactly what a blocking save writes, even while training continues; a
rank killed during an async save fails the job loudly and leaves the previous step usable."""

from __future__ import annotations

import json
import time

import torch
from e2e_common import assert_matches_reference, torchrun
from safetensors.torch import load_file

from zerostate.store import open_checkpoint


def _chunk_files(step_dir):
    return {
        p.relative_to(step_dir).as_posix(): p.read_bytes()
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and "/c/" in "/" + p.relative_to(step_dir).as_posix()
    }


def test_async_save_equals_blocking_save_while_training_continues(tmp_path):
    jobs = [{
        "name": "async", "stage": 2, "start": 0, "stop": 5, "train_after_save": 3,
        "saves": [{"path": str(tmp_path / "sync"), "blocking": True},
                  {"path": str(tmp_path / "async"), "blocking": False}],
    }]
    torchrun(2, jobs, tmp_path / "out")
    a = open_checkpoint(str(tmp_path / "sync")).step()
    b = open_checkpoint(str(tmp_path / "async")).step()
    assert a.step == b.step == 5
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        ta, tb = a.read(name), b.read(name)
        assert ta.dtype == tb.dtype and torch.equal(ta.view(-1), tb.view(-1)), name
    files_a = _chunk_files(tmp_path / "sync" / "step-00000005")
    files_b = _chunk_files(tmp_path / "async" / "step-00000005")
    assert files_a and files_a == files_b  # byte-identical chunk objects


def test_rank_killed_during_async_save(tmp_path, monkeypatch, reference20):
    monkeypatch.setenv("ZEROSTATE_COMMIT_TIMEOUT_S", "20")
    ckpt = str(tmp_path / "ckpt")
    jobs = [
        {"name": "first", "stage": 2, "start": 0, "stop": 5, "saves": [{"path": ckpt}]},
        {"name": "doomed", "stage": 2, "start": 5, "stop": 8, "load": ckpt, "train_after_save": 4,
         "saves": [{"path": ckpt, "blocking": False, "kill_rank": 1}]},
    ]
    t0 = time.perf_counter()
    proc = torchrun(2, jobs, tmp_path / "out", timeout=240, check=False)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, "the job must fail when a rank dies"
    assert elapsed < 180, f"the surviving rank hung for {elapsed:.0f} s"
    assert "SIGKILL" in proc.stderr or "Signal 9" in proc.stderr or "failed" in proc.stderr.lower()

    ckpt_reader = open_checkpoint(ckpt)
    assert ckpt_reader.steps() == [5]  # step 8 never committed
    # The previous step resumes correctly, on one rank.
    torchrun(1, [{"name": "resumed", "stage": 2, "start": 5, "stop": 20, "load": ckpt}],
             tmp_path / "out")
    first = json.loads((tmp_path / "out" / "first.json").read_text())
    resumed = json.loads((tmp_path / "out" / "resumed.json").read_text())
    params = load_file(str(tmp_path / "out" / "resumed.safetensors"))
    ref_losses, ref_params = reference20
    assert_matches_reference(first["losses"] + resumed["losses"], params, ref_losses, ref_params)
