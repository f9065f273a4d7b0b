"""Callers branch on storage capability flags, not on backend classes: a backend whose
listings lag behind its writes (``listing_is_consistent = False``) still commits."""

from __future__ import annotations

import threading

import pytest
import torch
from _store_helpers import make_specs, make_tensors, owned_shards

from zerostate.errors import CommitTimeoutError
from zerostate.store import StepWriter, open_checkpoint
from zerostate.store import writer as writer_module
from zerostate.store.local import LocalStorage


class _LaggingListing(LocalStorage):
    """Local disk whose listings never show a step's bookkeeping (manifests, commit
    record), as an eventually consistent store's listing can lag behind its writes."""

    def list_dir(self, path: str) -> list[str]:
        if "_zerostate" in path.split("/"):
            return []
        return [n for n in super().list_dir(path) if n != "_zerostate"]


class _SaysSo(_LaggingListing):
    listing_is_consistent = False


def _writers(root, monkeypatch, storage_cls, timeout_s):
    monkeypatch.setattr(writer_module, "open_storage", lambda r, so=None: storage_cls(r))
    tensors = make_tensors()
    specs = make_specs(tensors, 2)
    writers = [
        StepWriter(root, 1, rank=r, world_size=2, specs=specs, timeout_s=timeout_s) for r in (0, 1)
    ]
    for rank, w in enumerate(writers):
        w.write(owned_shards(tensors, specs, rank))
    return tensors, writers


def test_commit_without_consistent_listings_reads_instead(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    tensors, (w0, w1) = _writers(root, monkeypatch, _SaysSo, timeout_s=60)
    waited: list[BaseException | None] = []

    def rank1() -> None:
        try:
            w1.commit(wait=True)  # polls for the commit record without listing it
            waited.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            waited.append(exc)

    t = threading.Thread(target=rank1)
    t.start()
    w0.commit()
    t.join(60)
    assert waited == [None]
    st = open_checkpoint(root).step(1)
    assert all(torch.equal(st.read(n), v) for n, v in tensors.items())


def test_the_flag_is_what_makes_the_difference(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    _, (w0, w1) = _writers(root, monkeypatch, _LaggingListing, timeout_s=1.0)
    w1.commit(wait=False)
    with pytest.raises(CommitTimeoutError, match="lacks the manifests"):
        w0.commit()  # trusts the (lagging) listing: never sees the manifests
    assert open_checkpoint(root).steps() == []
