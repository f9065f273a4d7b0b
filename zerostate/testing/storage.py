"""``StorageTests``: the conformance suite every storage backend passes.

Subclass it in a pytest module and define the ``storage`` fixture returning a fresh, empty
:class:`~zerostate.store.storage.Storage`; every test then runs against that backend.
zerostate runs it on local disk, ``memory://`` and a real S3 server (SeaweedFS), see
``tests/store/test_storage_conformance.py``::

    class TestMyBackend(StorageTests):
        @pytest.fixture
        def storage(self):
            return MyStorage("mine://bucket/root")
"""

from __future__ import annotations

import pytest

from zerostate.errors import ConfigError
from zerostate.store.base import ByteRange, Storage

#: Every capability flag (see [Note: storage capabilities] in ``zerostate/store/base.py``).
FLAGS = (
    "has_directories",
    "needs_dir_sync",
    "supports_rename",
    "supports_range_reads",
    "supports_multipart",
    "listing_is_consistent",
    "is_object_store",
    "reads_ahead",
    "reads_locally",
)

_DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, every byte value


class StorageTests:
    """Conformance tests of the :class:`Storage` interface."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("define a `storage` fixture returning a fresh Storage")

    @staticmethod
    def put(storage: Storage, path: str, data: bytes | list[bytes]) -> None:
        """Write ``data`` at ``path`` the way the writer does (directories first)."""
        if storage.has_directories and "/" in path:
            storage.makedirs([path.rsplit("/", 1)[0]])
        storage.write(path, data if isinstance(data, list) else [data])
        storage.sync_dirs()

    # ------------------------------------------------------------ capability flags
    def test_capability_flags_are_booleans_and_consistent(self, storage):
        caps = storage.capabilities()
        assert set(caps) == set(FLAGS)
        for name in FLAGS:
            assert isinstance(getattr(storage, name), bool), name
            assert caps[name] is getattr(storage, name)
        # Directory fsyncs only exist where directories do; buckets have none.
        assert not storage.needs_dir_sync or storage.has_directories
        assert not (storage.is_object_store and storage.has_directories)
        # A bucket's objects are fetched over the network, never from this host's files.
        assert not (storage.is_object_store and storage.reads_locally)

    def test_without_directories_makedirs_and_sync_are_no_ops(self, storage):
        storage.check_writable()
        storage.makedirs(["d/e"])
        storage.sync_dirs()
        if not storage.has_directories:
            assert storage.list_dir("d") == []  # nothing was created

    def test_overwrite_replaces_the_object_and_leaves_no_temporary(self, storage):
        storage.check_writable()
        self.put(storage, "a/x", b"1")
        self.put(storage, "a/x", b"22")
        assert storage.list_dir("a") == ["x"]
        assert storage.read("a/x") == b"22"

    # --------------------------------------------------------------- objects
    def test_write_read_list_remove(self, storage):
        storage.check_writable()
        storage.check_readable()
        self.put(storage, "a/b/x", [b"hello ", memoryview(b"world"), bytearray(b"!")])
        self.put(storage, "a/y", b"1")
        assert storage.read("a/b/x") == b"hello world!"
        assert storage.exists("a/b/x") and not storage.exists("a/b/nope")
        assert storage.list_dir("a") == ["b", "y"]
        assert storage.list_dir("missing") == []
        with pytest.raises(FileNotFoundError):
            storage.read("a/nope")
        storage.remove("a/y")
        storage.remove("a/y")  # absent is fine
        assert not storage.exists("a/y")
        storage.remove_tree("a")
        storage.remove_tree("a")  # absent is fine
        assert not storage.exists("a/b/x") and storage.list_dir("a") == []
        assert storage.list_dir("") == []

    def test_exists_many_keeps_order(self, storage):
        storage.check_writable()
        for name in ("s/1", "s/3", "s/4"):
            self.put(storage, name, b"x")
        paths = [f"s/{i}" for i in range(6)]
        assert storage.exists_many(paths) == [False, True, False, True, True, False]
        assert storage.exists_many([]) == []

    def test_size(self, storage):
        storage.check_writable()
        self.put(storage, "z/obj", _DATA)
        self.put(storage, "z/one", b"1")
        self.put(storage, "z/sub/empty", [])
        assert storage.size("z/obj") == len(_DATA) and storage.size("z/one") == 1
        assert storage.size("z/sub/empty") == 0
        with pytest.raises(FileNotFoundError):
            storage.size("z/nope")
        assert Storage.size(storage, "z/obj") == len(_DATA)  # the probing default agrees
        with pytest.raises(FileNotFoundError):
            Storage.size(storage, "z/nope")

    def test_empty_object(self, storage):
        storage.check_writable()
        self.put(storage, "e/empty", [])
        assert storage.exists("e/empty") and storage.read("e/empty") == b""
        assert storage.read_range_into("e/empty", 0, [memoryview(bytearray(4))]) == 0

    def test_write_stream_consumes_a_generator(self, storage):
        storage.check_writable()
        pieces = [_DATA[i : i + 1000] for i in range(0, len(_DATA), 1000)]
        storage.makedirs(["g"])
        storage.write_stream("g/obj", lambda: iter(pieces), len(_DATA))
        storage.sync_dirs()
        assert storage.read("g/obj") == _DATA

    def test_read_into_exact_size_only(self, storage):
        storage.check_writable()
        self.put(storage, "r/obj", _DATA)
        a, b = bytearray(100), bytearray(len(_DATA) - 100)
        assert storage.read_into("r/obj", [memoryview(a), memoryview(b)]) == len(_DATA)
        assert bytes(a + b) == _DATA
        short = bytearray(10)
        assert storage.read_into("r/obj", [memoryview(short)]) == len(_DATA)  # size, unfilled
        assert short == bytearray(10)
        with pytest.raises(FileNotFoundError):
            storage.read_into("r/nope", [memoryview(bytearray(1))])

    # ----------------------------------------------------------- byte ranges
    @pytest.mark.parametrize(
        "start, stop",
        [(0, 1), (0, 256), (255, 257), (1000, 5000), (len(_DATA) - 4, len(_DATA)), (7, 7)],
    )
    def test_byte_ranges(self, storage, start, stop):
        storage.check_writable()
        self.put(storage, "r/obj", _DATA)
        assert storage.read("r/obj", ByteRange(start, stop)) == _DATA[start:stop]
        parts = [bytearray((stop - start) // 3), bytearray(stop - start - (stop - start) // 3)]
        got = storage.read_range_into("r/obj", start, [memoryview(p) for p in parts])
        assert got == stop - start and bytes(parts[0] + parts[1]) == _DATA[start:stop]

    def test_byte_ranges_past_the_end_are_short(self, storage):
        storage.check_writable()
        self.put(storage, "r/obj", _DATA)
        n = len(_DATA)
        assert storage.read("r/obj", ByteRange(n - 3, n + 10)) == _DATA[-3:]
        assert storage.read("r/obj", ByteRange(n + 5, n + 10)) == b""
        assert storage.read("r/obj", ByteRange(n - 3)) == _DATA[-3:]  # open-ended
        buf = bytearray(10)
        assert storage.read_range_into("r/obj", n - 4, [memoryview(buf)]) == 4
        assert bytes(buf[:4]) == _DATA[-4:]
        assert storage.read_range_into("r/obj", n + 1, [memoryview(buf)]) == 0
        with pytest.raises(FileNotFoundError):
            storage.read("r/nope", ByteRange(0, 4))
        with pytest.raises(FileNotFoundError):
            storage.read_range_into("r/nope", 0, [memoryview(bytearray(4))])

    def test_open_ranges_reads_several_ranges_of_one_object(self, storage):
        storage.check_writable()
        self.put(storage, "r/obj", _DATA)
        n = len(_DATA)
        with storage.open_ranges("r/obj") as handle:
            for start, stop in [(0, 10), (10, 300), (5000, 5001), (n - 4, n + 6), (2, 3)]:
                buf = bytearray(stop - start)
                got = handle.read_into(start, [memoryview(buf)[:1], memoryview(buf)[1:]])
                assert got == min(stop, n) - start
                assert bytes(buf[:got]) == _DATA[start:stop]
        with storage.open_ranges("r/nope") as handle, pytest.raises(FileNotFoundError):
            handle.read_into(0, [memoryview(bytearray(4))])

    def test_byte_range_is_validated(self, storage):
        for bad in [(-1, 4), (5, 4), (1.5, 3), (True, 3), (0, "9")]:
            with pytest.raises(ConfigError):
                ByteRange(*bad)
        assert ByteRange(3, 10).nbytes == 7 and ByteRange(3).nbytes is None

    # ---------------------------------------------------------------- identity
    def test_url_and_location(self, storage):
        assert storage.url_of("") == storage.url
        assert storage.url_of("a/b") == f"{storage.url}/a/b"
        assert "://" in storage.location and not storage.location.endswith("/")
