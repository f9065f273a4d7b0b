"""The example's consolidated checkpoint, with its config, loads in Hugging Face transformers
(GPT2LMHeadModel, random init, no hub access) and gives the same logits as the engine's
model resumed from that checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_common import free_port

transformers = pytest.importorskip("transformers")  # part of the `test` extra

REPO = Path(__file__).resolve().parents[2]


def test_example_checkpoint_loads_in_transformers(tmp_path, monkeypatch):
    import torch.distributed as dist

    import zerostate
    from zerostate.models import GPT2, GPT2Config
    from zerostate.store.consolidate import consolidate

    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(REPO / "examples" / "train_gpt.py"), "--ckpt", str(ckpt), "--steps", "6",
           "--save-every", "3", "--n-embd", "32", "--n-layer", "2", "--seq-len", "32",
           "--global-batch", "4", "--stage", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]

    out = tmp_path / "hf"
    out.mkdir()
    consolidate(str(ckpt), str(out / "model.safetensors"))
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True)
    hf.eval()

    # The engine's model: resume the 2-rank checkpoint on one rank and run a forward.
    cfg = json.loads((ckpt / "config.json").read_text())
    keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        engine = zerostate.Engine(GPT2(GPT2Config(**{k: cfg[k] for k in keys})), stage=2)
        state = engine.load(str(ckpt))
        assert state == {"next_step": 6}
        idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = engine(idx)
            got = hf(idx).logits
    finally:
        dist.destroy_process_group()
    assert expected.shape == got.shape == (2, 32, 256)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()
