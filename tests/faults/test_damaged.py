"""Damaged and hostile checkpoints: every object of a committed step is damaged in turn
(truncated, a byte flipped, deleted, replaced by a link out of the checkpoint), and the
commit record is rewritten with hostile content. For each case:

* the store never hands back wrong tensor data: either every tensor still reads exactly as
  saved, or the read raises one of zerostate's checkpoint errors;
* damage to a data piece is always detected by ``verify`` and by a load;
* the CLI answers with one line and exit status 1, never a traceback.

The cases walk the files of the step directory, so they follow whatever objects the current
format writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from zerostate.errors import CheckpointError
from zerostate.store import open_checkpoint, save_tensors

STEP = 7


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for state in ("model", "optim/exp_avg"):
        for name, shape in {"a": (17, 257), "b": (5,), "c": (3, 1, 7), "s": ()}.items():
            out[f"{state}/{name}"] = torch.randn(shape, generator=g)
    out["buffers/idx"] = torch.arange(41, dtype=torch.int64)
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    save_tensors(str(root), STEP, _tensors(), world_size=3)
    return root


def _step_files(root: Path) -> list[str]:
    step = root / f"step-{STEP:08d}"
    return sorted(p.relative_to(root).as_posix() for p in step.rglob("*") if p.is_file())


def _is_document(rel: str) -> bool:
    return rel.endswith(".json")


def _commit_record(root: Path) -> Path:
    found = [p for p in root.rglob("zarr.json") if p.parent.name == "commit"]
    assert len(found) == 1, found
    return found[0]


def _read_all_or_error(root: Path) -> str:
    """'equal' if every tensor reads back exactly, 'error' if a checkpoint error is raised;
    any other outcome (wrong data, a foreign exception) fails the test."""
    expected = _tensors()
    try:
        st = open_checkpoint(str(root)).step()
        for name, value in expected.items():
            got = st.read(name)
            assert got.dtype == value.dtype and torch.equal(got, value), f"wrong data in {name}"
    except CheckpointError:
        return "error"
    return "equal"


def _verify_raises(root: Path) -> bool:
    try:
        open_checkpoint(str(root)).step().verify()
    except CheckpointError:
        return True
    return False


@dataclass
class CliResult:
    returncode: int
    stderr: str


def _cli(*args: str) -> CliResult:
    """Run the CLI in this process: an exception it does not turn into its one-line error
    escapes and fails the test (that is the traceback a user would see)."""
    from zerostate_cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, err.getvalue())


def _assert_one_line_failure(proc: CliResult) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zerostate: error:"), proc.stderr


def _damage(path: Path, how: str, outside: Path) -> None:
    data = path.read_bytes()
    if how == "truncate-tail":
        path.write_bytes(data[:-1])
    elif how == "truncate-half":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        pos = len(data) // 2
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x5A]) + data[pos + 1 :])
    elif how == "delete":
        path.unlink()
    elif how == "symlink-out":
        # A link out of the checkpoint to a file with other bytes of the same size.
        target = outside / f"{path.name}.outside"
        target.write_bytes(bytes(b ^ 0xFF for b in data))
        path.unlink()
        path.symlink_to(target)
    else:
        raise AssertionError(how)


DAMAGE = ("truncate-tail", "truncate-half", "flip", "delete", "symlink-out")
#: Damage a load may not read: format 2 keeps a row's index (with its own checksum) at the
#: end of the object, and a load reads only the inner chunks it needs, whose checksums are
#: intact. ``verify`` still catches it, and the load returns exact data.
UNREAD_BY_LOADS = {"truncate-tail"}


@pytest.mark.parametrize("how", DAMAGE)
def test_every_damaged_object_is_caught_or_harmless(pristine, tmp_path, how):
    files = _step_files(pristine)
    assert any(not _is_document(f) for f in files)
    outcomes: dict[str, str] = {}
    for rel in files:
        root = tmp_path / "ckpt"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine, root)
        _damage(root / rel, how, tmp_path)
        outcome = _read_all_or_error(root)
        outcomes[rel] = outcome
        if not _is_document(rel):
            # A data piece holds tensor bytes: damage to it must never go unnoticed.
            if how not in UNREAD_BY_LOADS:
                assert outcome == "error", f"{how} of {rel} was not detected by a load"
            assert _verify_raises(root), f"{how} of {rel} passed verify"
    assert "error" in outcomes.values() or how in UNREAD_BY_LOADS


@pytest.mark.parametrize("how", DAMAGE)
def test_cli_verify_reports_damage_in_one_line(pristine, tmp_path, how):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    data = [f for f in _step_files(root) if not _is_document(f)]
    _damage(root / data[len(data) // 2], how, tmp_path)
    _assert_one_line_failure(_cli("verify", str(root)))
    if how not in UNREAD_BY_LOADS:
        out = tmp_path / "out.safetensors"
        _assert_one_line_failure(_cli("consolidate", str(root), str(out)))
        assert not out.exists()


def _rewrite_commit(root: Path, mutate) -> None:
    path = _commit_record(root)
    doc = json.loads(path.read_text())
    record = doc["attributes"]["zerostate_commit"]
    mutate(record)
    path.write_text(json.dumps(doc))


def _first_tensor(record: dict) -> dict:
    return record["tensors"][sorted(record["tensors"])[0]]


def _set_name(record: dict, new: str) -> None:
    tensors = record["tensors"]
    old = sorted(tensors)[0]
    tensors[new] = tensors.pop(old)


HOSTILE = {
    "unknown format version": lambda r: r.__setitem__("format_version", 999),
    "format version not an integer": lambda r: r.__setitem__("format_version", "2"),
    "absurd shape (1e18 elements)": lambda r: _first_tensor(r).__setitem__("shape", [10**18]),
    "negative dimension": lambda r: _first_tensor(r).__setitem__("shape", [-4, 3]),
    "wrong dtype": lambda r: _first_tensor(r).__setitem__("dtype", "complex128"),
    "dtype not a string": lambda r: _first_tensor(r).__setitem__("dtype", {"x": 1}),
    "traversal name": lambda r: _set_name(r, "../../../etc/passwd"),
    "absolute name": lambda r: _set_name(r, "/etc/passwd"),
    "dotted component": lambda r: _set_name(r, "model/../../x"),
    "world size zero": lambda r: r.__setitem__("world_size", 0),
    "world size absurd": lambda r: r.__setitem__("world_size", 10**12),
    "tensors not an object": lambda r: r.__setitem__("tensors", [1, 2]),
    "step mismatch": lambda r: r.__setitem__("step", STEP + 1),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_commit_record_is_refused(pristine, tmp_path, case):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    _rewrite_commit(root, HOSTILE[case])
    with pytest.raises(CheckpointError):
        st = open_checkpoint(str(root)).step()
        for name in _tensors():
            st.read(name)
    for command in ("verify", "inspect"):
        _assert_one_line_failure(_cli(command, str(root)))


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00\xff garbage", b"[]", b'{"attributes": 5}', b"{" * 100_000, b"{}"],
    ids=["empty", "binary", "list", "attributes-not-object", "deep-nesting", "empty-object"],
)
def test_garbage_commit_record_is_refused(pristine, tmp_path, content):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    _commit_record(root).write_bytes(content)
    with pytest.raises(CheckpointError):
        open_checkpoint(str(root)).step()
    _assert_one_line_failure(_cli("inspect", str(root)))


def test_oversized_commit_record_is_refused_before_parsing(pristine, tmp_path, monkeypatch):
    from zerostate.store import format as fmt

    # The real limit is hundreds of MiB; a small one keeps the test fast.
    monkeypatch.setattr(fmt, "MAX_DOCUMENT_NBYTES", 1 << 20)
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    path = _commit_record(root)
    doc = json.loads(path.read_text())
    doc["attributes"]["zerostate_commit"]["attrs"]["padding"] = "x" * (2 << 20)
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="larger than any document"):
        open_checkpoint(str(root)).step()


def test_symlinked_step_directory_out_of_root_is_not_followed(pristine, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    shutil.copytree(pristine / f"step-{STEP:08d}", outside)
    os.symlink(outside, root / f"step-{STEP:08d}")
    with pytest.raises(CheckpointError):
        st = open_checkpoint(str(root)).step()
        st.verify()
