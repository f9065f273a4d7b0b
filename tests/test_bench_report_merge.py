"""The report's bookkeeping (no torchrun): ``--only`` keeps the sections of the report
already there that it did not rerun, each naming the run that produced it; the mesh row
keeps each contender's best round and any failure."""

from __future__ import annotations

from benchmarks import report as rep
from benchmarks.mesh_rows import _row


def _section(key: str, seconds: float) -> dict:
    row = {"contender": "c", "ok": True, "error": None, "values": {"seconds": seconds}}
    return {"key": key, "title": f"title {key}", "setup": "setup", "rows": [row], "ratios": []}


def _report(command: str, when: str, sections: list[dict]) -> dict:
    run = {"command": command, "finished_utc": when, "wall_s": 10.0}
    for sec in sections:
        sec["produced"] = dict(run)
    return {
        **run,
        "environment": {"machine": "m", "torch": "t", "deepspeed": "d"},
        "sections": sections,
        "failed_sections": [],
    }


def test_only_replaces_its_sections_and_keeps_the_others():
    old = _report("python -m benchmarks", "day 1", [_section("s3", 1.0), _section("save", 2.0)])
    old["head_notes"] = ["an earlier note"]
    del old["sections"][1]["produced"]  # a report written before sections carried it
    new = _report(
        "python -m benchmarks --only save,mesh",
        "day 2",
        [_section("save", 3.0), _section("mesh", 4.0)],
    )
    out = rep.merged(old, new)
    assert [s["key"] for s in out["sections"]] == ["s3", "save", "mesh"]
    by_key = {s["key"]: s for s in out["sections"]}
    assert by_key["s3"]["produced"]["finished_utc"] == "day 1"
    assert by_key["save"]["rows"][0]["values"]["seconds"] == 3.0
    assert by_key["save"]["produced"]["finished_utc"] == "day 2"
    md = rep.markdown(out)
    assert "Produced by `python -m benchmarks` on day 1" in md
    assert md.count("Produced by `python -m benchmarks --only save,mesh` on day 2") == 2
    assert "an earlier note" in md
    assert rep.merged(None, new) is new


def test_a_failed_rerun_replaces_the_old_failure_only():
    old = _report("a", "day 1", [_section("s3", 1.0)])
    old["failed_sections"] = [{"key": "layout", "error": "old"}, {"key": "mesh", "error": "old"}]
    new = _report("b", "day 2", [])
    new["failed_sections"] = [{"key": "mesh", "error": "new"}]
    out = rep.merged(old, new)
    assert out["failed_sections"] == [
        {"key": "mesh", "error": "new"},
        {"key": "layout", "error": "old"},
    ]


def _round(step_s: float, rss: int) -> dict:
    return {
        "step_s": step_s,
        "peak_device_bytes": None,
        "peak_rss_bytes": rss,
        "model_state_bytes": 100,
        "last_loss": 2.0,
        "peak_rss_bytes_per_rank": [rss],
    }


def test_mesh_row_keeps_the_best_round_and_any_failure():
    row = _row("zerostate", [_round(0.5, 7 << 20), _round(0.25, 9 << 20)], cuda=False)
    assert row["ok"] and row["values"]["step_ms"] == 250.0
    assert row["values"]["peak_rss_mb"] == 9.0  # the best round's own memory
    assert row["step_ms_per_round"] == [500.0, 250.0]
    failed = _row("zerostate", [_round(0.5, 1), {"error": "boom"}], cuda=False)
    assert not failed["ok"] and failed["error"] == "boom" and failed["values"] == {}
