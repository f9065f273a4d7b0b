"""The golden checkpoints in fixtures/ must keep loading, bit for bit: format v1 (read
only: load, plain zarr, verify, consolidate, reshard into v2) and format v2 (what today's
writer writes, byte for byte)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr
from _store_helpers import doc_snippet_read_tensor

from zerostate.store import open_checkpoint
from zerostate.store.consolidate import consolidate
from zerostate.store.reshard import reshard

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GOLDEN_V1 = FIXTURES / "golden-v1"
GOLDEN_V2 = FIXTURES / "golden-v2"


def _sha256(t: torch.Tensor) -> str:
    flat = t.reshape(-1).contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _expected(golden: Path) -> dict:
    return json.loads((golden / "expected.json").read_text())


def _check_tensors(st, expected: dict) -> None:
    assert (st.step, st.world_size, st.format_version) == (
        expected["step"],
        expected["world_size"],
        expected["format_version"],
    )
    assert st.attrs == expected["attrs"]
    assert set(st.tensors) == set(expected["tensors"])
    for name, want in expected["tensors"].items():
        info = st.tensors[name]
        assert list(info.shape) == want["shape"], name
        assert str(info.dtype).removeprefix("torch.") == want["dtype"], name
        assert info.layout.num_chunks == want["num_chunks"], name
        got = st.read(name)
        assert got.dtype == info.dtype and _sha256(got) == want["sha256"], name
    st.verify()


@pytest.mark.parametrize("golden", [GOLDEN_V1, GOLDEN_V2], ids=["v1", "v2"])
def test_golden_loads_every_tensor(golden):
    expected = _expected(golden)
    reader = open_checkpoint(str(golden / "ckpt"))
    assert reader.steps() == [expected["step"]]
    st = reader.step()
    _check_tensors(st, expected)
    assert any(w["num_chunks"] == 3 for w in expected["tensors"].values())
    assert st.tensors["buffers/attn.mask"].dtype == torch.bfloat16
    states = [st.rank_state(r) for r in range(st.world_size)]
    assert states == expected.get("rank_states", [None] * st.world_size)


@pytest.mark.parametrize("new_world_size", [1, 2, 4])
@pytest.mark.parametrize("golden", [GOLDEN_V1, GOLDEN_V2], ids=["v1", "v2"])
def test_golden_reads_at_other_world_sizes(golden, new_world_size):
    from zerostate.layout.partition import even_layout

    st = open_checkpoint(str(golden / "ckpt")).step()
    for name, want in _expected(golden)["tensors"].items():
        info = st.tensors[name]
        layout = even_layout(info.numel, new_world_size)
        flat = torch.empty(info.numel, dtype=info.dtype)
        for rank in range(new_world_size):  # each new rank reads only its own range
            start, stop = layout.owned_range(rank)
            st.read_range(name, start, stop, out=flat[start:stop])
        assert _sha256(flat) == want["sha256"], name


def test_golden_v1_opens_with_plain_zarr():
    expected = _expected(GOLDEN_V1)
    group = zarr.open_group(str(GOLDEN_V1 / "ckpt" / f"step-{expected['step']:08d}"), mode="r")
    for name, want in expected["tensors"].items():
        arr = group[name]
        assert arr.attrs["shape"] == want["shape"] and arr.attrs["torch_dtype"] == want["dtype"]
        raw = arr[:].tobytes()  # bf16 comes back as its uint16 bits: same bytes
        assert hashlib.sha256(raw).hexdigest() == want["sha256"], name


def test_golden_v2_opens_with_plain_zarr_and_the_documented_snippet():
    expected = _expected(GOLDEN_V2)
    url = str(GOLDEN_V2 / "ckpt" / f"step-{expected['step']:08d}")
    read_tensor = doc_snippet_read_tensor()
    for name, want in expected["tensors"].items():
        got = read_tensor(url, name)
        assert list(got.shape) == want["shape"], name
        assert hashlib.sha256(got.tobytes()).hexdigest() == want["sha256"], name


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_golden_v1_consolidates_to_the_same_bytes_as_before(tmp_path, dtype):
    want = json.loads((GOLDEN_V1 / "consolidated.json").read_text())[dtype or "stored"]
    out = tmp_path / "model.safetensors"
    consolidate(str(GOLDEN_V1 / "ckpt"), out, dtype=dtype)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == want


def test_golden_v1_reshards_into_v2(tmp_path):
    expected = _expected(GOLDEN_V1)
    result = reshard(str(GOLDEN_V1 / "ckpt"), tmp_path / "v2", 2)
    assert (result.src_world_size, result.world_size) == (3, 2)
    st = open_checkpoint(str(tmp_path / "v2")).step()
    assert st.format_version == 2 and st.world_size == 2
    for name, want in expected["tensors"].items():
        assert _sha256(st.read(name)) == want["sha256"], name
    st.verify()
    # consolidating the converted step gives the bytes the v1 step gave
    out = tmp_path / "model.safetensors"
    consolidate(str(tmp_path / "v2"), out)
    stored = json.loads((GOLDEN_V1 / "consolidated.json").read_text())["stored"]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == stored


def test_writer_still_produces_the_golden_v2_bytes(tmp_path):
    """Today's writer reproduces format v2 exactly; a diff here is a format change."""
    subprocess.run(
        [sys.executable, str(FIXTURES / "make_golden_v2.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    golden = {p.relative_to(GOLDEN_V2): p.read_bytes() for p in GOLDEN_V2.rglob("*") if p.is_file()}
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert sorted(map(str, fresh)) == sorted(map(str, golden))
    changed = [str(p) for p in golden if golden[p] != fresh[p]]
    assert changed == []


@pytest.mark.parametrize("golden", [GOLDEN_V1, GOLDEN_V2], ids=["v1", "v2"])
def test_inspect_shows_version_and_objects(golden, capsys):
    from zerostate_cli.main import main

    assert main(["inspect", str(golden / "ckpt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = _expected(golden)
    files = [p for p in (golden / "ckpt").rglob("*") if p.is_file()]
    assert (data["format_version"], data["objects"]) == (expected["format_version"], len(files))
