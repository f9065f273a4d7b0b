"""Unit tests of the pure format helpers: names, step directories, dtypes, documents."""

from __future__ import annotations

import json

import pytest
import torch

from zerostate.errors import ConfigError, CorruptCheckpointError, UnsafeNameError
from zerostate.layout.partition import even_layout
from zerostate.store import format as fmt
from zerostate.store import open_checkpoint


@pytest.mark.parametrize(
    "name",
    ["model/h.0.attn.weight", "a", "optim/exp_avg/x-y_z.1", "rng/rank-00003", "..a", "a..b/c"],
)
def test_safe_names(name):
    assert fmt.validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        None,
        3,
        "",
        "/a",
        "a/",
        "a//b",
        ".",
        "..",
        "a/../b",
        "a/./b",
        "a\\b",
        "a b",
        "ü",
        "a\x00b",
        "x" * 201,
        "_zerostate",
        "_zerostate/commit",
        "m/zarr.json",
        "m/w.partial",
    ],
)
def test_unsafe_names(name):
    with pytest.raises(UnsafeNameError):
        fmt.validate_name(name)


def test_metadata_paths_may_use_reserved_parts():
    assert fmt.validate_name("_zerostate/commit/zarr.json", allow_meta=True)
    with pytest.raises(UnsafeNameError):
        fmt.validate_name("_zerostate/../../x", allow_meta=True)


def test_name_tree_rejects_arrays_containing_nodes():
    fmt.check_name_tree(["model/a", "model/b", "optim/exp_avg/a"])
    with pytest.raises(ConfigError, match="also a group"):
        fmt.check_name_tree(["model/a", "model/a/c"])
    with pytest.raises(ConfigError, match="twice"):
        fmt.check_name_tree(["a", "a"])


def test_step_dirs():
    assert fmt.step_dir(0) == "step-00000000" and fmt.step_dir(123) == "step-00000123"
    assert fmt.parse_step_dir("step-00000123") == 123
    for bad in ["step-123", "step-000000123", "step-0000012x", "step-00000123.partial", "x"]:
        assert fmt.parse_step_dir(bad) is None
    for bad in [-1, 10**8, 1.0, True, "1"]:
        with pytest.raises(ConfigError):
            fmt.step_dir(bad)


def test_foreign_entries_in_root_are_ignored(tmp_path):
    for name in ["step-1", "step-0000001x", "notes.txt", "step-00000003"]:
        (tmp_path / name).mkdir()
    reader = open_checkpoint(str(tmp_path))
    assert reader.steps() == []  # step-00000003 has no commit record


def test_dtypes_round_trip():
    for dtype in [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ]:
        assert fmt.dtype_from_name(fmt.dtype_name(dtype)) is dtype
    assert fmt.zarr_data_type(torch.bfloat16) == "uint16"
    with pytest.raises(ConfigError):
        fmt.dtype_name(torch.complex64)
    with pytest.raises(CorruptCheckpointError):
        fmt.dtype_from_name("object")


def test_array_document_is_zarr_v3_with_checksum():
    doc = json.loads(fmt.array_document((3, 7), torch.bfloat16, even_layout(21, 2), {"k": 1}))
    assert doc["zarr_format"] == 3 and doc["node_type"] == "array"
    assert doc["shape"] == [21] and doc["chunk_grid"]["configuration"]["chunk_shape"] == [11]
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "crc32c"]
    assert doc["attributes"] == {"k": 1, "shape": [3, 7], "torch_dtype": "bfloat16"}


def _record(**changes):
    layout = even_layout(10, 2)
    record = {
        "format_version": 1,
        "step": 5,
        "world_size": 2,
        "attrs": {},
        "files": {},
        "tensors": {
            "model/w": {
                "shape": [10],
                "dtype": "float32",
                "layout": layout.to_json(),
                "attrs": {},
                "chunks": [{"nbytes": 24, "crc32c": 1}] * 2,
            }
        },
    }
    record.update(changes)
    return record


def test_commit_record_validation():
    world_size, _, tensors, _ = fmt.parse_commit_record(_record(), 5, "r")
    assert world_size == 2 and tensors["model/w"].chunk_nbytes() == 24
    bad = [
        _record(step=6),
        _record(world_size=True),
        _record(world_size=0),
        _record(attrs=[]),
        _record(format_version="1"),
        _record(tensors={"model/w": {**_record()["tensors"]["model/w"], "dtype": "float9"}}),
        _record(
            tensors={
                "model/w": {
                    **_record()["tensors"]["model/w"],
                    "chunks": [{"nbytes": 24, "crc32c": 1}],
                }
            }
        ),
        _record(
            tensors={
                "model/w": {
                    **_record()["tensors"]["model/w"],
                    "chunks": [{"nbytes": 25, "crc32c": 1}] * 2,
                }
            }
        ),
        _record(
            tensors={
                "model/w": {
                    **_record()["tensors"]["model/w"],
                    "chunks": [{"nbytes": 24, "crc32c": 2**32}] * 2,
                }
            }
        ),
        _record(tensors={"model/w": {**_record()["tensors"]["model/w"], "layout": {"x": 1}}}),
    ]
    for record in bad:
        with pytest.raises(CorruptCheckpointError):
            fmt.parse_commit_record(record, 5, "r")
