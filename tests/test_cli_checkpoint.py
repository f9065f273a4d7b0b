"""The checkpoint commands end to end: consolidate, inspect, verify, reshard, and the
one-line errors users see when something is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file

from zerostate.store import open_checkpoint, save_tensors

PARAMS = {"wte.weight": (41, 13), "h.0.w": (13, 29), "h.0.b": (29,)}
ATTRS = {"engine": {"stage": 2, "precision": "bf16", "tied": {"lm_head.weight": "wte.weight"}}}


def source_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in PARAMS.items():
        tensors[f"model/{name}"] = torch.randn(shape, generator=gen)
        tensors[f"optim/exp_avg/{name}"] = torch.randn(shape, generator=gen)
        tensors[f"optim/exp_avg_sq/{name}"] = torch.rand(shape, generator=gen)
    tensors["buffers/pos"] = torch.arange(11)
    return tensors


def write_step(root: str, tensors: dict, world_size: int, step: int, ranks=None) -> None:
    """Write ``step`` as ``world_size`` ranks would; ``ranks`` limits it to some ranks and
    skips the commit (a crashed save)."""
    save_tensors(
        root, step, tensors, world_size=world_size, min_shard_numel=64, attrs=ATTRS, ranks=ranks
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path / "ckpt"
    tensors = source_tensors()
    write_step(str(root), tensors, 3, step=5)
    write_step(str(root), tensors, 3, step=7)
    return root, tensors


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


# --------------------------------------------------------------------- consolidate
def test_consolidate_fp32_and_bf16(ckpt, tmp_path: Path, capsys) -> None:
    root, tensors = ckpt
    out = tmp_path / "m.safetensors"
    code, stdout, _ = run_cli(["consolidate", str(root), str(out), "-q"], capsys)
    assert code == 0 and "step 7" in stdout and "tied: lm_head.weight" in stdout
    loaded = load_file(str(out))
    assert set(loaded) == {"wte.weight", "h.0.w", "h.0.b", "pos"}
    for name in PARAMS:
        assert torch.equal(loaded[name], tensors[f"model/{name}"])
    assert torch.equal(loaded["pos"], tensors["buffers/pos"])

    half = tmp_path / "h.safetensors"
    code, stdout, _ = run_cli(
        ["consolidate", str(root), str(half), "--dtype", "bf16", "--step", "5", "--json"], capsys
    )
    assert code == 0 and json.loads(stdout)["step"] == 5
    loaded = load_file(str(half))
    assert torch.equal(loaded["h.0.w"], tensors["model/h.0.w"].to(torch.bfloat16))
    assert loaded["pos"].dtype == torch.int64


def test_consolidate_sharded_with_index(ckpt, tmp_path: Path, capsys) -> None:
    root, tensors = ckpt
    out = tmp_path / "hf"
    code, stdout, _ = run_cli(
        ["consolidate", str(root), str(out), "--max-shard-size", "2KB", "--json"], capsys
    )
    assert code == 0
    result = json.loads(stdout)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(result["files"]) == len(set(index["weight_map"].values())) >= 2
    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(str(out / name)))
    assert set(loaded) == set(index["weight_map"])
    assert torch.equal(loaded["wte.weight"], tensors["model/wte.weight"])


def test_consolidate_refuses_existing_output(ckpt, tmp_path: Path, capsys) -> None:
    root, _ = ckpt
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"x")
    code, _, err = run_cli(["consolidate", str(root), str(out), "-q"], capsys)
    assert_one_line_error(code, err, "already exists", "--force")
    code, _, _ = run_cli(["consolidate", str(root), str(out), "-q", "--force"], capsys)
    assert code == 0 and len(load_file(str(out))) == 4


# ------------------------------------------------------------------------- inspect
def test_inspect_json_and_partial_steps(ckpt, capsys) -> None:
    root, tensors = ckpt
    write_step(str(root), tensors, 3, step=9, ranks=[1])  # a crashed save
    code, stdout, _ = run_cli(["inspect", str(root), "--json"], capsys)
    assert code == 0
    data = json.loads(stdout)
    assert data["steps"] == [5, 7] and data["step"] == 7 and data["partial_steps"] == [9]
    assert (data["world_size"], data["stage"], data["precision"]) == (3, 2, "bf16")
    assert data["format_version"] == 2
    # rows of 4 groups on 3 ranks at most, 3 manifests, 5 documents... not one per tensor
    assert data["objects"] == open_checkpoint(str(root)).step(7).object_count <= 4 * 3 + 64
    by_name = {t["name"]: t for t in data["tensors"]}
    assert by_name["model/wte.weight"]["shape"] == [41, 13]
    assert by_name["model/wte.weight"]["dtype"] == "float32"
    assert by_name["model/wte.weight"]["bytes"] == 41 * 13 * 4
    assert by_name["buffers/pos"]["dtype"] == "int64"
    model_bytes = sum(t.numel() * 4 for n, t in tensors.items() if n.startswith("model/"))
    assert data["totals"]["model"] == {
        "num_tensors": 3,
        "numel": model_bytes // 4,
        "bytes": model_bytes,
    }
    assert data["totals"]["optim"]["bytes"] == 2 * model_bytes
    assert data["totals"]["buffers"]["bytes"] == 11 * 8

    code, stdout, _ = run_cli(["inspect", str(root), "--step", "5"], capsys)
    assert code == 0
    assert "step 5: world size 3" in stdout and "stage 2" in stdout and "precision bf16" in stdout
    assert "partial steps" in stdout and "9" in stdout and "model/h.0.w" in stdout


def test_inspect_memory_url(capsys) -> None:
    root = f"memory://zs-cli-{uuid.uuid4().hex[:8]}/run"
    write_step(root, source_tensors(), 2, step=3)
    code, stdout, _ = run_cli(["inspect", root, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["world_size"] == 2


# -------------------------------------------------------------------------- verify
def test_verify_clean_then_damaged_chunk(ckpt, capsys) -> None:
    root, _ = ckpt
    code, stdout, _ = run_cli(["verify", str(root), "-q"], capsys)
    assert code == 0 and "every checksum matches" in stdout
    st = open_checkpoint(str(root)).step(7)
    path, offset = st.locate("model/h.0.w", st.tensors["model/h.0.w"].layout.chunk_numel)
    row = root / path
    data = bytearray(row.read_bytes())
    data[offset] ^= 0xFF
    row.write_bytes(bytes(data))
    code, _, err = run_cli(["verify", str(root), "-q"], capsys)
    assert_one_line_error(code, err, "'model/h.0.w'", "rank 1's row", "checksum")
    assert code == 1
    code, _, _ = run_cli(["verify", str(root), "--step", "5", "-q"], capsys)
    assert code == 0  # other steps are untouched


# ------------------------------------------------------------------------- reshard
def test_reshard_then_verify_and_consolidate(ckpt, tmp_path: Path, capsys) -> None:
    root, tensors = ckpt
    out = tmp_path / "resharded"
    code, stdout, _ = run_cli(["reshard", str(root), str(out), "--world-size", "2", "-q"], capsys)
    assert code == 0 and "3 -> 2" in stdout
    st = open_checkpoint(str(out)).step()
    assert st.world_size == 2
    for name, t in tensors.items():
        assert torch.equal(st.read(name), t), name
    assert run_cli(["verify", str(out), "-q"], capsys)[0] == 0
    code, _, err = run_cli(["reshard", str(root), str(out), "--world-size", "4"], capsys)
    assert_one_line_error(code, err, "already exists", "--force")


# -------------------------------------------------------------------------- errors
def test_missing_step_and_missing_checkpoint(ckpt, tmp_path: Path, capsys) -> None:
    root, _ = ckpt
    code, _, err = run_cli(["inspect", str(root), "--step", "6"], capsys)
    assert_one_line_error(code, err, "step 6 is not committed")
    code, _, err = run_cli(["verify", str(tmp_path / "nothing")], capsys)
    assert_one_line_error(code, err, "does not exist")
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["verify", str(tmp_path / "empty")], capsys)
    assert_one_line_error(code, err, "no committed step")


def test_uncommitted_step_is_not_readable(ckpt, tmp_path: Path, capsys) -> None:
    root, tensors = ckpt
    write_step(str(root), tensors, 3, step=9, ranks=[0, 1, 2])  # all wrote, none committed
    code, _, err = run_cli(["consolidate", str(root), str(tmp_path / "o"), "--step", "9"], capsys)
    assert_one_line_error(code, err, "step 9 is not committed")
    assert not list(tmp_path.glob("o*"))


def _edit_commit_record(root: Path, step: int, edit) -> None:
    path = root / f"step-{step:08d}" / "_zerostate" / "commit" / "zarr.json"
    path.write_bytes(edit(path.read_bytes()))


def test_unknown_format_version_and_corrupt_metadata(ckpt, capsys) -> None:
    root, _ = ckpt

    def bump(raw: bytes) -> bytes:
        doc = json.loads(raw)
        doc["attributes"]["zerostate_commit"]["format_version"] = 99
        return json.dumps(doc).encode()

    _edit_commit_record(root, 7, bump)
    code, _, err = run_cli(["inspect", str(root)], capsys)
    assert_one_line_error(code, err, "format version 99", "upgrade zerostate")
    _edit_commit_record(root, 5, lambda raw: raw[: len(raw) // 2])
    code, _, err = run_cli(["verify", str(root), "--step", "5"], capsys)
    assert_one_line_error(code, err, "not valid JSON")


def test_storage_option_errors(ckpt, capsys) -> None:
    root, _ = ckpt
    code, _, err = run_cli(["inspect", str(root), "--storage-option", "anon=true"], capsys)
    assert_one_line_error(code, err, "local path")
    code, _, err = run_cli(["inspect", str(root), "--storage-option", "novalue"], capsys)
    assert_one_line_error(code, err, "KEY=VALUE")


def test_installed_command_prints_one_line_not_a_traceback(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("zerostate")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "zerostate_cli.main"]
    proc = subprocess.run(
        [*cmd, "consolidate", str(tmp_path / "none"), str(tmp_path / "o.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ZEROSTATE_DEBUG": ""},
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("zerostate: error: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------ S3
@pytest.mark.s3
def test_s3_via_storage_options_and_missing_bucket(s3_server, tmp_path: Path, capsys) -> None:
    bucket, options = s3_server.new_bucket()
    root = f"s3://{bucket}/run"
    tensors = source_tensors()
    save_tensors(root, 4, tensors, world_size=1, min_shard_numel=64, storage_options=options)
    flags = [
        "--storage-option", f"key={s3_server.key}",
        "--storage-option", f"secret={s3_server.secret}",
        "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
    ]  # fmt: skip
    out = tmp_path / "m.safetensors"
    code, _, err = run_cli(["consolidate", root, str(out), "-q", *flags], capsys)
    assert code == 0, err
    assert torch.equal(load_file(str(out))["h.0.w"], tensors["model/h.0.w"])
    assert run_cli(["verify", root, "-q", *flags], capsys)[0] == 0
    missing = f"s3://zs-missing-{uuid.uuid4().hex[:8]}/run"
    code, _, err = run_cli(["inspect", missing, *flags], capsys)
    assert_one_line_error(code, err)
    assert "does not exist" in err and "zs-missing-" in err


@pytest.mark.slow
def test_output_into_a_closed_pipe_is_not_an_error(tmp_path):
    # Enough tensors that the listing overflows the pipe buffer after `head` has gone.
    tensors = {f"model/layer.{i}.weight": torch.zeros(3) for i in range(3000)}
    root = tmp_path / "many"
    save_tensors(str(root), 1, tensors, world_size=1)
    cmd = f"{sys.executable} -m zerostate_cli.main inspect {root} | head -1"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("checkpoint ")
    assert "error" not in proc.stderr.lower()
