"""Tensor references between steps (docs/format.md, section 5.1), at the store level: one
process plays every rank. Reads, plain zarr, verify and retention follow references; a
commit record whose references break the rules is refused naming the tensors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _store_helpers import doc_snippet_read_tensor  # noqa: E402

from zerostate.errors import CheckpointError, ConfigError, CorruptCheckpointError  # noqa: E402
from zerostate.store import (  # noqa: E402
    StepWriter,
    delete_step,
    open_checkpoint,
    owned_shards,
    plan_specs,
    prune_steps,
    remove_partial_steps,
)
from zerostate.store import format as fmt  # noqa: E402
from zerostate.store.refs import TensorRef  # noqa: E402

WS = 3


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model/base.w": torch.full((37, 5), 7.0) + torch.arange(185.0).reshape(37, 5),
        "model/base.b": torch.arange(11, dtype=torch.float32),
        "model/lora.A": torch.randn(3, 5, generator=g),
        "optim/exp_avg/lora.A": torch.randn(3, 5, generator=g),
    }


def _save(root, step, tensors, holder=None, refer=("model/base.w", "model/base.b")):
    specs = plan_specs(tensors, WS)
    refs = [TensorRef(s, holder) for s in specs if holder is not None and s.name in refer]
    stored = [s for s in specs if holder is None or s.name not in refer]
    for rank in [*range(1, WS), 0]:
        writer = StepWriter(root, step, rank=rank, world_size=WS, specs=stored, refs=refs)
        writer.write(owned_shards(tensors, stored, rank))
        writer.commit(wait=False)


def _commit_path(root, step) -> Path:
    return Path(root) / fmt.step_dir(step) / fmt.COMMIT_PATH


def _edit_record(root, step, edit) -> None:
    path = _commit_path(root, step)
    doc = json.loads(path.read_text())
    edit(doc["attributes"]["zerostate_commit"])
    path.write_text(json.dumps(doc))


@pytest.fixture
def root(tmp_path):
    root = str(tmp_path / "ckpt")
    _save(root, 1, _tensors(1))
    _save(root, 2, _tensors(2), holder=1)
    _save(root, 3, _tensors(3), holder=1)
    return root


def test_reads_follow_references(root):
    st = open_checkpoint(root).step(3)
    assert st.refs == {"model/base.w": 1, "model/base.b": 1}
    want = _tensors(3)
    for name, value in want.items():
        assert torch.equal(st.read(name).reshape(value.shape), value), name
    got = st.read_many([("model/base.w", 5, 100, None), ("model/lora.A", 0, 15, None)])
    assert torch.equal(got[0], want["model/base.w"].reshape(-1)[5:100])
    assert torch.equal(got[1], want["model/lora.A"].reshape(-1))
    st.verify()
    own = sum(n for _, _, n in st.row_objects())
    full = sum(n for _, _, n in open_checkpoint(root).step(1).row_objects())
    base = sum(want[n].numel() * 4 for n in st.refs)
    assert full - own >= base  # the base is not in the referring step's rows


def test_plain_zarr_recipe_follows_the_reference(root):
    read_tensor = doc_snippet_read_tensor()
    record = json.loads(_commit_path(root, 3).read_text())["attributes"]["zerostate_commit"]
    holder = record["refs"]["model/base.w"]["step"]
    got = read_tensor(f"{root}/{fmt.step_dir(holder)}", "model/base.w")
    assert torch.equal(torch.from_numpy(got.copy()), _tensors(3)["model/base.w"])


def test_retention_keeps_holders(root):
    deleted, _ = prune_steps(root, keep_last=1, partial_below=None)
    assert deleted == [2] and open_checkpoint(root).steps() == [1, 3]
    with pytest.raises(CheckpointError, match=r"steps \[3\] refer"):
        delete_step(root, 1)
    # A partial step a committed one refers to (only damage makes one) is not removed.
    _commit_path(root, 1).rename(_commit_path(root, 1).with_suffix(".moved"))
    assert remove_partial_steps(root) == []
    _commit_path(root, 1).with_suffix(".moved").rename(_commit_path(root, 1))
    delete_step(root, 3)
    delete_step(root, 1)  # nothing refers to it any more
    assert open_checkpoint(root).steps() == []


def test_damaged_holder_named_by_verify(root):
    st = open_checkpoint(root).step(3)
    path, offset = st.locate("model/base.w", 0)
    target = Path(root) / path
    data = bytearray(target.read_bytes())
    data[offset] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="held by step 1.*base.w"):
        open_checkpoint(root).step(3).verify()
    with pytest.raises(CorruptCheckpointError, match="base.w"):
        open_checkpoint(root).step(3).read("model/base.w")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r["refs"]["model/base.w"].update(step=3), "not older"),
        (lambda r: r["refs"]["model/base.w"].update(step=0), "cannot be opened"),
        (lambda r: r["refs"]["model/base.w"].update(shape=[5, 37]), "layout|shape"),
        (lambda r: r["refs"].update({"model/../x": r["refs"]["model/base.b"]}), "name"),
        (lambda r: r.update(refs=[1]), "refs must be an object"),
    ],
)
def test_bad_references_are_refused(root, edit, match):
    _edit_record(root, 3, edit)
    with pytest.raises((CorruptCheckpointError, ConfigError, ValueError), match=match):
        open_checkpoint(root).step(3)


def test_a_reference_to_a_reference_is_refused(root):
    _edit_record(root, 3, lambda r: r["refs"]["model/base.w"].update(step=2))
    with pytest.raises(CorruptCheckpointError, match="does not store it itself"):
        open_checkpoint(root).step(3)


def test_writer_refuses_a_reference_to_a_newer_step(tmp_path):
    specs = plan_specs(_tensors(1), WS)
    with pytest.raises(ConfigError, match="older step"):
        StepWriter(str(tmp_path), 2, rank=0, world_size=WS, specs=specs[1:],
                   refs=[TensorRef(specs[0], 2)])  # fmt: skip


def test_reshard_and_consolidate_follow_references(root, tmp_path):
    from safetensors.torch import load_file

    from zerostate.store.consolidate import consolidate
    from zerostate.store.reshard import reshard

    out = str(tmp_path / "resharded")
    reshard(root, out, world_size=2)
    st = open_checkpoint(out).step()
    assert st.step == 3 and st.world_size == 2 and st.refs == {}  # written in full
    st.verify()
    for name, value in _tensors(3).items():
        assert torch.equal(st.read(name).reshape(value.shape), value), name
    consolidate(root, tmp_path / "a.safetensors")
    got = load_file(str(tmp_path / "a.safetensors"))
    assert torch.equal(got["base.w"], _tensors(3)["model/base.w"])
