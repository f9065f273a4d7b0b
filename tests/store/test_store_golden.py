"""The golden format-v1 checkpoint in fixtures/ must keep loading, bit for bit."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr

from zerostate.store import open_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden-v1"


def _sha256(t: torch.Tensor) -> str:
    flat = t.reshape(-1).contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((GOLDEN / "expected.json").read_text())


def test_golden_v1_loads_every_tensor(expected):
    reader = open_checkpoint(str(GOLDEN / "ckpt"))
    assert reader.steps() == [expected["step"]]
    st = reader.step()
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
    assert any(w["num_chunks"] == 3 for w in expected["tensors"].values())
    assert st.tensors["buffers/attn.mask"].dtype == torch.bfloat16
    st.verify()


def test_golden_v1_opens_with_plain_zarr(expected):
    group = zarr.open_group(str(GOLDEN / "ckpt" / f"step-{expected['step']:08d}"), mode="r")
    for name, want in expected["tensors"].items():
        arr = group[name]
        assert arr.attrs["shape"] == want["shape"] and arr.attrs["torch_dtype"] == want["dtype"]
        raw = arr[:].tobytes()  # bf16 comes back as its uint16 bits: same bytes
        assert hashlib.sha256(raw).hexdigest() == want["sha256"], name


def test_writer_still_produces_the_golden_bytes(tmp_path):
    """Today's writer reproduces format v1 exactly; a diff here is a format change."""
    subprocess.run(
        [sys.executable, str(GOLDEN.parent / "make_golden_v1.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    golden = {p.relative_to(GOLDEN): p.read_bytes() for p in GOLDEN.rglob("*") if p.is_file()}
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert sorted(map(str, fresh)) == sorted(map(str, golden))
    changed = [str(p) for p in golden if golden[p] != fresh[p]]
    assert changed == []
