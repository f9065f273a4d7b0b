"""The load row's bookkeeping (no torchrun): best of alternating rounds for every
contender and for cat, a failure in any round kept, cat split evenly by bytes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from benchmarks import ckpt_rows
from benchmarks.ckpt_rows import cat_groups
from benchmarks.common import Job

LOSS = 2.5


def _job(name, seconds, loss=LOSS, ok=True):
    if not ok:
        return Job(name, False, 1.0, error="boom")
    return Job(name, True, 1.0, [{"load_s": seconds, "eval_loss": loss}] * 3)


def _run(monkeypatch, script, rounds=3):
    """``script[r][w]`` is contender ``w``'s job in round ``r``; cat takes 1.0 + r s."""
    calls, cats = [], []
    monkeypatch.setattr(ckpt_rows, "drop_caches", lambda: True)
    monkeypatch.setattr(ckpt_rows, "measure_child", lambda cmd, timeout: {"wall_s": 4.0})

    def launch(jobs, **kw):
        r = len(calls)
        calls.append([name for name, _, _ in jobs])
        return {name: script[r][name] for name, _, _ in jobs}

    def cat(root, procs):
        cats.append(len(calls))
        return 1.0 + len(cats) - 1

    monkeypatch.setattr(ckpt_rows, "launch", launch)
    monkeypatch.setattr(ckpt_rows, "_cat_seconds", cat)
    opts = SimpleNamespace(load_nproc=3, nproc=2, quick=False, rounds=rounds, timeout=60,
                           verbose=False)  # fmt: skip
    saves = {w: _job(w, 0.0) for w in ("zs", "dcp", "ds")}
    section = ckpt_rows._load_section(opts, {}, saves, Path("/nonexistent"), "tiny")
    return section, calls, cats


def test_best_round_each_alternating_order(monkeypatch):
    script = [
        {"zs": _job("zs", 0.5), "dcp": _job("dcp", 2.0), "ds": _job("ds", 3.0)},
        {"zs": _job("zs", 0.3), "dcp": _job("dcp", 2.5), "ds": _job("ds", 1.0)},
        {"zs": _job("zs", 0.4), "dcp": _job("dcp", 1.5), "ds": _job("ds", 2.0)},
    ]
    section, calls, cats = _run(monkeypatch, script)
    assert calls == [["zs", "dcp", "ds"], ["ds", "dcp", "zs"], ["zs", "dcp", "ds"]]
    assert cats == [1, 1, 3]  # after round 1, before round 2, after round 3
    seconds = [row["values"].get("seconds") for row in section["rows"]]
    assert seconds == [0.3, 1.5, 1.0 + 4.0, 1.0]  # ds adds its conversion; cat's best
    assert section["ratios"][0]["value"] == 0.3
    assert "best of 3 round(s)" in section["setup"]


def test_a_failure_or_a_wrong_state_in_any_round_is_kept(monkeypatch):
    script = [
        {"zs": _job("zs", 0.5), "dcp": _job("dcp", 2.0, loss=LOSS + 1), "ds": _job("ds", 3.0)},
        {"zs": _job("zs", 0.3, ok=False), "ds": _job("ds", 1.0)},
        {"ds": _job("ds", 2.0)},
    ]
    section, calls, _ = _run(monkeypatch, script)
    assert calls == [["zs", "dcp", "ds"], ["ds", "zs"], ["ds"]]  # failed ones do not rerun
    zs, dcp, ds = section["rows"][:3]
    assert not zs["ok"] and zs["error"] == "boom"
    assert not dcp["ok"] and "loaded state differs" in dcp["error"]
    assert ds["ok"] and ds["values"]["seconds"] == 5.0


def test_cat_groups_balance_bytes():
    sizes = {"a/c/0/0": 90, "a/c/1/0": 90, "b/c/0/0": 90, "b/c/1/0": 90, "c/c/0/0": 90,
             "c/c/1/0": 90, "zarr.json": 1, "a/zarr.json": 2, "commit": 30}  # fmt: skip
    groups = cat_groups(sizes, 3)
    assert sorted(n for g in groups for n in g) == sorted(sizes)
    loads = [sum(sizes[n] for n in g) for g in groups]
    assert max(loads) - min(loads) <= 30, loads
    assert all(sum(sizes[n] >= 90 for n in g) == 2 for g in groups)
    assert cat_groups({"x": 5}, 3) == [["x"]]
