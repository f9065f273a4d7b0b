"""examples/lora.py under torchrun on 2 ranks, and its adapter export: the directory loads
with ``PeftModel.from_pretrained`` and gives the trained model's logits; the CLI's
``consolidate --trainable-only`` writes the same adapter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from helpers_dist import free_port
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lora.py"
STEPS = 5


def _example():
    spec = importlib.util.spec_from_file_location("lora_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    log = work / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(EXAMPLE), "--workdir", str(work),
           "--steps", str(STEPS), "--log-json", str(log)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return work, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_lora_example_stores_the_base_once(lora_run):
    work, records = lora_run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["refs"] == 0 and all(r["refs"] > 0 for r in records[1:])
    model = _example().make_lora(_example().make_base())
    trainable = sum(12 * p.numel() for p in model.parameters() if p.requires_grad)
    assert all(r["row_bytes"] <= 1.5 * trainable for r in records[1:]), (records, trainable)
    print(
        f"\nexamples/lora.py: step 1 {records[0]['row_bytes']} B of rows, later steps "
        f"{[r['row_bytes'] for r in records[1:]]} B for {trainable} B of trainable state "
        f"({max(r['row_bytes'] for r in records[1:]) / trainable:.3f}x)"
    )
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.slow
def test_adapter_export_loads_with_peft_and_gives_the_same_logits(lora_run, tmp_path, capsys):
    from peft import PeftModel

    work, _ = lora_run
    example = _example()
    trained = example.make_lora(example.make_base())
    trained.load_state_dict(load_file(str(work / "model.safetensors")), strict=True)
    loaded = PeftModel.from_pretrained(example.make_base(), str(work / "adapter"))
    ids = example.batch(99, 0, 1)
    trained.eval(), loaded.eval()
    with torch.no_grad():
        want, got = trained(input_ids=ids).logits, loaded(input_ids=ids).logits
        plain = example.make_base()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(plain, want, atol=1e-4)  # the adapters changed the output
    config = json.loads((work / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == [
        "q_proj",
        "v_proj",
    ]
    # The command line writes the same adapter.
    code, out, _ = run_cli(
        ["consolidate", str(work / "ckpt"), str(tmp_path / "cli"), "--trainable-only"], capsys
    )
    assert code == 0, out
    a = load_file(str(tmp_path / "cli" / "adapter_model.safetensors"))
    b = load_file(str(work / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(".lora_" in k and ".default." not in k for k in a)
