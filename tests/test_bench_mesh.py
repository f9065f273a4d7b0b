"""benchmarks/mesh.py (the mesh section of benchmarks/gpu.sh) runs end to end on CPU: 4 gloo
ranks at (dp_shard 2 x tp 2), a tiny Llama, every contender. The contenders train the same
model on the same data in fp32, so their losses agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_dist import free_port

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mesh_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "mesh.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
           f"--master_port={free_port()}", "-m", "benchmarks.mesh", "--device", "cpu",
           "--tp", "2", "--preset", "tiny", "--precision", "fp32", "--steps", "2",
           "--warmup", "1", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["mesh"] == {"dp_shard": 2, "tp": 2}
    rows = result["rows"]
    assert set(rows) == {"fsdp2_tp", "fsdp2_tp_ac", "zerostate", "zerostate_pa", "zerostate_stage3"}
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["step_s"] > 0 and row["peak_device_bytes"] is None, (name, row)
    losses = [row["last_loss"] for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0]), rows
