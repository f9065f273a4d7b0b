"""The memory tier under torchrun with two simulated nodes: two agents (``--nnodes 2``,
static rendezvous on 127.0.0.1), 2 ranks each, a memory directory per node. Every rank is
SIGKILLed after the memory-tier save of step 5; the relaunched job resumes from step 5 and
ends with the uninterrupted run's weights, bit for bit, also when one node's memory
directory was removed before the relaunch (a replaced machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from e2e_common import free_port
from safetensors.torch import load_file

WORKER = Path(__file__).resolve().parent / "memtier_worker.py"


def _job(tmp: Path, name: str, *args: str, expect_ok: bool = True) -> list[str]:
    port = free_port()
    procs = []
    for node in (0, 1):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            ZEROSTATE_MEMORY_DIR=str(tmp / f"shm-node{node}"),
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(WORKER), "--out", str(tmp / f"{name}.safetensors"), *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:  # a job that hangs is ended: SIGTERM lets an agent end its workers first
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    codes = [p.returncode for p in procs]
    if expect_ok:
        assert codes == [0, 0], "\n".join(o[-6000:] for o in outs)
    else:
        assert all(c != 0 for c in codes), codes
    return outs


def test_every_rank_killed_after_a_memory_save_resumes_bit_for_bit(tmp_path):
    _job(tmp_path, "reference", "--root", str(tmp_path / "ref-ckpt"), "--stop", "8")
    reference = load_file(str(tmp_path / "reference.safetensors"))
    root = str(tmp_path / "ckpt")
    _job(tmp_path, "killed", "--root", root, "--stop", "8", "--kill-after", "5", expect_ok=False)
    out = _job(tmp_path, "resumed", "--root", root, "--stop", "8", "--resume")
    assert "loaded step 5 from the memory tier: 2 node(s) from their own memory" in out[0]
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    # A replaced machine: node 1's memory directory is gone before the relaunch; its
    # ranks' state comes from the replicas node 0 keeps, and nothing is lost.
    root = str(tmp_path / "ckpt-replaced")
    _job(tmp_path, "killed2", "--root", root, "--stop", "8", "--kill-after", "5", expect_ok=False)
    shutil.rmtree(tmp_path / "shm-node1")
    out = _job(tmp_path, "replaced", "--root", root, "--stop", "8", "--resume")
    assert "loaded step 5 from the memory tier" in out[0], out[0][-3000:]
    assert "node(s) [1] from their peers' replicas" in out[0]
    replaced = load_file(str(tmp_path / "replaced.safetensors"))
    assert all(torch.equal(replaced[k], reference[k]) for k in reference)
