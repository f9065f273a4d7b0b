"""The README's main command: examples/demo.sh trains on 2 ranks, resumes on 1 rank,
verifies and consolidates."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from helpers_dist import free_port
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def test_demo_script_end_to_end(tmp_path):
    env = dict(
        os.environ,
        RUN_DIR=str(tmp_path / "demo"),
        MASTER_PORT=str(free_port()),
        ZEROSTATE_VENV=sys.prefix,  # the environment running the tests already has it all
        ZEROSTATE_EXTRAS="test",
        # No reinstall: from a second checkout it would re-point this environment's editable
        # install there (and in CI it re-ran pip for a stamp of other extras).
        ZEROSTATE_NO_INSTALL="1",
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "demo.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "on 1 rank(s)" in proc.stdout
    assert "every checksum matches" in proc.stdout
    # A newcomer's first run: no warning they cannot act on (the 2 -> 1 resume once warned
    # about RNG states with advice that does not apply to them). Both streams, any case.
    warned = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "warning" in line.lower()
    ]
    assert not warned, warned
    assert "unrestored" not in proc.stdout + proc.stderr
    weights = load_file(str(tmp_path / "demo" / "hf" / "model.safetensors"))
    assert "transformer.wte.weight" in weights and len(weights) == 28
    assert elapsed < 180, f"the demo took {elapsed:.0f} s"
