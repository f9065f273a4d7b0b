"""The library's shape stays as docs/architecture describes it: every module short enough to
read in one sitting, and the top of the package holding only the ground floor (errors,
configuration, the public API) while everything else lives in a folder by concern."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zerostate"
MAX_LINES = 700
MAX_LOOSE_MODULES = 8


def test_no_module_is_over_700_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules by concern: {long}"


def test_at_most_8_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose, "the package has moved"
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules: {loose}"
