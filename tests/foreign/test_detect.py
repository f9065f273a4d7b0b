"""Choosing the reader costs one listing of the root: opening a zerostate root on an object
store pays one LIST for the peers' checks, not a HEAD of ``.metadata`` and a LIST per peer."""

from __future__ import annotations

import pytest
import torch

from zerostate.store import sources
from zerostate.store.foreign.detect import detect
from zerostate.store.local import LocalStorage
from zerostate.store.root import CheckpointRoot
from zerostate.store.tensors import save_tensors


class _Counting(LocalStorage):
    """Local disk that records each metadata call (listings, existence and size checks)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def list_dir(self, path: str) -> list[str]:
        self.calls.append(("list", path))
        return super().list_dir(path)

    def exists(self, path: str) -> bool:
        self.calls.append(("exists", path))
        return super().exists(path)

    def size(self, path: str) -> int:
        self.calls.append(("size", path))
        return super().size(path)


class _Lagging(_Counting):
    """A listing that does not show the root's files yet (an eventually consistent store)."""

    listing_is_consistent = False

    def list_dir(self, path: str) -> list[str]:
        super().list_dir(path)
        return []


@pytest.fixture
def opened(monkeypatch):
    """``open_source`` on a counting storage; the storage it used."""
    used: list[_Counting] = []

    def open_storage(root, storage_options=None):
        used.append(_Counting(root))
        return used[-1]

    monkeypatch.setattr(sources, "open_storage", open_storage)
    return used


def test_opening_a_zerostate_root_lists_it_once_to_detect(tmp_path, opened):
    root = str(tmp_path / "ckpt")
    save_tensors(root, 3, {"model/w": torch.arange(6.0)})
    ckpt = sources.open_source(root)
    assert isinstance(ckpt, CheckpointRoot)
    (storage,) = opened
    assert storage.calls == [("list", "")]  # no HEAD of .metadata, no second listing
    st = ckpt.step()
    assert torch.equal(st.read("model/w"), torch.arange(6.0))
    # The reader's own scan is the only other listing of the root.
    assert [c for c in storage.calls if c == ("list", "")] == [("list", ""), ("list", "")]
    assert ("exists", ".metadata") not in storage.calls


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_root_is_found_in_the_same_listing(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(root))
    storage = _Counting(str(root))
    assert detect(storage) == "dcp"
    assert storage.calls == [("list", "")]
    assert sources.open_source(str(root)).step().read("model/w").tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (["model-00001-of-00001.safetensors"], "dcp"),
        (["shard-00001-model-00001-of-00001.safetensors"], "dcp"),
        (["latest", "global_step2"], "deepspeed"),
        (["global_step7"], "deepspeed"),
        (["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"], "deepspeed"),
        (["step-00000003", "model-1-of-1.safetensors", "latest.txt"], None),
    ],
)
def test_each_kind_from_one_listing(tmp_path, names, kind):
    for name in names:
        (tmp_path / name).write_bytes(b"")
    storage = _Counting(str(tmp_path))
    assert detect(storage) == kind
    assert storage.calls == [("list", "")]


def test_a_lagging_listing_still_finds_the_metadata(tmp_path):
    """Where listings may lag behind writes, a ``.metadata`` the listing does not show yet
    is asked for directly (one HEAD, only on such stores)."""
    (tmp_path / ".metadata").write_bytes(b"")
    storage = _Lagging(str(tmp_path))
    assert detect(storage) == "dcp"
    assert storage.calls == [("list", ""), ("exists", ".metadata")]
    (tmp_path / ".metadata").unlink()
    storage.calls.clear()
    assert detect(storage) is None


@pytest.fixture
def s3_requests(monkeypatch):
    """The S3 requests s3fs makes (method names), recorded while ``recording`` holds."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    made: list[str] = []
    original = s3fs.S3FileSystem._call_s3

    async def recorded(self, method, *args, **kwargs):
        made.append(getattr(method, "__name__", str(method)))
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recorded)
    # s3fs binds its sync ``call_s3`` to the original coroutine (see tests/faults/_crash.py).
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(recorded))
    return made


@pytest.mark.s3
def test_opening_a_zerostate_root_on_s3_costs_one_list(s3_server, s3_requests):
    bucket, options = s3_server.new_bucket("detect")
    url = f"s3://{bucket}/ckpt"
    save_tensors(url, 1, {"model/w": torch.arange(4.0)}, storage_options=options)
    s3_requests.clear()
    ckpt = sources.open_source(url, options)
    assert isinstance(ckpt, CheckpointRoot)
    # One listing of the root; no HEAD of .metadata, no second LIST for DeepSpeed.
    assert s3_requests == ["list_objects_v2"], s3_requests
    assert torch.equal(ckpt.step().read("model/w"), torch.arange(4.0))
