"""One conformance suite for the store, run against local disk, memory:// and real S3.

A backend subclass only provides the ``ckpt`` fixture (a fresh root URL and its
storage_options); every behaviour test then runs against it.
"""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch
import zarr
from _store_helpers import (
    doc_snippet_read_tensor,
    make_specs,
    make_tensors,
    owned_shards,
    raw_bytes,
    write_step,
)

from zerostate.errors import (
    CheckpointNotFoundError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    DistributedMismatchError,
    FormatVersionError,
    StorageError,
    UnsafeNameError,
)
from zerostate.store import (
    FORMAT_VERSION,
    StepExistsError,
    StepWriter,
    delete_step,
    open_checkpoint,
    open_storage,
    remove_partial_steps,
)
from zerostate.store.format import COMMIT_PATH


class Root:
    def __init__(self, url: str, storage_options: dict | None) -> None:
        self.url, self.storage_options = url, storage_options

    def storage(self):
        return open_storage(self.url, self.storage_options)

    def open(self):
        return open_checkpoint(self.url, storage_options=self.storage_options)

    def write(self, step, tensors, **kw):
        return write_step(self.url, step, tensors, storage_options=self.storage_options, **kw)

    def writer(self, step, specs, rank, world_size=3, **kw):
        return StepWriter(
            self.url,
            step,
            rank=rank,
            world_size=world_size,
            specs=specs,
            storage_options=self.storage_options,
            **kw,
        )

    def rewrite(self, path: str, fn) -> None:
        storage = self.storage()
        storage.write(path, [fn(storage.read(path))])


def _commit_doc(record: dict) -> bytes:
    return json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {"zerostate_commit": record}}
    ).encode()


class StoreConformance:
    """Every storage backend must pass all of these."""

    @pytest.fixture
    def ckpt(self) -> Root:
        raise NotImplementedError

    # ------------------------------------------------------------- storage interface
    def test_storage_write_read_list_remove(self, ckpt):
        s = ckpt.storage()
        s.check_writable()
        if s.has_directories:
            s.makedirs(["a/b"])
        s.write("a/b/x", [b"hello ", memoryview(b"world"), bytearray(b"!")])
        s.write("a/y", [b"1"])
        s.sync_dirs()
        assert s.read("a/b/x") == b"hello world!"
        assert s.exists("a/b/x") and not s.exists("a/b/nope")
        assert s.list_dir("a") == ["b", "y"]
        assert s.list_dir("missing") == []
        s.write("a/y", [b"22"])  # overwrite replaces whole object
        assert s.read("a/y") == b"22"
        assert "y.partial" not in s.list_dir("a")
        with pytest.raises(FileNotFoundError):
            s.read("a/nope")
        s.remove("a/y")
        s.remove("a/y")  # absent is fine
        assert not s.exists("a/y")
        s.remove_tree("a")
        assert not s.exists("a/b/x") and s.list_dir("a") == []

    # ---------------------------------------------------------------- round trip
    def test_roundtrip_every_dtype(self, ckpt):
        tensors = make_tensors()
        specs = ckpt.write(7, tensors, attrs={"engine": {"stage": 2}, "client_state": [1, "x"]})
        reader = ckpt.open()
        assert reader.steps() == [7] and reader.latest_step() == 7
        st = reader.step()
        assert (st.step, st.world_size, st.format_version) == (7, 3, FORMAT_VERSION)
        assert st.attrs == {"engine": {"stage": 2}, "client_state": [1, "x"]}
        assert set(st.tensors) == set(tensors)
        for spec in specs:
            info = st.tensors[spec.name]
            assert (info.shape, info.dtype, info.layout) == (spec.shape, spec.dtype, spec.layout)
            assert info.nbytes == tensors[spec.name].numel() * spec.dtype.itemsize
            got = st.read(spec.name)
            assert got.dtype == spec.dtype and torch.equal(got, tensors[spec.name]), spec.name
        # really split: the big tensors have one chunk per rank, all in one row object each
        assert st.tensors["model/h.0.attn.weight"].layout.num_chunks == 3
        assert {g for g, _, _ in st.row_objects()} == {
            "model",
            "optim/exp_avg",
            "optim/exp_avg_sq",
            "buffers",
            "rng/rank-00001",
            "_top",
        }
        assert len(st.row_objects()) <= 6 * 3

    def test_read_range_crosses_chunks_and_fills_out(self, ckpt):
        tensors = make_tensors()
        ckpt.write(1, tensors)
        st = ckpt.open().step(1)
        flat = tensors["model/h.0.attn.weight"].reshape(-1)
        chunk = st.tensors["model/h.0.attn.weight"].layout.chunk_numel
        for start, stop in [(0, 1), (chunk - 3, chunk + 5), (1, flat.numel()), (40, 40)]:
            assert torch.equal(
                st.read_range("model/h.0.attn.weight", start, stop), flat[start:stop]
            )
        out = torch.full((10,), -1.0)
        got = st.read_range("model/h.0.attn.weight", chunk - 5, chunk + 5, out=out)
        assert got is out and torch.equal(out, flat[chunk - 5 : chunk + 5])
        with pytest.raises(ConfigError):
            st.read_range("model/h.0.attn.weight", 0, 10, out=torch.empty(10, dtype=torch.half))
        with pytest.raises(ConfigError):
            st.read_range("model/h.0.attn.weight", 5, flat.numel() + 1)
        with pytest.raises(KeyError, match="no tensor"):
            st.read("model/nope")

    def test_plain_zarr_reads_the_step(self, ckpt):
        tensors = make_tensors()
        ckpt.write(3, tensors)
        url = f"{ckpt.url}/step-00000003"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a foreign object in the hierarchy would warn
            group = zarr.open_group(url, mode="r", storage_options=ckpt.storage_options)
            members = dict(group.members(max_depth=None))
        assert isinstance(members["model"], zarr.Array) and members["model"].shape[0] == 3
        read_tensor = doc_snippet_read_tensor()
        for name, t in tensors.items():
            got = read_tensor(url, name, ckpt.storage_options)  # zarr checks every crc32c
            assert list(got.shape) == list(t.shape), name
            assert got.tobytes() == raw_bytes(t), name

    def test_verify_clean_reports_progress(self, ckpt):
        tensors = make_tensors()
        ckpt.write(2, tensors)
        seen = []
        ckpt.open().step(2).verify(progress=seen.append)
        assert sum(seen) == sum(t.numel() * t.element_size() for t in tensors.values())
        assert len(seen) == len(ckpt.open().step(2).row_objects())  # one call per row

    def test_incremental_writes_and_attrs_from_rank0(self, ckpt):
        tensors = make_tensors()
        specs = make_specs(tensors, 2)
        for rank in (1, 0):
            w = ckpt.writer(4, specs, rank, world_size=2, attrs={"rank": rank})
            shards = owned_shards(tensors, specs, rank)
            for name, shard in shards.items():  # one tensor per call
                w.write({name: shard})
            w.commit(wait=False)
        st = ckpt.open().step(4)
        assert st.attrs == {"rank": 0}
        assert all(torch.equal(st.read(n), t) for n, t in tensors.items())

    def test_large_row_is_streamed(self, ckpt, monkeypatch):
        import fsspec

        from zerostate.store import fsspec_storage, s3

        monkeypatch.setattr(fsspec_storage, "STREAM_THRESHOLD", 6 << 20)
        monkeypatch.setattr(fsspec_storage, "STREAM_BLOCK", 5 << 20)  # S3's smallest part size
        monkeypatch.setattr(s3, "MULTIPART_PART_NBYTES", 5 << 20)
        monkeypatch.setattr(s3, "SINGLE_PUT_NBYTES", 5 << 20)
        streamed, parts = [], []
        original = fsspec.spec.AbstractFileSystem.open

        def spy(self, path, mode="rb", *args, **kwargs):
            if "w" in mode and kwargs.get("block_size") == 5 << 20:  # the streaming path
                streamed.append(path.rsplit("/", 4)[-4:])
            return original(self, path, mode, *args, **kwargs)

        monkeypatch.setattr(fsspec.spec.AbstractFileSystem, "open", spy)
        multipart = fsspec_storage.S3Storage._parallel_multipart

        def spy_multipart(self, target, make_parts):
            def counted():
                for part in make_parts():
                    parts.append(len(part))
                    yield part

            streamed.append(target.rsplit("/", 4)[-4:])
            return multipart(self, target, counted)

        monkeypatch.setattr(fsspec_storage.S3Storage, "_parallel_multipart", spy_multipart)
        big = {"model/big": torch.arange(3_000_001, dtype=torch.float32)}
        ckpt.write(1, big, world_size=1)
        st = ckpt.open().step(1)
        [(group, rank, nbytes)] = st.row_objects()
        assert (group, rank) == ("model", 0) and nbytes > 3_000_001 * 4
        assert torch.equal(st.read("model/big"), big["model/big"])
        st.verify()
        local = ckpt.storage().has_directories
        assert streamed == ([] if local else [["model", "c", "0", "0"]])
        if parts:  # S3: many small pieces, never the row joined into one buffer
            assert sum(parts) == nbytes and max(parts) < nbytes // 2

    # ---------------------------------------------------------------- validation
    def test_shards_validated_before_any_byte(self, ckpt):
        tensors = make_tensors()
        specs = make_specs(tensors, 3)
        shards = owned_shards(tensors, specs, 0)
        name = next(iter(shards))
        bad_cases = [
            {**shards, name: shards[name].double()},
            {**shards, name: shards[name][:-1]},
            {**shards, name: shards[name].reshape(1, -1)},
            {**shards, "model/unknown": shards[name]},
        ]
        for bad in bad_cases:
            with pytest.raises(ConfigError):
                ckpt.writer(5, specs, 0).write(bad)
        assert ckpt.storage().list_dir("") == []

    @pytest.mark.parametrize(
        "name",
        [
            "../x",
            "/abs",
            "a//b",
            "a/./b",
            "a b",
            "_zerostate/x",
            "a/zarr.json",
            "a/b.partial",
            "",
            "a/",
        ],
    )
    def test_unsafe_names_rejected_when_writing(self, ckpt, name):
        with pytest.raises(UnsafeNameError):
            make_specs({name: torch.zeros(3)}, 1)

    def test_step_already_committed_is_refused(self, ckpt):
        tensors = make_tensors()
        specs = ckpt.write(1, tensors)
        with pytest.raises(StepExistsError):
            ckpt.writer(1, specs, 0).write(owned_shards(tensors, specs, 0))

    def test_ranks_with_different_specs(self, ckpt):
        tensors = make_tensors()
        specs = make_specs(tensors, 2)
        other = make_specs({**tensors, "model/tiny": torch.zeros(2, dtype=torch.float64)}, 2)
        w1 = ckpt.writer(1, other, 1, world_size=2)
        w1.write(
            owned_shards({**tensors, "model/tiny": torch.zeros(2, dtype=torch.float64)}, other, 1)
        )
        w1.commit(wait=False)
        w0 = ckpt.writer(1, specs, 0, world_size=2, timeout_s=5)
        w0.write(owned_shards(tensors, specs, 0))
        with pytest.raises(DistributedMismatchError):
            w0.commit()

    # ----------------------------------------------------------- commit & crashes
    def test_commit_times_out_without_every_manifest(self, ckpt):
        tensors = make_tensors()
        specs = make_specs(tensors, 3)
        w0 = ckpt.writer(9, specs, 0, timeout_s=0.5)
        w0.write(owned_shards(tensors, specs, 0))
        with pytest.raises(CommitTimeoutError, match=r"\[1, 2\]"):
            w0.commit()
        w1 = ckpt.writer(9, specs, 1, timeout_s=0.3)
        w1.write(owned_shards(tensors, specs, 1))
        with pytest.raises(CommitTimeoutError):
            w1.commit(wait=True)
        assert ckpt.open().steps() == []

    def test_partial_step_invisible_and_removable(self, ckpt):
        tensors = make_tensors()
        ckpt.write(1, tensors)
        specs = make_specs(tensors, 3)
        for rank in (1, 2):  # rank 0 never commits: a crash before the commit record
            ckpt.writer(2, specs, rank).write(owned_shards(tensors, specs, rank))
        reader = ckpt.open()
        assert reader.steps() == [1] and reader.latest_step() == 1
        with pytest.raises(CheckpointNotFoundError, match="not committed"):
            reader.step(2)
        assert remove_partial_steps(ckpt.url, ckpt.storage_options) == [2]
        assert ckpt.storage().list_dir("") == ["step-00000001"]
        assert torch.equal(reader.step().read("model/wte"), tensors["model/wte"])

    def test_delete_step(self, ckpt):
        tensors = make_tensors()
        ckpt.write(1, tensors)
        ckpt.write(2, tensors)
        delete_step(ckpt.url, 2, storage_options=ckpt.storage_options)
        assert ckpt.open().steps() == [1]
        assert ckpt.storage().list_dir("") == ["step-00000001"]
        with pytest.raises(CheckpointNotFoundError):
            delete_step(ckpt.url, 2, storage_options=ckpt.storage_options)

    def test_empty_root(self, ckpt):
        reader = ckpt.open()
        assert reader.steps() == []
        with pytest.raises(CheckpointNotFoundError):
            reader.latest_step()
        with pytest.raises(CheckpointNotFoundError):
            reader.step()

    # ------------------------------------------------------------------ damage
    def _damaged(self, ckpt, fn, name="model/h.0.attn.weight", element=None):
        """Write step 1, damage the row object holding ``element`` of ``name`` (default:
        the first element of its second chunk, so on rank 1) and open the step."""
        tensors = make_tensors()
        ckpt.write(1, tensors)
        st = ckpt.open().step(1)
        layout = st.tensors[name].layout
        path, offset = st.locate(name, layout.chunk_numel if element is None else element)
        fn(ckpt, path, offset)
        return ckpt.open().step(1)

    def test_flipped_byte_names_tensor_and_row(self, ckpt):
        def flip(ckpt, path, at):
            ckpt.rewrite(path, lambda b: b[:at] + bytes([b[at] ^ 0x10]) + b[at + 1 :])

        st = self._damaged(ckpt, flip)
        pattern = r"'model/h.0.attn.weight'.*rank 1's row of group 'model'.*checksum"
        with pytest.raises(CorruptCheckpointError, match=pattern):
            st.verify()
        with pytest.raises(CorruptCheckpointError, match=pattern):
            st.read("model/h.0.attn.weight")
        # undamaged rows and tensors still read
        chunk = st.tensors["model/h.0.attn.weight"].layout.chunk_numel
        st.read_range("model/h.0.attn.weight", 0, chunk)
        st.read("optim/exp_avg/h.0.attn.weight")

    def test_missing_row(self, ckpt):
        st = self._damaged(ckpt, lambda c, p, _: c.storage().remove(p))
        with pytest.raises(CorruptCheckpointError, match="rank 1's row .* is missing"):
            st.read("model/h.0.attn.weight")
        with pytest.raises(CorruptCheckpointError, match="'model/h.0.attn.weight'.*missing"):
            st.verify()

    def test_truncated_row(self, ckpt):
        st = self._damaged(ckpt, lambda c, p, at: c.rewrite(p, lambda b: b[: at + 3]))
        with pytest.raises(CorruptCheckpointError, match="rank 1's row .* ends early"):
            st.read("model/h.0.attn.weight")
        with pytest.raises(CorruptCheckpointError, match="cut short|shard index"):
            st.verify()

    def test_damaged_index_found_by_verify(self, ckpt):
        st = self._damaged(ckpt, lambda c, p, _: c.rewrite(p, lambda b: b[:-9] + bytes(9)))
        st.read("model/h.0.attn.weight")  # reads need no index
        with pytest.raises(CorruptCheckpointError, match="rank 1's row .*shard index"):
            st.verify()

    def test_verify_lists_every_problem(self, ckpt):
        def two(ckpt, path, _):
            ckpt.storage().remove(path)
            ckpt.storage().remove(path.replace("/model/", "/optim/exp_avg/"))

        st = self._damaged(ckpt, two)
        with pytest.raises(CorruptCheckpointError, match="2 problem") as info:
            st.verify()
        assert "'optim/exp_avg/h.0.attn.weight'" in str(info.value)

    @pytest.mark.parametrize(
        "garbage",
        [b"", b'{"zarr_format": 3, "attrib', b"\xff\xfe", b"[1, 2]", b'{"attributes": {}}'],
    )
    def test_garbage_commit_record(self, ckpt, garbage):
        ckpt.write(1, make_tensors())
        ckpt.storage().write(f"step-00000001/{COMMIT_PATH}", [garbage])
        with pytest.raises(CorruptCheckpointError):
            ckpt.open().step(1)

    def _edit_record(self, ckpt, fn):
        ckpt.write(1, make_tensors())
        path = f"step-00000001/{COMMIT_PATH}"
        record = json.loads(ckpt.storage().read(path))["attributes"]["zerostate_commit"]
        fn(record)
        ckpt.storage().write(path, [_commit_doc(record)])

    def test_unknown_format_version(self, ckpt):
        def bump(record):
            record["format_version"] = 4  # 3 is the mesh format ([Note: mesh tensors])
            record["tensors"] = "whatever a future version stores"

        self._edit_record(ckpt, bump)
        with pytest.raises(FormatVersionError, match="version 4"):
            ckpt.open().step(1)

    @pytest.mark.parametrize(
        "bad", ["../../etc/passwd", "/etc/passwd", "model/../../x", "model\\..\\x"]
    )
    def test_unsafe_tensor_name_in_commit_record(self, ckpt, bad):
        def rename(record):
            record["tensors"][bad] = record["tensors"].pop("model/wte")

        self._edit_record(ckpt, rename)
        with pytest.raises(UnsafeNameError):
            ckpt.open().step(1)

    def test_unsafe_metadata_path_in_commit_record(self, ckpt):
        self._edit_record(
            ckpt, lambda r: r["files"].update({"../zarr.json": r["files"]["zarr.json"]})
        )
        with pytest.raises(UnsafeNameError):
            ckpt.open().step(1)

    def test_inconsistent_commit_record(self, ckpt):
        def lie(record):
            record["tensors"]["model/wte"]["shape"] = [999]

        self._edit_record(ckpt, lie)
        with pytest.raises(CorruptCheckpointError, match="model/wte"):
            ckpt.open().step(1)


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def ckpt(self, tmp_path) -> Root:
        return Root(str(tmp_path / "ckpt"), None)

    def test_no_partial_files_left(self, ckpt, tmp_path):
        ckpt.write(1, make_tensors())
        leftovers = [p for p in (tmp_path / "ckpt").rglob("*") if p.name.endswith(".partial")]
        assert leftovers == []

    def test_unwritable_root(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        tensors = make_tensors()
        specs = make_specs(tensors, 1)
        w = StepWriter(str(blocker / "ckpt"), 1, rank=0, world_size=1, specs=specs)
        with pytest.raises(StorageError, match="cannot create"):
            w.write(owned_shards(tensors, specs, 0))


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def ckpt(self) -> Root:
        return Root(f"memory://zs-{uuid.uuid4().hex}/ckpt", None)


@pytest.mark.s3
class TestS3Store(StoreConformance):
    @pytest.fixture
    def ckpt(self, s3_server) -> Root:
        bucket, options = s3_server.new_bucket()
        return Root(f"s3://{bucket}/run/ckpt", options)

    def test_missing_bucket_is_a_clear_error(self, s3_server):
        tensors = make_tensors()
        specs = make_specs(tensors, 1)
        w = StepWriter(
            "s3://zs-no-such-bucket/ckpt",
            1,
            rank=0,
            world_size=1,
            specs=specs,
            storage_options=s3_server.storage_options,
        )
        with pytest.raises(StorageError, match="zs-no-such-bucket.*does not exist"):
            w.write(owned_shards(tensors, specs, 0))
