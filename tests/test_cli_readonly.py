"""Read-only commands create nothing, and name a missing checkpoint or a file for what it is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_helpers import run_cli_err as run_cli

from zerostate.errors import CheckpointNotFoundError
from zerostate.store import open_checkpoint


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{t}/typo/path"],
        ["verify", "{t}/a/b/c"],
        ["verify", "{t}/a/b/c", "--step", "3"],
        ["consolidate", "{t}/missing", "{t}/out/m.safetensors"],
        ["reshard", "{t}/missing", "{t}/dst", "--world-size", "2"],
    ],
)
def test_missing_checkpoint_creates_nothing(tmp_path: Path, capsys, argv) -> None:
    code, err = run_cli([a.format(t=tmp_path) for a in argv], capsys)
    assert code == 1, err
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1, err
    assert "does not exist" in err or "not committed" in err, err
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_file_where_a_checkpoint_is_expected(tmp_path: Path, capsys, command) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a checkpoint")
    code, err = run_cli([command, str(path)], capsys)
    assert code == 1
    assert "is a file, not a checkpoint directory" in err, err
    assert "cannot create" not in err
    assert _tree(tmp_path) == ["model.safetensors"]


def test_library_open_is_read_only(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        open_checkpoint(str(tmp_path / "x" / "y")).step()
    assert not os.path.exists(tmp_path / "x")
