"""Running the ``zerostate`` CLI in-process in tests (shared by the CLI test modules)."""

from __future__ import annotations

import pytest
from zerostate_cli.main import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of one CLI call; usage errors exit via SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def run_cli_err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``(exit code, stderr)`` of one CLI call."""
    code, _, err = run_cli(argv, capsys)
    return code, err
