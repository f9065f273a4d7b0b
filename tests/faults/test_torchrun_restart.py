"""A worker SIGKILLed mid-training under ``torchrun --max-restarts=2``: torchrun restarts the
group, the example resumes from the latest committed step by itself (``--resume``) and the
run ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_dist import free_port  # [Note: free ports]

from zerostate.store import open_checkpoint

WORKER = Path(__file__).resolve().parent / "_restart_worker.py"
STEPS, SAVE_EVERY, KILL_AT = 12, 4, 6


def _run(ckpt: Path, kill_at: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(WORKER), "--ckpt", str(ckpt), "--steps", str(STEPS),
        "--save-every", str(SAVE_EVERY), "--resume", "--stage", "2",
        "--n-layer", "1", "--n-embd", "32", "--seq-len", "32", "--global-batch", "4",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               ZEROSTATE_KILL_AT_STEP=str(kill_at), ZEROSTATE_COMMIT_TIMEOUT_S="60")  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_to_the_same_parameters(tmp_path):
    clean = _run(tmp_path / "clean", kill_at=0)
    restarted = _run(tmp_path / "restarted", kill_at=KILL_AT)
    # The kill really happened and the restarted group resumed from a committed step.
    assert "resumed from" not in clean.stdout
    assert f"resumed from {tmp_path / 'restarted'} at step 4" in restarted.stdout, restarted.stdout
    a = open_checkpoint(str(tmp_path / "clean")).step()
    b = open_checkpoint(str(tmp_path / "restarted")).step()
    assert a.step == b.step == STEPS
    names = [n for n in a.tensors if n.startswith("model/")]
    assert names and set(names) == {n for n in b.tensors if n.startswith("model/")}
    for name in names:
        x, y = a.read(name).double(), b.read(name).double()
        err = (x - y).norm() / x.norm().clamp_min(1e-12)
        assert err <= 1e-6, f"{name}: relative L2 {err:.2e}"
