"""Writers refuse a destination that is their own source under another spelling.

``zerostate reshard SRC DST --force`` deletes DST's copy of the step before writing it;
when DST is SRC through a symlink, ``file://``, ``..`` or a relative path, that used to
delete the source's committed step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli_err as run_cli

from zerostate.errors import ConfigError
from zerostate.store import open_checkpoint, save_tensors
from zerostate.store.consolidate import consolidate
from zerostate.store.reshard import reshard
from zerostate.store.storage import canonical_location, location_contains, locations_overlap

TENSORS = {
    "model/w": torch.arange(300, dtype=torch.float32).reshape(20, 15),
    "model/b": torch.ones(15),
    "buffers/n": torch.arange(4),
}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "runs" / "ckpt"
    save_tensors(str(root), 3, TENSORS, world_size=2, min_shard_numel=64)
    return root


def assert_source_intact(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st = open_checkpoint(str(root)).step(3)
    for name, t in TENSORS.items():
        assert torch.equal(st.read(name), t), name
    code, err = run_cli(["verify", str(root), "-q"], capsys)
    assert code == 0, err


def _spellings(root: Path, tmp_path: Path) -> dict[str, str]:
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    return {
        "symlink": str(link),
        "file-url": f"file://{root}",
        "dotdot": str(root / ".." / root.name),
        "relative": os.path.relpath(root),
        "trailing-slash": str(root) + "//",
    }


@pytest.mark.parametrize("how", ["symlink", "file-url", "dotdot", "relative", "trailing-slash"])
def test_self_reshard_is_refused_and_source_survives(ckpt, tmp_path, capsys, how) -> None:
    dst = _spellings(ckpt, tmp_path)[how]
    code, err = run_cli(["reshard", str(ckpt), dst, "--world-size", "3", "--force"], capsys)
    assert code == 1, err
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1, err
    assert "same checkpoint" in err and "separate directory" in err
    assert_source_intact(ckpt, capsys)
    # The other direction (the spelling as source, the plain path as destination) too.
    with pytest.raises(ConfigError, match="same checkpoint"):
        reshard(dst, str(ckpt), 3, force=True)
    assert_source_intact(ckpt, capsys)


def test_self_reshard_refused_with_an_opened_source(ckpt, tmp_path, capsys) -> None:
    reader = open_checkpoint(_spellings(ckpt, tmp_path)["symlink"])
    with pytest.raises(ConfigError, match="same checkpoint"):
        reshard(reader, str(ckpt), 3, force=True)
    assert_source_intact(ckpt, capsys)


def test_nested_destinations_are_refused(ckpt, tmp_path, capsys) -> None:
    for dst in (ckpt / "resharded", ckpt / "step-00000003", ckpt.parent):
        with pytest.raises(ConfigError, match="inside"):
            reshard(str(ckpt), str(dst), 3, force=True)
    assert_source_intact(ckpt, capsys)
    assert not (ckpt / "resharded").exists()
    # A sibling is fine, also when its name starts like the source's.
    out = reshard(str(ckpt), str(ckpt.parent / "ckpt2"), 3, force=True)
    assert out.world_size == 3
    open_checkpoint(str(ckpt.parent / "ckpt2")).step(3).verify()


def test_memory_urls_are_compared_after_normalising() -> None:
    save_tensors("memory://zs-overlap/run", 3, TENSORS, world_size=1, min_shard_numel=64)
    for dst in ("memory:///zs-overlap/run/", "memory://zs-overlap//run", "MEMORY://zs-overlap/run"):
        with pytest.raises(ConfigError, match="same checkpoint"):
            reshard("memory://zs-overlap/run", dst, 2, force=True)
    st = open_checkpoint("memory://zs-overlap/run").step(3)
    st.verify()
    assert torch.equal(st.read("model/w"), TENSORS["model/w"])


def test_object_store_aliases_are_one_location_without_any_network() -> None:
    # Refused before any connection is tried: no server, no credentials needed.
    with pytest.raises(ConfigError, match="same checkpoint"):
        reshard("s3://bucket/run", "s3a://bucket/run/", 2, force=True)
    with pytest.raises(ConfigError, match="inside"):
        reshard("s3://bucket/run", "s3://bucket/run/sub", 2, force=True)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("s3a://bucket/a/b/", "s3://bucket/a/b"),
        ("S3://bucket//a/./b", "s3://bucket/a/b"),
        ("s3://bucket/a/x/../b", "s3://bucket/a/b"),
        ("gcs://bucket/k", "gs://bucket/k"),
        ("simplecache::s3://bucket/k/", "s3://bucket/k"),
        ("memory:///x", "memory://x"),
    ],
)
def test_canonical_location_of_urls(url: str, want: str) -> None:
    assert canonical_location(url) == want


def test_canonical_location_of_local_paths(tmp_path: Path, monkeypatch) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "sym").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    want = "file://" + os.path.realpath(real)
    for spelling in ("real", "./real/", "sym", f"file://{tmp_path}/sym", "real/../real"):
        assert canonical_location(spelling) == want, spelling
    # Not created yet: resolved as far as it exists, still comparable.
    assert canonical_location("sym/new/dir") == want + "/new/dir"


def test_overlap_is_same_or_nested_only(tmp_path: Path) -> None:
    a = tmp_path / "a"
    assert locations_overlap(a, a / "b") and locations_overlap(a / "b", a)
    assert location_contains(a, a / "b") and not location_contains(a / "b", a)
    assert not locations_overlap(a, tmp_path / "ab")
    assert not locations_overlap("s3://b/run", "s3://b/run2")
    assert not locations_overlap("s3://b/run", "gs://b/run")
    assert not locations_overlap(str(a), "memory://" + str(a))


def test_consolidate_refuses_output_inside_the_checkpoint(ckpt, tmp_path, capsys) -> None:
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    for out in (ckpt / "m.safetensors", link / "step-00000003" / "m.safetensors", link):
        with pytest.raises(ConfigError, match="inside the checkpoint"):
            consolidate(str(ckpt), str(out), max_shard_size="1MB", force=True)
    code, err = run_cli(["consolidate", str(link), str(ckpt / "x.safetensors")], capsys)
    assert code == 1 and "inside the checkpoint" in err, err
    assert sorted(os.listdir(ckpt)) == ["step-00000003"]
    assert_source_intact(ckpt, capsys)
    # Beside the checkpoint is fine.
    result = consolidate(str(link), str(ckpt.parent / "m.safetensors"))
    assert result.num_tensors == 3
