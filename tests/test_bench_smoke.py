"""The step benchmark runs end to end on the tiny model (seconds per contender)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_step.py"


def _run(tmp_path: Path, only: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--model", "tiny", "--steps", "2", "--warmup", "1",
         "--nproc", "2", "--only", only, "--json", str(out), "--timeout", "240"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.exists(), f"no JSON written (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def _assert_trained(result: dict) -> None:
    assert result["ok"], result.get("error")
    assert result["step_time_median_s"] > 0
    assert result["world_size"] == 2
    assert len(result["peak_rss_mb"]) == 2 and min(result["peak_rss_mb"]) > 0
    assert result["loss_last"] < result["loss_first"]


ZS = ("zs0", "zs1", "zs2", "zs3")


@pytest.mark.slow
def test_torch_peers_and_zerostate(tmp_path):
    proc, report = _run(tmp_path, "ddp,zero1opt,fsdp2," + ",".join(ZS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"ddp", "zero1opt", "fsdp2", *ZS}
    for r in results.values():
        _assert_trained(r)
    # Same model, data and optimiser: every contender starts from the same loss.
    firsts = [r["loss_first"] for r in results.values()]
    assert max(firsts) - min(firsts) < 1e-4
    groups = {g["stage"]: g for g in report["groups"]}
    assert groups[0]["fastest_peer"] == "ddp" and groups[3]["fastest_peer"] == "fsdp2"
    for stage in (0, 1, 3):
        assert groups[stage]["ratio_zerostate_over_fastest_peer"] > 0


@pytest.mark.slow
def test_deepspeed_peers(tmp_path):
    pytest.importorskip("deepspeed")  # optional `bench` extra
    proc, report = _run(tmp_path, "ds1,ds2,ds3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"ds1", "ds2", "ds3"}
    for r in results.values():
        _assert_trained(r)
