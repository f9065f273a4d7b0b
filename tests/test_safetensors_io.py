"""Safetensors headers and indexes from untrusted sources: every hostile field is refused
with a project error before anything is allocated or read; good files read back exactly,
by element range, from local disk and an fsspec URL."""

from __future__ import annotations

import json
import struct

import fsspec
import pytest
import torch
from safetensors.torch import save, save_file

from zerostate import safetensors_io
from zerostate.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeNameError
from zerostate.safetensors_io import SafetensorsSource, parse_index


def _write(path, header: dict, data: bytes = b"", length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _open_error(path) -> Exception:
    with pytest.raises(Exception) as info:
        SafetensorsSource(str(path)).entries()
    return info.value


@pytest.mark.parametrize(
    ("header", "data", "length", "needle"),
    [
        ({"a": _entry()}, b"\0" * 8, 2**63, "header"),  # would allocate 8 EiB
        ({"a": _entry()}, b"\0" * 8, 10**6, "header"),  # longer than the file
        ({"a": _entry(dtype="F33")}, b"\0" * 8, None, "dtype"),
        ({"a": _entry(dtype=7)}, b"\0" * 8, None, "dtype"),
        ({"a": _entry(shape=(-2,))}, b"\0" * 8, None, "shape"),
        ({"a": {**_entry(), "shape": [True, 2]}}, b"\0" * 8, None, "shape"),
        ({"a": {**_entry(), "shape": "2"}}, b"\0" * 8, None, "shape"),
        ({"a": _entry(offsets=(0, 1 << 40))}, b"\0" * 8, None, "ends at"),  # out of file
        ({"a": _entry(offsets=(8, 0))}, b"\0" * 8, None, "data_offsets"),
        ({"a": _entry(offsets=(0, -8))}, b"\0" * 8, None, "data_offsets"),
        ({"a": _entry(shape=(3,))}, b"\0" * 8, None, "needs 12"),  # size != shape
        ({"a": _entry(), "b": _entry(offsets=(4, 12))}, b"\0" * 12, None, "overlap"),
        ({"a": {**_entry(), "extra": 1}}, b"\0" * 8, None, "exactly"),
        ({"__metadata__": {"x": 1}}, b"", None, "__metadata__"),
        ({"": _entry()}, b"\0" * 8, None, "empty"),
    ],
)
def test_hostile_headers_are_refused(tmp_path, header, data, length, needle) -> None:
    path = tmp_path / "model.safetensors"
    _write(path, header, data, length)
    err = _open_error(path)
    assert isinstance(err, CorruptCheckpointError), err
    assert needle in str(err), err


def test_malformed_json_and_duplicate_keys(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    for raw in (b"{not json", b"[1, 2]", b'{"a": 1, "a": 2}', b"\xff\xfe"):
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
        err = _open_error(path)
        assert isinstance(err, CorruptCheckpointError), (raw, err)
    path.write_bytes(b"\x01\x02")
    assert "too short" in str(_open_error(path))


@pytest.mark.parametrize(
    "name",
    [
        "../evil.safetensors",
        "/etc/evil.safetensors",
        "sub/model.safetensors",
        "..\\evil.safetensors",
        "C:evil.safetensors",
        "model.bin",
        ".safetensors",
        7,
    ],
)
def test_index_refuses_unsafe_file_names(tmp_path, name) -> None:
    raw = json.dumps({"weight_map": {"a": name}}).encode()
    with pytest.raises(UnsafeNameError, match="plain"):
        parse_index(raw, index="model.safetensors.index.json")
    (tmp_path / "model.safetensors.index.json").write_bytes(raw)
    assert isinstance(_open_error(tmp_path), UnsafeNameError)


def test_index_must_agree_with_headers(tmp_path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _open_error(tmp_path)
    assert isinstance(err, CorruptCheckpointError) and "b" in str(err)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": []}))
    assert isinstance(_open_error(tmp_path), CorruptCheckpointError)


def test_missing_checkpoint_names_what_was_looked_for(tmp_path) -> None:
    err = _open_error(tmp_path)
    assert isinstance(err, CheckpointNotFoundError)
    assert "model.safetensors.index.json" in str(err)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "h": torch.randn(3, 7, generator=g).half(),
        "n": torch.arange(9, dtype=torch.int32),
        "e": torch.zeros(0, 4),
    }


def _check_ranges(source: SafetensorsSource, tensors: dict[str, torch.Tensor]) -> None:
    entries = source.entries()
    assert set(entries) == set(tensors)
    for name, t in tensors.items():
        entry = entries[name]
        assert entry.shape == tuple(t.shape) and entry.dtype == t.dtype
        flat = t.reshape(-1).to(torch.float32)
        for start, stop in ((0, flat.numel()), (1, flat.numel() // 2), (3, 3)):
            stop = max(start, stop) if flat.numel() else 0
            start = min(start, stop)
            out = torch.full((stop - start,), float("nan"))
            source.read_elements(entry, start, stop, out)
            assert torch.equal(out, flat[start:stop]), name


def test_ranges_read_back_exactly_in_small_pieces(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(safetensors_io, "READ_PIECE_BYTES", 6)  # several pieces per range
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _check_ranges(SafetensorsSource(str(tmp_path)), tensors)
    _check_ranges(SafetensorsSource(str(tmp_path / "model.safetensors")), tensors)


def test_sharded_index_over_an_fsspec_url() -> None:
    tensors = _tensors()
    fs = fsspec.filesystem("memory")
    names = list(tensors)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        fs.pipe(f"/hf-test/{file}", save({n: tensors[n] for n in part}))
        weight_map.update(dict.fromkeys(part, file))
    fs.pipe(
        "/hf-test/model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode()
    )
    try:
        source = SafetensorsSource("memory://hf-test")
        assert source.files == weight_map
        _check_ranges(source, tensors)
    finally:
        fs.rm("/hf-test", recursive=True)


def test_a_checkpoint_root_given_for_weights_says_what_to_do(tmp_path) -> None:
    """``load_pretrained`` (and every reader of safetensors) handed a training checkpoint's
    root names the two ways on; a directory that is neither gets the plain message."""
    root = tmp_path / "ckpt"
    (root / "step-00000003").mkdir(parents=True)
    hint = r"checkpoint root.*engine\.load.*consolidate"
    with pytest.raises(CheckpointNotFoundError, match=hint):
        SafetensorsSource(str(root))
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointNotFoundError) as info:
        SafetensorsSource(str(tmp_path / "other"))
    assert "checkpoint root" not in str(info.value)
