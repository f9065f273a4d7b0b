"""The storage conformance suite (``zerostate.testing.StorageTests``) on every backend we
ship: local disk, ``memory://`` and a real S3 server; plus what only some backends do."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

import zerostate.store
from zerostate.store import storage as facade
from zerostate.store.fsspec_storage import FsspecStorage, S3Storage
from zerostate.store.local import LocalStorage
from zerostate.store.retry import RetryPolicy
from zerostate.testing import StorageTests


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path):
        return facade.open_storage(str(tmp_path / "root"))

    def test_flags(self, storage):
        assert isinstance(storage, LocalStorage)
        assert storage.has_directories and storage.needs_dir_sync and storage.supports_rename
        assert not storage.is_object_store and not storage.supports_multipart


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def storage(self):
        return facade.open_storage(f"memory://zs-{uuid.uuid4().hex}/root")

    def test_flags(self, storage):
        assert type(storage) is FsspecStorage and storage.supports_range_reads
        assert not storage.has_directories and not storage.is_object_store


@pytest.mark.s3
class TestS3Storage(StorageTests):
    @pytest.fixture
    def storage(self, s3_server):
        bucket, options = s3_server.new_bucket()
        return facade.open_storage(f"s3://{bucket}/run/root", options)

    def test_flags(self, storage):
        assert isinstance(storage, S3Storage)
        assert storage.is_object_store and storage.supports_multipart
        assert not storage.has_directories and not storage.needs_dir_sync
        assert storage.retry_policy.attempts == 3

    def test_direct_construction_is_s3_too(self, s3_server):
        bucket, options = s3_server.new_bucket()
        assert type(FsspecStorage(f"s3://{bucket}/x", options)) is S3Storage

    def test_exists_is_one_head(self, storage, monkeypatch):
        self.put(storage, "a/x", b"1")
        calls = []
        real = storage.fs.call_s3

        def spy(method, *args, **kwargs):
            calls.append(method)
            return real(method, *args, **kwargs)

        monkeypatch.setattr(storage.fs, "call_s3", spy)
        assert storage.exists("a/x") and not storage.exists("a/nope")
        assert calls == ["head_object", "head_object"]


def test_old_names_still_import_from_storage():
    for name in ("open_storage", "Storage", "LocalStorage", "FsspecStorage", "ByteRange",
                 "canonical_location", "location_contains", "locations_overlap",
                 "_is_transient", "_with_s3_defaults", "SINGLE_PUT_NBYTES"):  # fmt: skip
        assert hasattr(facade, name), name
    assert zerostate.store.Storage is facade.Storage


def test_retry_policy_backs_off_and_is_validated():
    assert RetryPolicy(attempts=4, first_delay_s=0.1, factor=4, max_delay_s=1.0).delays() == [
        0.1,
        0.4,
        1.0,
    ]
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="max_delay_s"):
        RetryPolicy(max_delay_s=-1)


def _store_imports() -> dict[str, set[str]]:
    """Module-level imports among ``zerostate.store`` modules. ``from pkg import mod``
    counts as an import of ``pkg.mod``; imports inside functions are deliberate late
    bindings and are left out."""
    root = Path(zerostate.store.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent.parent).with_suffix("")
        files[".".join(rel.parts).removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                deps.update(m for m in subs if m in files)
                if any(m not in files for m in subs):
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m: str, chain: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*chain, m, d]
            if d not in state and (found := visit(d, [*chain, m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


STORAGE_MODULES = {
    f"zerostate.store.{m}"
    for m in ("base", "retry", "local", "fsspec_storage", "s3", "location", "storage")
}


def test_no_import_cycle_in_the_store():
    graph = _store_imports()
    assert STORAGE_MODULES <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # The storage layer stands alone: it imports nothing else from the store.
    for module in STORAGE_MODULES:
        assert graph[module] <= STORAGE_MODULES, (module, graph[module] - STORAGE_MODULES)


def test_the_cycle_check_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
