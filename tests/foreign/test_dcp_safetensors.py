"""DCP checkpoints whose tensor items are safetensors, written by torch's own writers
(``FileSystemWriter(serialization_format=SAFETENSORS)`` and ``HuggingFaceStorageWriter``),
read by every command and by ``engine.load``; hostile headers are refused in one line."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.foreign import peers
from tests.foreign.conftest import assert_reshards_to_format2, run_cli
from tests.foreign.peers_safetensors import CASES, SafetensorsCheckpoints, zerostate_load
from tests.helpers_dist import run_distributed
from zerostate.store.sources import open_source

ALL = [c[0] for c in CASES]


@pytest.fixture(scope="session")
def safetensors_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> SafetensorsCheckpoints:
    return SafetensorsCheckpoints(tmp_path_factory.mktemp("dcp-safetensors"))


@pytest.mark.parametrize("name", ALL)
def test_consolidate_gives_the_saved_tensors(safetensors_checkpoints, tmp_path, name):
    path, saved, _ = safetensors_checkpoints.get(name)
    out = tmp_path / "model.safetensors"
    result = run_cli("consolidate", str(path), str(out))
    assert result.returncode == 0, result.stderr
    mine = load_file(out)
    assert set(mine) == set(saved["model"])
    for key, tensor in saved["model"].items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key


def test_consolidate_equals_torchs_own_consolidation(safetensors_checkpoints, tmp_path):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    path, saved, _ = safetensors_checkpoints.get("hf-fsdp2-2")
    theirs = tmp_path / "torch"
    theirs.mkdir()
    consolidate_safetensors_files(str(path), str(theirs), dict.fromkeys(saved["model"], 1))
    ref = load_file(theirs / "model-00001-of-00001.safetensors")
    out = tmp_path / "mine.safetensors"
    assert run_cli("consolidate", str(path), str(out)).returncode == 0
    mine = load_file(out)
    assert set(mine) == set(ref)
    for key, tensor in ref.items():
        assert torch.equal(mine[key], tensor), key


@pytest.mark.parametrize("name", ["distcp-fsdp2-2", "hf-fsdp2-2"])
def test_inspect_verify_reshard(safetensors_checkpoints, tmp_path, name):
    path, _, world = safetensors_checkpoints.get(name)
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"world size {world}" in shown.stdout and "model/body.weight" in shown.stdout
    if name.startswith("distcp"):  # the optimizer state is there too
        assert "optim/exp_avg_sq/out.bias" in shown.stdout
    assert run_cli("verify", str(path)).returncode == 0
    assert_reshards_to_format2(path, tmp_path / "resharded")


def _largest(root: Path) -> Path:
    return max(
        (p for p in root.iterdir() if p.suffix in (".distcp", ".safetensors")),
        key=lambda p: p.stat().st_size,
    )


def _header_start(data: bytes) -> int:
    """Where the safetensors blob starts in a file (after any DCP byte items)."""
    return data.index(b'{"__metadata__"') - 8


@pytest.mark.parametrize("name", ["distcp-fsdp2-2", "hf-fsdp2-2"])
@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_verify_finds_header_and_size_damage(safetensors_checkpoints, tmp_path, name, damage):
    """safetensors has no checksum: verify re-reads every header and every byte and
    checks sizes and offsets against the file, so a changed header or a short file is
    found (a flipped byte inside tensor data cannot be)."""
    path, _, _ = safetensors_checkpoints.get(name)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    victim = _largest(copy)
    data = bytearray(victim.read_bytes())
    assert run_cli("verify", str(copy)).returncode == 0
    if damage == "header":
        at = data.index(b'"data_offsets":[', _header_start(data)) + len('"data_offsets":[')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
    else:
        del data[-3:]
    # The damage happens after the step is opened, as a disk fault would.
    st = open_source(str(copy)).step()
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match=victim.name):
        st.verify()
    result = run_cli("verify", str(copy))
    assert result.returncode == 1 and victim.name in result.stderr


@pytest.mark.parametrize(
    ("name", "world", "stage"),
    [
        ("hf-fsdp2-2", 1, 2),
        ("distcp-bare-1", 2, 3),
        ("hf-bare-1", 2, 1),
    ],
)
def test_engine_load_at_another_world_size(safetensors_checkpoints, name, world, stage):
    path, saved, _ = safetensors_checkpoints.get(name)
    mine = run_distributed(zerostate_load, world, str(path), stage, timeout=300)[0]
    for key, tensor in saved["model"].items():
        if key in mine["model"]:
            assert torch.equal(mine["model"][key], tensor.float()), key
    params = {k for k in saved["model"] if k != "scale"}
    assert params <= set(mine["model"])
    assert torch.equal(mine["model"]["emb.weight"], saved["model"]["emb.weight"])
    # A model state dict alone starts a fresh optimizer (the distcp FSDP2 case, which holds
    # the optimizer, is loaded and continued below).
    assert mine["steps"] == 0


#: Another world size that splits FSDP2's global batch (2 ranks x 2) evenly.
@pytest.mark.parametrize(("world", "stage"), [(1, 3), (4, 2)])
def test_engine_load_continues_fsdp2(safetensors_checkpoints, world, stage):
    """FSDP2's model and optimizer in safetensors items, loaded at another world size: the
    loaded weights are the saved ones exactly, and the next steps are FSDP2's own (it went
    on from the same state in the process that saved it) within 1e-5."""
    path, saved, peer_world = safetensors_checkpoints.get("distcp-fsdp2-2")
    mine = run_distributed(
        peers.zerostate_continue, world, str(path), stage, peer_world, timeout=300
    )[0]
    for key, tensor in saved["model"].items():
        if key in mine["loaded"]:
            assert torch.equal(mine["loaded"][key], tensor.float()), key
    assert {k for k in saved["model"] if k != "scale"} <= set(mine["loaded"])
    # Two steps restored from the checkpoint, two taken here.
    assert mine["steps"] == peers.TRAIN_STEPS + peers.NEXT_STEPS
    assert len(saved["after"]) == peers.NEXT_STEPS
    peers.assert_continues(saved["after"], mine["after"])
    # Each step moves the weights by about lr, three orders above the tolerance.
    moved = (saved["after"][0]["body.weight"] - mine["loaded"]["body.weight"]).abs().max()
    assert moved > 1e-3, moved


@pytest.fixture(scope="module")
def hf_with_optimizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``HuggingFaceStorageWriter`` given a model *and* its optimizer (one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = peers.build_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=peers.LR)
    model(*peers.batch(0, 0)).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd = {k: v for k, v in model_sd.items() if k != "head.weight"}
    out = tmp_path_factory.mktemp("hf-optimizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process"
        dcp.save(
            {"model": model_sd, "optimizer": optim_sd},
            storage_writer=dcp.HuggingFaceStorageWriter(str(out)),
        )
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_hf_writer_cannot_hold_an_optimizer(hf_with_optimizer, tmp_path):
    """The HF layout holds tensors only: given an optimizer, the writer puts its
    param_groups (plain values) as torch.save items ahead of the safetensors header and
    records nowhere where they end, so torch's own reader cannot open the file either.
    Every command says so in one line instead of a confusing header-length error."""
    import torch.distributed.checkpoint as dcp

    victim = next(hf_with_optimizer.glob("*.safetensors"))
    assert victim.read_bytes()[:4] == b"PK\x03\x04"
    model = peers.build_model()
    with pytest.raises(dcp.api.CheckpointException) as refused:
        dcp.load(
            {"model": model.state_dict()},
            storage_reader=dcp.HuggingFaceStorageReader(str(hf_with_optimizer)),
        )
    assert "deserializing header" in str(refused.value.failures[0])
    for argv in (
        ["inspect", str(hf_with_optimizer)],
        ["verify", str(hf_with_optimizer)],
        ["consolidate", str(hf_with_optimizer), str(tmp_path / "out.safetensors")],
    ):
        result = run_cli(*argv)
        assert result.returncode == 1, argv
        assert "starts with a torch.save archive" in result.stderr, result.stderr
        assert victim.name in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ hostile headers
def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _good_header() -> dict:
    return {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


HOSTILE = {
    "offset past the end": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        "past the end",
    ),
    "name with ..": (
        {"../../etc/w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        "unsafe",
    ),
    "unknown dtype": (
        {"w": {"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}},
        "does not know",
    ),
    "offsets not the shape": (
        {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        "do not hold",
    ),
    "overlapping tensors": (
        {
            "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        "gaps or overlaps",
    ),
    "header length past the end": (None, "header length"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["inspect", "verify", "consolidate"])
def test_hostile_headers_are_refused_in_one_line(tmp_path, case, command):
    header, expected = HOSTILE[case]
    root = tmp_path / "hf"
    root.mkdir()
    victim = root / "model-00001-of-00001.safetensors"
    if header is None:
        victim.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    else:
        _write_safetensors(victim, header, bytes(8))
    argv = [command, str(root)] + (
        [str(tmp_path / "out.safetensors")] if command == "consolidate" else []
    )
    result = run_cli(*argv)
    assert result.returncode == 1
    assert expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_good_handmade_file_is_read(tmp_path):
    """The hostile cases above differ from a readable file only in what they break."""
    root = tmp_path / "hf"
    root.mkdir()
    _write_safetensors(
        root / "model-00001-of-00001.safetensors",
        _good_header(),
        struct.pack("<2f", 1.5, -2.0),
    )
    st = open_source(str(root)).step()
    assert st.read("model/w").tolist() == [1.5, -2.0]
