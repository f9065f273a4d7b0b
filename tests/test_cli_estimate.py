"""The command line without a checkpoint: help, estimate, usage errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from zerostate_cli.main import main

COMMANDS = ("consolidate", "inspect", "verify", "reshard", "estimate")


def test_help_lists_every_command_in_a_subprocess() -> None:
    # One real process start proves the module entry point; the rest run in-process.
    proc = subprocess.run(
        [sys.executable, "-m", "zerostate_cli.main", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert command in proc.stdout


def test_estimate_matches_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [round(s["total_bytes"] / 1e9, 1) for s in data["stages"]] == [120.0, 31.4, 16.6, 1.9]
    assert data["params"] == 7_500_000_000 and data["dp"] == 64


def test_estimate_text_shows_gib_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "1.75 GiB" in out and "1,875,000,000" in out
    assert "111.76 GiB" not in out  # only the requested stage


def test_estimate_k_changes_optimizer_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "--params", "1M", "--dp", "4", "--stage", "0", "--k", "8", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["stages"][0]["total_bytes"] == 12_000_000


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["estimate", "--params", "7.5Q", "--dp", "8"], "parameter count"),
        (["estimate", "--params", "7.5B", "--dp", "0"], "--dp"),
        (["estimate", "--params", "7.5B", "--dp", "8", "--stage", "4"], "--stage"),
        (["consolidate", "ckpt", "out.safetensors", "--dtype", "fp8"], "fp32, bf16 or fp16"),
        (["consolidate", "ckpt", "out", "--max-shard-size", "5XB"], "5GB, 500MB, 2GiB"),
        (["reshard", "ckpt", "out", "--world-size", "0"], "at least 1"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_usage_errors_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1
    assert needle in err
