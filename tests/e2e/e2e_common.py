"""Helpers shared by the end-to-end tests: a torchrun launcher and the single-process
AdamW reference they are compared with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers_dist import free_port  # [Note: free ports]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ckpt_worker.py"
sys.path.insert(0, str(HERE))


def torchrun(nproc: int, jobs: list[dict], out: Path, *, timeout: float = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(WORKER), "--out", str(out),
    ]
    for job in jobs:
        cmd += ["--job", json.dumps(job)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-12000:]}"
        )
    return proc


def reference_run(num_steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch.optim.AdamW on the full batch: the ground truth."""
    import ckpt_worker as w

    torch.set_num_threads(1)
    model = w.make_model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": w.WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=w.LR,
        eps=w.EPS,
    )
    losses = []
    for step in range(num_steps):
        idx, tgt = w.global_batch(step)
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_matches_reference(losses: list[float], params: dict[str, torch.Tensor],
                             ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: loss {a} vs reference {b}"
    checked = 0
    for name, ref in ref_params.items():
        if name not in params:
            continue  # the tied alias lm_head.weight appears once, under its first name
        got = params[name].float()
        rel = (got - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel <= 1e-5, f"{name}: relative L2 error {rel:.3e}"
        checked += 1
    assert checked >= len([p for p in ref_params if not p.startswith("lm_head")])
