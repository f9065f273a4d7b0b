"""``zerostate consolidate CKPT DIR/`` writes what ``from_pretrained(DIR)`` loads as is: the
weights and the ``config.json`` the engine recorded when it saved a transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cli_helpers import run_cli
from helpers_dist import run_distributed
from transformers import GPT2Config, GPT2LMHeadModel

import zerostate

CONFIG = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    engine = zerostate.Engine(model, stage=3, lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step + rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save(root)
    return engine.full_state_dict()


def test_consolidated_directory_loads_with_from_pretrained(tmp_path: Path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    full = run_distributed(_train_and_save, 2, root)[0]
    out = tmp_path / "hf"
    code, stdout, err = run_cli(["consolidate", root, f"{out}/", "-q"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]

    loaded = GPT2LMHeadModel.from_pretrained(out)
    state = loaded.state_dict()
    assert loaded.config.n_layer == 2 and loaded.config.n_embd == 32
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    for name, tensor in full.items():
        if name in state:
            assert torch.equal(state[name], tensor), name
    params = dict(loaded.named_parameters())
    assert set(params) <= set(full)  # every parameter came from the engine's weights

    sharded = tmp_path / "hf_sharded"
    code, _, err = run_cli(
        ["consolidate", root, str(sharded), "--max-shard-size", "20KB", "-q"], capsys
    )
    assert code == 0, err
    assert (sharded / "config.json").exists()
    assert (sharded / "model.safetensors.index.json").exists()
    again = GPT2LMHeadModel.from_pretrained(sharded).state_dict()
    assert all(torch.equal(again[n], state[n]) for n in state)
