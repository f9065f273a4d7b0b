"""The wheel carries every package of the library: ``pyproject.toml`` lists packages by
name, so a new subpackage that is not listed works in the editable install the tests use
and is missing from ``pip install zerostate``."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _on_disk() -> set[str]:
    found = set()
    for top, name in (("zerostate", "zerostate"), ("cli", "zerostate_cli")):
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / top)
            found.add(".".join((name, *rel.parts)))
    return found


def test_every_package_directory_is_listed_for_the_wheel():
    text = (REPO / "pyproject.toml").read_text()
    # tomllib is 3.11+; the list is one bracketed block of quoted names under [tool.setuptools]
    block = re.search(r"\[tool\.setuptools\]\s*packages\s*=\s*\[(.*?)\]", text, re.S)
    assert block, "no packages list under [tool.setuptools]"
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    assert "zerostate" in listed
    on_disk = _on_disk()
    assert "zerostate.checkpoint" in on_disk  # the walk finds nested packages
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages: {on_disk - listed}"
    assert listed - on_disk == set(), f"listed but not on disk: {listed - on_disk}"
