"""Tensor-parallel checkpoints written by DeepSpeed AutoTP and by Megatron-Core themselves,
read by every command with each shard put back on its dimension, and resumed by
``engine.load`` without tensor parallelism."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.foreign import peers_tp
from tests.foreign.conftest import assert_reshards_to_format2, run_cli
from tests.helpers_dist import run_distributed

DEEPSPEED_TP = ["dstp1-tp2", "dstp2-tp2-dp2"]


@pytest.mark.parametrize("name", DEEPSPEED_TP)
def test_deepspeed_tp_commands_give_the_gathered_model(peer_checkpoints, tmp_path, name):
    path, result, world = peer_checkpoints.get(name)
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"world size {world}" in shown.stdout
    # full shapes: row-parallel down_proj is (16, 32), column-parallel gate_proj (32, 16)
    rows = {line.split()[0]: line.split()[1] for line in shown.stdout.splitlines() if "/" in line}
    assert rows["model/model.layers.0.mlp.down_proj.weight"] == "16x32"
    assert rows["optim/exp_avg_sq/model.layers.1.mlp.gate_proj.weight"] == "32x16"
    assert rows["model/lm_head.weight"] == "64x16"
    checked = run_cli("verify", str(path))
    assert checked.returncode == 0, checked.stderr
    out = tmp_path / "model.safetensors"
    done = run_cli("consolidate", str(path), str(out))
    assert done.returncode == 0, done.stderr
    mine = load_file(out)
    assert set(mine) == set(result["saved"])
    for key, tensor in result["saved"].items():
        assert torch.equal(mine[key], tensor), key
    assert_reshards_to_format2(path, tmp_path / "resharded")


@pytest.mark.parametrize("name", DEEPSPEED_TP)
def test_deepspeed_tp_engine_load_continues(peer_checkpoints, name):
    path, result, _ = peer_checkpoints.get(name)
    stage = 1 if name.startswith("dstp1") else 2
    ours = run_distributed(
        peers_tp.zerostate_continue_tp, 2, str(path), result["dp"], stage, timeout=300
    )[0]
    for key, tensor in result["saved"].items():
        assert torch.equal(ours["loaded"][key], tensor), key
    for k, (theirs, mine) in enumerate(zip(result["after"], ours["after"], strict=True)):
        for key, tensor in theirs.items():
            diff = (mine[key] - tensor).abs().max().item()
            assert diff <= 1e-5, f"step {k}: {key} differs by {diff}"


def test_deepspeed_tp_missing_rank_files_are_refused(peer_checkpoints, tmp_path):
    path, _, _ = peer_checkpoints.get("dstp1-tp2")
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    tag = next(p for p in copy.iterdir() if p.name.startswith("global_step"))
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    for command in ("inspect", "verify"):
        done = run_cli(command, str(copy))
        assert done.returncode != 0
        assert "tensor-parallel ranks" in done.stderr and len(done.stderr.splitlines()) == 1


def test_megatron_torch_dist_commands(peer_checkpoints, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    path, _, world = peer_checkpoints.get("mcore-tp2")
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"world size {world}" in shown.stdout
    checked = run_cli("verify", str(path))
    assert checked.returncode == 0, checked.stderr
    out = tmp_path / "model.safetensors"
    done = run_cli("consolidate", str(path), str(out))
    assert done.returncode == 0, done.stderr
    mine = load_file(out)
    full = peers_tp.megatron_full()
    assert set(mine) == set(full)
    for key, tensor in full.items():
        assert torch.equal(mine[key], tensor), key
    assert_reshards_to_format2(path, tmp_path / "resharded")
