"""``zerostate.save`` runs through the store's save session, as ``engine.save`` does ([Note:
zerostate.save through the session] in zerostate.dcp.source): a non-blocking save returns
the session's ``SaveHandle``, one rank's failure fails every rank at once, another run's
newer step is refused, and the step it writes is the one ``dcp.save`` with our
``StorageWriter`` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zerostate
from tests.dcp import session_workers, workers
from tests.dcp.test_api import assert_same
from tests.helpers_dist import run_distributed
from zerostate.api import _translated
from zerostate.dcp import StorageWriter
from zerostate.store import open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_non_blocking_save_returns_a_handle_whose_wait_commits(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(session_workers.async_save, 2, root)
    for r in results:
        assert r["is_handle"] and r["done"] and r["step"] == 0 and r["committed"] == 0
        assert r["blocked_s"] >= 0.0
    # The step holds the state as of save(), not the parameters changed right after it.
    model, opt, sched = workers.ddp_parts(1, 0.5)
    assert zerostate.load({"model": model, "optim": opt, "sched": sched}, root) == 0
    want = {k: v for k, v in results[0].items() if k in ("model", "optim", "sched")}
    assert_same(workers.ddp_state(model, opt, sched), want)


def test_one_rank_failing_while_planning_fails_every_rank_in_one_line(tmp_path):
    root = tmp_path / "ckpt"
    got = run_distributed(session_workers.one_rank_fails_planning, 2, str(root), timeout=120)
    assert got[1]["type"] == "ConfigError"
    assert "extra.handle" in got[1]["message"]  # names the value it cannot store
    assert got[0]["type"] == "CheckpointError"
    assert "failed on rank(s) [1]" in got[0]["message"]
    assert "nothing was committed" in got[0]["message"]
    for r in got:
        assert "\n" not in r["message"]
    assert not list(root.glob("step-*/_zerostate/commit"))  # nothing committed


def test_a_newer_step_of_another_run_is_refused_unless_this_run_resumed_from_it(tmp_path):
    root = str(tmp_path / "ckpt")
    # Another run's step 5 (this pytest process is not the workers' run).
    model, opt, sched = workers.ddp_parts(0, 1e-2)
    assert zerostate.save({"model": model, "optim": opt, "sched": sched}, root, step=5) == 5
    refused = run_distributed(session_workers.save_at_step, 2, root, 3, False)
    for r in refused:
        assert r["type"] == "ConfigError", r
        assert "newer than step 3" in r["message"] and "zerostate.load(state" in r["message"]
    assert open_checkpoint(root).steps() == [5]
    beside = run_distributed(session_workers.save_at_step, 2, root, 2, True)
    assert [r["step"] for r in beside] == [2, 2]
    resumed = run_distributed(session_workers.load_then_save_older, 2, root, 4)
    assert [(r["loaded"], r["saved"]) for r in resumed] == [(5, 4), (5, 4)]
    assert open_checkpoint(root).steps() == [2, 4, 5]
    # The default step is the one after the newest: never older.
    assert run_distributed(session_workers.save_at_step, 2, root, None, False)[0]["step"] == 6


def _step_files(root: Path, step: int) -> dict[str, bytes]:
    base = root / f"step-{step:08d}"
    return {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def _record(files: dict[str, bytes], path: str) -> dict:
    (doc,) = json.loads(files[path])["attributes"].values()
    return doc


def test_the_step_is_the_storage_writers_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    state = {"model": model, "optim": opt, "sched": sched}
    zerostate.save(state, tmp_path / "session")
    dcp.save(_translated(state), storage_writer=StorageWriter(tmp_path / "writer"))
    ours, theirs = _step_files(tmp_path / "session", 0), _step_files(tmp_path / "writer", 0)
    assert sorted(ours) == sorted(theirs)
    commit, manifest = "_zerostate/commit/zarr.json", "_zerostate/manifests/rank-00000/zarr.json"
    for path in ours:
        if path not in (commit, manifest):
            assert ours[path] == theirs[path], path  # rows and group documents byte for byte
    a, b = _record(ours, commit), _record(theirs, commit)
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differ == {"save_id", "manifests"}  # the save's id, and the manifest's checksum
    a, b = _record(ours, manifest), _record(theirs, manifest)
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"save_id"}
