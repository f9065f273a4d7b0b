"""``python -m benchmarks --quick`` runs every row with every contender at tiny sizes.

It fails when any contender fails, when a number is missing or not finite, or when the
peers (the ``bench`` extra, which scripts/test.sh installs) are absent: a smoke test that
skipped without DeepSpeed would hide a broken harness."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def uses_quick_run(test):
    """Marks of the tests that read the quick run: every row (SeaweedFS included) at tiny
    sizes, a few minutes on 2 cores."""
    for mark in (pytest.mark.slow, pytest.mark.s3, pytest.mark.timeout(1500)):
        test = mark(test)
    return test


STEP_CONTENDERS = {
    "ddp",
    "zero1opt",
    "ds1",
    "ds2",
    "fsdp2_noreshard",
    "ds3",
    "fsdp2",
    "zs0",
    "zs1",
    "zs2",
    "zs3",
}


def test_bench_extra_installed():
    missing = []
    for module in ("deepspeed", "matplotlib", "psutil"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    assert not missing, f"bench extra missing {missing}: pip install -e '.[bench]'"


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One quick run per session (it costs minutes), kept on disk: a second setup of the
    fixture in the same session reads the first one's result instead of running again."""
    out = tmp_path_factory.getbasetemp() / "bench-quick"
    done = out / "run.json"
    if not done.exists():
        out.mkdir(exist_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks",
                "--quick",
                "--out",
                str(out),
                "--dir",
                str(out),
                "--timeout",
                "400",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1400,
        )
        done.write_text(
            json.dumps(
                {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            )
        )
    run = json.loads(done.read_text())
    proc = subprocess.CompletedProcess([], run["returncode"], run["stdout"], run["stderr"])
    report_file = out / "latest.json"
    assert report_file.exists(), f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc, json.loads(report_file.read_text()), out


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@uses_quick_run
def test_every_contender_ran(quick_run):
    proc, report, _ = quick_run
    failed = [
        f"{s['key']}/{r['contender']}: {r['error']}"
        for s in report["sections"]
        for r in s["rows"]
        if not r["ok"]
    ]
    assert not failed, failed
    assert not report["failed_sections"], report["failed_sections"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    keys = [s["key"] for s in report["sections"]]
    assert keys == [
        "step",
        "step_mlp",
        "save",
        "async",
        "load",
        "consolidate",
        "s3",
        "mesh",
        "layout",
    ]
    step = next(s for s in report["sections"] if s["key"] == "step")
    assert {r["contender"] for r in step["rows"]} == STEP_CONTENDERS


@uses_quick_run
def test_every_number_present_and_finite(quick_run):
    _, report, _ = quick_run
    expected = {
        "step": {"step_ms", "peak_rss_mb", "loss_first", "loss_last"},
        "step_mlp": {"step_ms", "peak_rss_mb", "loss_first", "loss_last"},
        "save": {"MiB", "seconds", "MiB_per_s"},
        "async": {"call_s", "blocked_s", "sync_save_s", "blocked_over_sync"},
        "load": {"seconds"},
        "consolidate": {"seconds", "peak_rss_mb"},
        "s3": {"MiB", "seconds", "MiB_per_s"},
        "mesh": {"step_ms", "peak_rss_mb", "model_states_mb", "last_loss"},
        "layout": {"MiB", "seconds"},
    }
    for sec in report["sections"]:
        for row in sec["rows"]:
            if row.get("peer_limitation"):
                continue  # a peer route that cannot run here, reported with its reason
            missing = expected[sec["key"]] - set(row["values"])
            assert not missing, f"{sec['key']}/{row['contender']} lacks {missing}"
            bad = {k: v for k, v in row["values"].items() if not _finite(v)}
            assert not bad, f"{sec['key']}/{row['contender']}: {bad}"
        assert sec["ratios"], f"{sec['key']}: no ratios"
        for r in sec["ratios"]:
            assert _finite(r["value"]), r


@uses_quick_run
def test_contenders_train_alike(quick_run):
    """Same model, data and optimizer: all start from one loss and all of them learn."""
    _, report, _ = quick_run
    step = next(s for s in report["sections"] if s["key"] == "step")
    untrained = [r["contender"] for r in step["rows"] if "loss_first" not in r["values"]]
    assert not untrained, f"no losses from {untrained}"
    firsts = [r["values"]["loss_first"] for r in step["rows"]]
    assert max(firsts) - min(firsts) < 1e-4, firsts
    for r in step["rows"]:
        assert r["values"]["loss_last"] < r["values"]["loss_first"], r["contender"]


@uses_quick_run
def test_report_files(quick_run):
    _, report, out = quick_run
    md = (out / "latest.md").read_text()
    for sec in report["sections"]:
        assert f"### {sec['title']}" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(report["plots"]) and len(pngs) == len(report["sections"])
    for p in pngs:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@uses_quick_run
def test_mesh_benchmark_runs_on_cpu(quick_run):
    """benchmarks/mesh.py (the mesh section of benchmarks/gpu.sh; the quick run's mesh row
    launches it on 4 forked ranks, as ``torchrun -m benchmarks.mesh`` would): 4 gloo ranks
    at (dp_shard 2 x tp 2), a tiny Llama, every contender. They train the same model on the
    same data in fp32, so their losses agree. (It ran its own torchrun job of the same
    command until it was folded into the quick run, which made the same job a second
    time.)"""
    _, report, _ = quick_run
    mesh = next(s for s in report["sections"] if s["key"] == "mesh")
    assert "(dp_shard 2 x tp 2) on 4 ranks" in mesh["title"], mesh["title"]
    assert "4 gloo ranks" in mesh["setup"] and "fp32" in mesh["setup"], mesh["setup"]
    rows = {r["name"]: r for r in mesh["rows"]}
    assert set(rows) == {"fsdp2_tp", "fsdp2_tp_ac", "zerostate", "zerostate_pa", "zerostate_stage3"}
    for name, row in rows.items():
        assert row["ok"], (name, row["error"])
        assert row["values"]["step_ms"] > 0 and "peak_device_mb" not in row["values"], row
    losses = [row["values"]["last_loss"] for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0]), losses


@uses_quick_run
def test_a_row_under_torchrun(tmp_path, quick_run):
    """The quick run forks its ranks from one process ([Note: forked ranks] in
    benchmarks/forked.py); every measured run starts them with torchrun. One row of the
    quick run under ``--launcher torchrun`` keeps that path tested."""
    assert quick_run[1]["environment"]["launcher"] == "fork"
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--only", "step", "--contenders",
           "ddp,zs1", "--launcher", "torchrun", "--out", str(tmp_path), "--dir",
           str(tmp_path / "scratch"), "--timeout", "400"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report["environment"]["launcher"] == "torchrun"
    rows = report["sections"][0]["rows"]
    assert [r["ok"] for r in rows] == [True, True], rows
    firsts = [r["values"]["loss_first"] for r in rows]
    assert abs(firsts[0] - firsts[1]) < 1e-4 and all(
        r["values"]["loss_last"] < r["values"]["loss_first"] for r in rows
    ), rows


def _report(value: float, ok: bool = True) -> dict:
    row = {"contender": "c", "ok": ok, "error": None if ok else "boom", "values": {"s": value}}
    return {
        "sections": [
            {
                "key": "save",
                "rows": [row],
                "ratios": [{"label": "r", "value": value, "target": None}],
            }
        ],
        "failed_sections": [],
    }


def test_problems_catch_failed_and_non_finite():
    from benchmarks.report import problems

    assert problems(_report(1.5)) == []
    assert problems(_report(float("nan"))) == ["save/c/s = nan", "save/ratio/r = nan"]
    assert problems(_report(float("inf"), ok=False))[0] == "save/c: boom"
    missing = _report(1.0)
    missing["sections"][0]["rows"][0]["values"] = {}
    missing["sections"][0]["ratios"] = []
    assert problems(missing) == ["save/c: no numbers"]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(600)
def test_bench_scale_runs(tmp_path):
    """benchmarks/bench_scale.py: the planner tables and the SeaweedFS rows (direct and
    behind the latency proxy) at a tiny fraction of a rank's share."""
    out = tmp_path / "scale.md"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_scale.py"), "all",
           "--dir", str(tmp_path / "disk"), "--fraction", "0.02", "--repeat", "1",
           "--disk-ranks", "8", "--latency-ms", "0", "5", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert sum("Llama-7B (" in r and "| 1024 |" in r for r in rows) == 1, text
    s3_rows = [r for r in rows if r.startswith("| SeaweedFS")]
    assert len(s3_rows) == 2 and "+ 5 ms per request" in s3_rows[1], text
    for row in s3_rows:  # both formats timed: finite positive ratios of wall and CPU time
        ratios = [float(c.strip().rstrip("x")) for c in row.rstrip(" |").split("|")[-2:]]
        assert all(math.isfinite(r) and r > 0 for r in ratios), row
    assert any(r.startswith("| local disk") for r in rows), text


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(600)
def test_memory_tier_row_runs(tmp_path):
    """benchmarks/memory_tier.py with its SeaweedFS load: two simulated nodes, every row
    timed, the load from memory read from memory, and a finite ratio for each comparison."""
    cmd = [sys.executable, "-m", "benchmarks.memory_tier", "--params", "2e4", "--rounds", "2",
           "--dir", str(tmp_path), "--s3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    timed = {line.split()[0] for line in lines if line.split()[:1] and "_" in line.split()[0]}
    assert {"mem_save", "disk_async", "mem_load", "disk_load", "s3_load"} <= timed, proc.stdout
    ratios = [line for line in lines if line.startswith(("blocked:", "load:"))]
    assert any("SeaweedFS S3" in line for line in ratios), proc.stdout
    for line in ratios:
        value = float(line.split("=")[1].split("x")[0])
        assert math.isfinite(value) and value > 0, line


@pytest.mark.timeout(300)
def test_dcp_plan_scale_runs():
    """benchmarks/dcp_plan_scale.py at two small world sizes: every number present, and what
    the largest rank is sent the same at 4 and 16 ranks (each rank's own pieces only)."""
    cmd = [sys.executable, "-m", "benchmarks.dcp_plan_scale", "--ranks", "4", "16",
           "--tensors", "12"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["ranks"] for r in rows] == [4, 16], proc.stdout
    for row in rows:
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in row.values()), row
        assert row["commit_record_MB"] > 0 and row["read_metadata_s"] > 0, row
    assert rows[1]["largest_rank_plan_kB"] < 1.25 * rows[0]["largest_rank_plan_kB"], rows


@pytest.mark.timeout(300)
def test_shm_ab_runs():
    """benchmarks/shm_ab.py at 2 ranks, stage 1: the engine on shared memory, on gloo and
    ZeroRedundancyOptimizer each timed in the one job, and their ratios finite."""
    from ports import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "benchmarks.shm_ab", "--stage", "1",
           "--model", "mlp", "--steps", "2", "--warmup", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, proc.stdout  # rank 0 prints
    row = rows[0]
    for key in ("zerostate, shared memory", "zerostate, gloo", "zero1opt", "shared / gloo",
                "shared / zero1opt", "gloo / zero1opt"):  # fmt: skip
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)


@pytest.mark.timeout(300)
def test_dcp_plugin_runs_with_its_bounds(tmp_path):
    """benchmarks/dcp_plugin.py at 2 ranks on the tiny preset: every contender and every bound
    timed in the round, the load warm and cold, and every ratio finite and positive."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "benchmarks.dcp_plugin", "--dir", str(tmp_path / "run"), "--rounds", "1",
           "--preset", "tiny"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{\n") :])
    assert {"ours", "dcp", "disk_bound", "direct_bound"} <= set(out["save_s"]), out
    assert set(out["layout_changing_load_s"]) == {"ours", "dcp", "no_read_floor"}, out
    assert set(out["cold_layout_changing_load_s"]) == {"ours", "dcp", "read_bound"}, out
    # what each cold load read from storage, all ranks together: a size, or None where the
    # kernel does not say
    assert set(out["cold_load_read_MiB"]) == {"ours", "dcp", "read_bound"}, out
    for reads in out["cold_load_read_MiB"].values():
        assert len(reads) == 1 and (reads[0] is None or reads[0] >= 0), out
    ratios = [out["load_ratio_ours_over_dcp"], out["cold_load_ratio_ours_over_dcp"]]
    ratios += out["bounds"].values()
    ratios += out["throughput_ratio_ours_over"].values()
    ratios += out["blocked_ratio_ours_over"].values()
    assert len(out["bounds"]) == 6, out
    for value in ratios:
        assert math.isfinite(value) and value > 0, out
