"""``zerostate inspect`` and ``verify`` on a step written through ``zerostate.dcp``: inspect
shows each global tensor and its boxes, verify names a damaged tensor and exits 1.

The CLI of this source tree runs in a child process (``zerostate_cli`` is the ``cli/``
directory beside ``zerostate/``), with no process group: DCP's no_dist path wrote the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerostate.dcp import StorageWriter, describe_step
from zerostate.store import open_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    alias = tmp_path / "cli-path"
    alias.mkdir(exist_ok=True)
    if not (alias / "zerostate_cli").exists():
        (alias / "zerostate_cli").symlink_to(ROOT / "cli")
    env = dict(os.environ, PYTHONPATH=f"{alias}{os.pathsep}{ROOT}")
    code = "import sys; from zerostate_cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def step_root(tmp_path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    state = {"model": model.state_dict(), "epoch": 3}
    root = tmp_path / "ckpt"
    dcp.save(state, storage_writer=StorageWriter(str(root)))
    return root


def test_inspect_shows_global_tensors_and_boxes(step_root, tmp_path):
    with open_checkpoint(str(step_root)).step() as step:
        entries = {e["key"]: e for e in describe_step(step)}
    assert entries["model.weight"]["shape"] == [5, 8]
    assert entries["model.weight"]["chunks"][0]["offsets"] == [0, 0]
    assert entries["epoch"] == {"key": "epoch", "kind": "value"}

    proc = _cli(["inspect", str(step_root)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.weight  5x8 float32: [0:5, 0:8] rank 0" in proc.stdout
    assert "epoch  (non-tensor value, JSON)" in proc.stdout


def test_verify_names_a_damaged_tensor(step_root, tmp_path):
    proc = _cli(["verify", str(step_root)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = step_root / "step-00000000" / "dcp" / "c" / "0" / "0"
    data = bytearray(row.read_bytes())
    data[10] ^= 0x01  # inside model.weight, the first piece of the row
    row.write_bytes(bytes(data))
    proc = _cli(["verify", str(step_root)], tmp_path)
    assert proc.returncode == 1
    assert "model.weight" in proc.stdout + proc.stderr
