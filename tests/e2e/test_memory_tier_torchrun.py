"""The memory tier under torchrun with two simulated nodes: two agents (``--nnodes 2``), 2 ranks
each, a memory directory per node.

- Every rank SIGKILLed after the memory-tier save of step 5 (static rendezvous on 127.0.0.1):
  the relaunched job resumes from step 5 and ends with the uninterrupted run's weights, bit
  for bit, also when one node's memory directory was removed before the relaunch (a
  replaced machine), and from the newest durable step (4), said so, when both were.
- ``--max-restarts 1`` and one rank SIGKILLed in the middle of the step after the save of
  step 5: torchrun's agents restart every worker of both nodes in the same job, which load
  step 5 from the memory directories that survived and finish with the same weights.

[Note: restarts across two agents]
Static rendezvous (``--master_addr/--master_port``) cannot restart a job of two agents: each
agent restarts its workers on its own, with nothing telling the other, so one agent's new
workers meet the other's old ones, or none (the job ends on one node and waits forever on
the other). The restart test uses the c10d rendezvous (``--rdzv-backend=c10d``, one
``--rdzv-id``), whose rounds restart both agents' workers together (an agent whose workers
are healthy restarts them when the other agent waits for a new round; it does not count
that as a restart of its own, so ``TORCHELASTIC_RESTART_COUNT`` differs between the nodes,
and the worker decides whether to resume from what is saved, not from that count), with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the rendezvous store outlives the rounds, and
workers that share it read the first attempt's gloo addresses and fail to connect (seen
with torch 2.13), while a store of their own per round starts empty.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from e2e_common import free_port
from safetensors.torch import load_file

from zerostate.store import open_checkpoint

WORKER = Path(__file__).resolve().parent / "memtier_worker.py"
JOB_TIMEOUT_S = 240


def _job(tmp: Path, name: str, *args: str, expect_ok: bool = True, restarts: int = 0) -> list[str]:
    """One job: two agents, their outputs (node 0's first). ``restarts``: torchrun's
    ``--max-restarts`` over the c10d rendezvous ([Note: restarts across two agents])."""
    port = free_port()
    procs, logs = [], []
    for node in (0, 1):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            ZEROSTATE_MEMORY_DIR=str(tmp / f"shm-node{node}"),
        )
        if restarts:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            rdzv = [
                f"--max-restarts={restarts}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
            ]  # fmt: skip
        else:
            rdzv = [f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
            *rdzv, str(WORKER), "--out", str(tmp / f"{name}.safetensors"), *args,
        ]  # fmt: skip
        # Output to files, not pipes: a node whose pipe nobody reads would block when full.
        logs.append(tmp / f"{name}-node{node}.log")
        with open(logs[-1], "wb") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below with the outputs
    finally:  # a job that hangs is ended: SIGTERM lets an agent end its workers first
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in procs]
    if expect_ok:
        assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(o[-6000:] for o in outs)
    else:
        assert all(c != 0 for c in codes), codes
    return outs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run of 8 steps."""
    tmp = tmp_path_factory.mktemp("memtier-reference")
    _job(tmp, "reference", "--root", str(tmp / "ckpt"), "--stop", "8")
    return load_file(str(tmp / "reference.safetensors"))


def _same(path: Path, reference: dict[str, torch.Tensor]) -> None:
    got = load_file(str(path))
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_every_rank_killed_after_a_memory_save_resumes_bit_for_bit(tmp_path, reference):
    root = str(tmp_path / "ckpt")
    _job(tmp_path, "killed", "--root", root, "--stop", "8", "--kill-after", "5", expect_ok=False)
    out = _job(tmp_path, "resumed", "--root", root, "--stop", "8", "--resume")
    assert "loaded step 5 from the memory tier: 2 node(s) from their own memory" in out[0]
    _same(tmp_path / "resumed.safetensors", reference)
    # A replaced machine: node 1's memory directory is gone before the relaunch; its
    # ranks' state comes from the replicas node 0 keeps, and nothing is lost.
    root = str(tmp_path / "ckpt-replaced")
    _job(tmp_path, "killed2", "--root", root, "--stop", "8", "--kill-after", "5", expect_ok=False)
    shutil.rmtree(tmp_path / "shm-node1")
    out = _job(tmp_path, "replaced", "--root", root, "--stop", "8", "--resume")
    assert "loaded step 5 from the memory tier" in out[0], out[0][-3000:]
    assert "node(s) [1] from their peers' replicas" in out[0]
    _same(tmp_path / "replaced.safetensors", reference)


def test_both_nodes_memory_lost_resumes_from_the_newest_durable_step(tmp_path, reference):
    root = tmp_path / "ckpt"
    _job(
        tmp_path, "killed", "--root", str(root), "--stop", "8", "--kill-after", "5", expect_ok=False
    )
    # Durable every 4 memory saves: step 4 is the root's newest (the worker waited for its
    # copy before the kill); steps 4 and 5 are in both nodes' memory.
    assert open_checkpoint(str(root)).step().step == 4
    for node in (0, 1):
        assert (tmp_path / f"shm-node{node}").is_dir()
        shutil.rmtree(tmp_path / f"shm-node{node}")
    out = _job(tmp_path, "resumed", "--root", str(root), "--stop", "8", "--resume")
    line = next((s for s in out[0].splitlines() if s.startswith("resumed=")), out[0][-3000:])
    assert line.startswith("resumed=True at step 4: zerostate: loaded step 4 from the durable tier")
    assert line.endswith("(the memory tier holds no step)"), line
    _same(tmp_path / "resumed.safetensors", reference)


def test_one_rank_killed_mid_step_under_max_restarts_resumes_from_memory(tmp_path, reference):
    root = str(tmp_path / "ckpt")
    # Rank 3 SIGKILLs itself between the forward and the backward of step 6, after the
    # memory save of step 5; torchrun restarts every worker of both nodes, same job.
    args = ("--root", root, "--stop", "8", "--resume", "--die-mid-step", "5")
    out = _job(tmp_path, "restarted", *args, restarts=1)
    both = "\n".join(out)
    assert "exitcode: -9" in both  # the kill happened (torchrun's account of rank 3)
    # Rank 0's lines, of each attempt (c10d's rounds may put rank 0 on either node).
    lines = sorted(s for s in both.splitlines() if s.startswith("resumed="))
    assert lines == [
        "resumed=False at step 0: None",
        "resumed=True at step 5: zerostate: loaded step 5 from the memory tier: 2 node(s) "
        "from their own memory",
    ], both[-6000:]
    _same(tmp_path / "restarted.safetensors", reference)
