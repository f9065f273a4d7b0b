"""The example's consolidated checkpoint, with its config, loads in Hugging Face transformers
(GPT2LMHeadModel, random init, no hub access) and gives the engine's logits."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from e2e_common import free_port

transformers = pytest.importorskip("transformers")  # part of the `test` extra

REPO = Path(__file__).resolve().parents[2]


def test_example_checkpoint_loads_in_transformers(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "examples"))
    import train_gpt

    from zerostate.store.consolidate import consolidate

    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--ckpt", str(ckpt), "--steps", "6", "--save-every", "3", "--n-embd", "32",
            "--n-layer", "2", "--seq-len", "32", "--global-batch", "4"]
    assert train_gpt.main(args) == 0
    assert not dist.is_initialized()

    out = tmp_path / "hf"
    out.mkdir()
    consolidate(str(ckpt), str(out / "model.safetensors"))
    (out / "config.json").write_text((ckpt / "config.json").read_text())

    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True)
    hf.eval()

    # The same weights in the reference model, through the safetensors file.
    from safetensors.torch import load_file

    from zerostate.models import GPT2, GPT2Config

    cfg = json.loads((ckpt / "config.json").read_text())
    ours = GPT2(GPT2Config(**{k: cfg[k] for k in ("vocab_size", "n_positions", "n_embd",
                                                      "n_layer", "n_head")}))
    missing, unexpected = ours.load_state_dict(load_file(str(out / "model.safetensors")),
                                               strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(idx)
        got = hf(idx).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()
    assert os.path.getsize(out / "model.safetensors") > 0
