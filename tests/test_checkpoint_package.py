"""The checkpoint package keeps one job per module: none grows past 600 lines (the single
module it replaced had reached 867 doing eight jobs)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zerostate" / "checkpoint"


def test_no_checkpoint_module_over_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert {"__init__.py", "save.py", "load.py", "async_save.py"} <= sizes.keys(), sizes
    assert not (PACKAGE.parent / "checkpoint.py").exists()
    assert all(n <= 600 for n in sizes.values()), sizes
