"""Streaming consolidation to safetensors: exact format, casts, shards, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerostate.errors import CheckpointNotFoundError, ConfigError
from zerostate.store import save_tensors
from zerostate.store.consolidate import (
    ExportEntry,
    consolidate,
    parse_size,
    plan_shards,
    safetensors_header,
)

PARAMS = {
    "wte.weight": (33, 17),
    "h.0.attn.weight": (17, 51),
    "h.0.ln.bias": (17,),
    "lm_head.scale": (),
}


def source_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in PARAMS.items():
        tensors[f"model/{name}"] = torch.randn(shape, generator=gen)
        tensors[f"optim/exp_avg/{name}"] = torch.randn(shape, generator=gen)
        tensors[f"optim/exp_avg_sq/{name}"] = torch.rand(shape, generator=gen)
    tensors["buffers/pos_ids"] = torch.arange(9, dtype=torch.int64)
    tensors["buffers/mask"] = torch.tensor([True, False, True])
    return tensors


def write_checkpoint(
    root: Path, tensors: dict[str, torch.Tensor], world_size: int, step: int = 7, attrs=None
) -> None:
    """Every rank's writer in one process; rank 0 commits last (it waits for the others)."""
    save_tensors(str(root), step, tensors, world_size=world_size, min_shard_numel=64,
                 attrs=attrs or {})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("ckpt")
    tensors = source_tensors()
    write_checkpoint(root, tensors, world_size=3)
    return root, tensors


def expected(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        for prefix in ("model/", "buffers/"):
            if name.startswith(prefix):
                out[name[len(prefix) :]] = t
    return out


def test_fp32_output_equals_the_source(ckpt, tmp_path: Path) -> None:
    root, tensors = ckpt
    out = tmp_path / "model.safetensors"
    # A tiny piece size forces many reads per tensor, across chunk boundaries.
    result = consolidate(str(root), out, piece_bytes=40)
    loaded = load_file(str(out))
    want = expected(tensors)
    assert set(loaded) == set(want)  # no optimizer state
    for name, t in want.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    assert result.step == 7 and result.num_tensors == len(want)
    assert result.total_bytes == out.stat().st_size - 8 - int.from_bytes(
        out.read_bytes()[:8], "little"
    )
    assert not (tmp_path / "model.safetensors.partial").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_applies_to_floating_tensors_only(ckpt, tmp_path: Path, dtype) -> None:
    root, tensors = ckpt
    out = tmp_path / "half.safetensors"
    consolidate(str(root), out, dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    loaded = load_file(str(out))
    for name, t in expected(tensors).items():
        want = t.to(dtype) if t.is_floating_point() else t
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


def test_sharded_output_and_index_load_back(ckpt, tmp_path: Path) -> None:
    root, tensors = ckpt
    out = tmp_path / "hf"
    result = consolidate(str(root), out, max_shard_size=2500)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(result.files) > 1
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(load_file(str(out / name)))
    want = expected(tensors)
    assert set(index["weight_map"]) == set(want) == set(loaded)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in want.values()
    )
    for name, t in want.items():
        assert torch.equal(loaded[name], t), name


def test_sharded_naming_follows_the_output_file_name(ckpt, tmp_path: Path) -> None:
    root, _ = ckpt
    result = consolidate(str(root), tmp_path / "weights.safetensors", max_shard_size="1GB")
    assert [f.name for f in result.files] == ["weights-00001-of-00001.safetensors"]
    assert result.index == tmp_path / "weights.safetensors.index.json"


def test_existing_output_is_refused_without_force(ckpt, tmp_path: Path) -> None:
    root, _ = ckpt
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(ConfigError, match="--force"):
        consolidate(str(root), out)
    assert out.read_bytes() == b"keep me"
    consolidate(str(root), out, force=True)
    assert len(load_file(str(out))) == len(expected(ckpt[1]))


def test_missing_step_and_missing_checkpoint(ckpt, tmp_path: Path) -> None:
    root, _ = ckpt
    with pytest.raises(CheckpointNotFoundError):
        consolidate(str(root), tmp_path / "a.safetensors", step=8)
    with pytest.raises(CheckpointNotFoundError):
        consolidate(str(tmp_path / "nothing"), tmp_path / "b.safetensors")
    assert not list(tmp_path.glob("*.safetensors*"))


def test_header_is_aligned_and_contiguous() -> None:
    entries = [
        ExportEntry("b", "model/b", (3,), torch.bfloat16, 3),
        ExportEntry("a", "model/a", (2, 2), torch.float32, 4),
    ]
    blob = safetensors_header(entries)
    length = int.from_bytes(blob[:8], "little")
    assert length == len(blob) - 8 and length % 8 == 0
    header = json.loads(blob[8:])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["b"] == {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}
    assert header["a"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [6, 22]}


def test_plan_shards_packs_greedily_and_isolates_huge_tensors() -> None:
    entries = [
        ExportEntry(str(i), str(i), (n,), torch.float32, n) for i, n in enumerate([1, 1, 10, 1])
    ]
    shards = plan_shards(entries, 8)
    assert [[e.name for e in s] for s in shards] == [["0", "1"], ["2"], ["3"]]
    assert plan_shards(entries, None) == [entries]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("123", 123),
        ("1.5kb", 1500),
        ("7 MiB", 7 * 2**20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "5XB", "GB", "-1", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)
