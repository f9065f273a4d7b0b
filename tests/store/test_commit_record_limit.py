"""A commit record a reader would refuse (larger than its limit) or that cannot be encoded
(attrs JSON cannot hold) is refused at save time, before anything is committed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerostate.dcp import StorageReader, StorageWriter
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import StepWriter, open_checkpoint, plan_specs, save_tensors
from zerostate.store import format as fmt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(n: int) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.full((3, 5), float(i)) for i in range(n)}


def test_a_commit_record_over_the_readers_limit_is_refused_and_nothing_committed(
    tmp_path, monkeypatch
):
    root = str(tmp_path / "ckpt")
    dcp.save(_state(4), storage_writer=StorageWriter(root), no_dist=True)  # step 0: fits
    size = len((tmp_path / "ckpt" / fmt.step_dir(0) / fmt.COMMIT_PATH).read_bytes())
    # A limit between the small step's record and a step of 40 tensors: the larger save
    # must fail before committing, and the step before it stay as it was.
    monkeypatch.setattr(fmt, "MAX_DOCUMENT_NBYTES", size * 3)
    # DCP hands the coordinator's error to every rank inside its CheckpointException.
    with pytest.raises(CheckpointException, match=r"commit record would be \d+ bytes, over the"):
        dcp.save(_state(40), storage_writer=StorageWriter(root), no_dist=True)
    assert not (tmp_path / "ckpt" / fmt.step_dir(1) / fmt.COMMIT_PATH).exists()
    assert open_checkpoint(root).steps() == [0]
    loaded = {k: torch.zeros(3, 5) for k in _state(4)}
    dcp.load(loaded, storage_reader=StorageReader(root), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state(4).items())


def test_the_store_writer_refuses_it_too(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_DOCUMENT_NBYTES", 4096)
    with pytest.raises(CheckpointError, match=r"commit record would be \d+ bytes"):
        save_tensors(str(tmp_path), 3, _state(40))
    assert open_checkpoint(str(tmp_path)).steps() == []


@pytest.mark.parametrize("bad", [float("nan"), {1, 2}, b"bytes"])
def test_attrs_given_at_commit_that_json_cannot_hold_commit_nothing(tmp_path, bad):
    tensors = _state(3)
    specs = plan_specs(tensors, 1)
    writer = StepWriter(str(tmp_path), 5, rank=0, world_size=1, specs=specs)
    writer.write({s.name: tensors[s.name].reshape(-1) for s in specs})
    with pytest.raises(ConfigError, match="attrs must be JSON-serialisable"):
        writer.commit(attrs={"bad": bad})
    assert open_checkpoint(str(tmp_path)).steps() == []
