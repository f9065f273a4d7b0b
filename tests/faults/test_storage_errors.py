"""Storage failures: what is retried, what fails at once, and that the cause survives."""

from __future__ import annotations

import errno
import os

import pytest

from zerostate.errors import StorageError, UnsafeNameError
from zerostate.store.storage import LocalStorage, Storage


class _Probe(Storage):
    """Only ``_retry`` is exercised; the I/O methods are never called."""

    _attempts = 4

    def write(self, path, parts):
        raise NotImplementedError

    read = exists = list_dir = remove = remove_tree = write


def _run(exc: BaseException, monkeypatch) -> tuple[int, BaseException]:
    monkeypatch.setattr("zerostate.store.storage.time.sleep", lambda s: None)
    calls = [0]

    def fail():
        calls[0] += 1
        raise exc

    with pytest.raises(Exception) as info:
        _Probe("memory://probe")._retry("reading", "x", fail)
    return calls[0], info.value


class ParamValidationError(Exception):
    """Stands in for botocore's class of the same name (matched by name)."""


class EndpointConnectionError(Exception):
    """Stands in for a botocore network error (matched by module)."""


EndpointConnectionError.__module__ = "botocore.exceptions"
ParamValidationError.__module__ = "botocore.exceptions"


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad"), KeyError("k"), RuntimeError("boom"), TypeError("t"),
     PermissionError(errno.EACCES, "denied"), OSError(errno.ENOSPC, "disk full"),
     ParamValidationError("Unknown parameter endpoint-url")],
    ids=["ValueError", "KeyError", "RuntimeError", "TypeError", "EACCES", "ENOSPC",
         "ParamValidationError"],
)  # fmt: skip
def test_permanent_errors_fail_at_once_with_their_cause(exc, monkeypatch):
    calls, raised = _run(exc, monkeypatch)
    assert calls == 1
    assert isinstance(raised, StorageError) and raised.__cause__ is exc
    assert type(exc).__name__ in str(raised)


@pytest.mark.parametrize(
    "exc",
    [ConnectionResetError("reset"), TimeoutError("slow"), OSError(errno.EIO, "io"),
     EndpointConnectionError("Could not connect")],
    ids=["reset", "timeout", "EIO", "botocore-network"],
)  # fmt: skip
def test_transient_errors_are_retried_then_reported(exc, monkeypatch):
    calls, raised = _run(exc, monkeypatch)
    assert calls == _Probe._attempts
    assert isinstance(raised, StorageError) and f"after {_Probe._attempts} attempts" in str(raised)


def test_failed_tree_removal_names_the_cause(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    sub = tmp_path / "step-00000001" / "sub"
    sub.mkdir(parents=True)
    (sub / "f").write_bytes(b"x")
    real_unlink = os.unlink

    def refuse(path, *args, **kwargs):
        # Tests run as root, which ignores permission bits: refuse the way EACCES would.
        if os.fspath(path).endswith("f"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(StorageError, match="Permission denied"):
        storage.remove_tree("step-00000001")


def test_removing_a_linked_step_removes_the_link_not_the_target(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"precious")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000001").symlink_to(outside)
    LocalStorage(str(root)).remove_tree("step-00000001")
    assert not (root / "step-00000001").exists()
    assert (outside / "keep").read_bytes() == b"precious"


def test_reads_and_writes_through_links_out_of_the_root_are_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000001").symlink_to(outside)
    storage = LocalStorage(str(root))
    with pytest.raises(UnsafeNameError):
        storage.read("step-00000001/secret")
    with pytest.raises(UnsafeNameError):
        storage.write("step-00000001/planted", [b"x"])
    assert not (outside / "planted").exists()
