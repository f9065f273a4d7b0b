"""Checkpoints written by DeepSpeed and by FSDP2 + DCP, read by every command and resumed
by ``engine.load`` at another world size."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.foreign import peers
from tests.foreign.conftest import DEEPSPEED_CASES, assert_reshards_to_format2, run_cli
from tests.helpers_dist import run_distributed

ALL = [c[0] for c in DEEPSPEED_CASES] + ["dcp-2"]


def _reference(path: Path, name: str) -> dict[str, torch.Tensor]:
    """What the peer's own tool consolidates: zero_to_fp32 or dcp_to_torch_save."""
    if name.startswith("dcp"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = path.parent / f"{name}.pt"
        if not out.exists():
            dcp_to_torch_save(str(path), str(out))
        return torch.load(out, weights_only=True)["model"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path)))


@pytest.mark.parametrize("name", ALL)
def test_consolidate_gives_the_peer_tools_tensors(peer_checkpoints, tmp_path, name):
    path, _, world = peer_checkpoints.get(name)
    out = tmp_path / "model.safetensors"
    result = run_cli("consolidate", str(path), str(out), "--json")
    assert result.returncode == 0, result.stderr
    mine = load_file(out)
    ref = _reference(path, name)
    tied = {"head.weight": "emb.weight"}
    for key, tensor in ref.items():
        got = mine.get(key, mine.get(tied.get(key, "")))
        assert got is not None, f"{key} missing from the consolidated file"
        assert got.dtype == tensor.dtype and torch.equal(got, tensor.contiguous()), key
    # Beyond the reference: only what zero_to_fp32 leaves out at stage 1 (the frozen
    # parameters, which the model states hold at the working dtype).
    extra = set(mine) - set(ref)
    assert extra <= {"frozen.weight", "frozen.bias"}, extra
    assert not extra or name.startswith("ds1")


@pytest.mark.parametrize(
    "name",
    [
        "ds2-fp32-2",
        "ds1-fp32-4",
        "ds3-fp32-4",
        "ds1-bf16-2",
        "ds2-bf16-2",
        "ds1-bf16-4",
        "ds2-bf16-4",
        "ds3-bf16-4",
        "dcp-2",
    ],  # fmt: skip
)
def test_inspect_verify_reshard(peer_checkpoints, tmp_path, name):
    path, _, world = peer_checkpoints.get(name)
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"world size {world}" in shown.stdout and "model/body.weight" in shown.stdout
    assert "optim/exp_avg_sq/out.bias" in shown.stdout
    checked = run_cli("verify", str(path))
    assert checked.returncode == 0, checked.stderr
    assert_reshards_to_format2(path, tmp_path / "resharded")


@pytest.mark.parametrize("name", ["ds2-fp32-2", "dcp-2"])
def test_verify_finds_a_damaged_byte(peer_checkpoints, tmp_path, name):
    import shutil

    path, _, _ = peer_checkpoints.get(name)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    victim = max(
        (p for p in copy.rglob("*") if p.suffix in (".pt", ".distcp")),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor bytes of the largest file
    victim.write_bytes(bytes(data))
    result = run_cli("verify", str(copy))
    assert result.returncode == 1
    assert victim.name in result.stderr


#: (peer checkpoint, zerostate world size, zerostate stage): always another world size.
CONTINUATIONS = [
    ("ds1-fp32-2", 1, 1),
    ("ds2-fp32-2", 4, 2),
    ("ds3-fp32-2", 1, 3),
    ("ds1-fp32-4", 2, 2),
    ("ds2-fp32-4", 2, 3),
    ("ds3-fp32-4", 2, 2),
    ("dcp-2", 1, 3),
    ("dcp-2", 4, 2),
]


@pytest.mark.parametrize(("name", "world", "stage"), CONTINUATIONS)
def test_engine_load_continues_the_peer_run(peer_checkpoints, name, world, stage):
    path, peer, peer_world = peer_checkpoints.get(name)
    mine = run_distributed(
        peers.zerostate_continue, world, str(path), stage, peer_world, timeout=300
    )[0]
    assert mine["steps"] == peers.TRAIN_STEPS + peers.NEXT_STEPS
    peers.assert_continues(peer["after"], mine["after"])
