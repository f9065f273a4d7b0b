"""``dcp.async_save`` through zerostate's writer stages into CPU buffers kept from the previous
save ([Note: reused staging buffers] in zerostate.dcp.staging): the second save copies into
the first's memory, values changed after staging never reach the step, and a set still read
by a running save is never handed out again.

One process, no torch.distributed (DCP's no_dist path), plus the stager on its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerostate.dcp import StorageReader, StorageWriter
from zerostate.dcp.staging import StagingBuffers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    return {"model": model.state_dict(), "empty": torch.zeros(0, 4), "step": seed}


def _load(root, step: int) -> dict:
    target = _state(99)
    dcp.load(target, storage_reader=StorageReader(str(root), step=step))
    return target


def test_async_saves_reuse_the_buffers_and_stay_training_safe(tmp_path):
    root = tmp_path / "ckpt"
    writer = StorageWriter(str(root))
    first = _state(1)
    expected_first = {k: v.clone() for k, v in first["model"].items()}
    dcp.async_save(first, storage_writer=writer).result()
    held = writer._staging.held_nbytes()
    assert held == sum(v.numel() * v.element_size() for v in first["model"].values())
    kept = {k: b.data_ptr() for k, b in writer._staging._idle.buffers.items() if b.numel()}

    second = _state(2)
    future = dcp.async_save(second, storage_writer=writer)
    expected_second = {k: v.clone() for k, v in second["model"].items()}
    for value in second["model"].values():  # the training loop goes on: nothing leaks
        value.add_(100.0)
    future.result()
    reused = {k: b.data_ptr() for k, b in writer._staging._idle.buffers.items() if b.numel()}
    assert reused == kept  # the second save copied into the first save's memory
    assert writer._staging.held_nbytes() == held  # one set kept, no growth

    for step, expected, marker in ((0, expected_first, 1), (1, expected_second, 2)):
        loaded = _load(root, step)
        assert loaded["step"] == marker
        for key, value in expected.items():
            assert torch.equal(loaded["model"][key], value), (step, key)
    writer.close()
    assert writer._staging.held_nbytes() == 0


def test_a_set_in_use_is_never_handed_out_again():
    staging = StagingBuffers()
    a = staging.stage({"w": torch.ones(3), "e": torch.zeros(0)})
    b = staging.stage({"w": torch.full((3,), 2.0), "e": torch.zeros(0)})  # a is still written
    assert a["w"].data_ptr() != b["w"].data_ptr()
    assert torch.equal(a["w"], torch.ones(3))  # staging b did not touch a's buffer
    staging.release([b["w"], b["e"]])  # b's save finished; a's (an empty tensor shared) not
    c = staging.stage({"w": torch.full((3,), 3.0), "e": torch.zeros(0)})
    assert c["w"].data_ptr() == b["w"].data_ptr()  # b's set is reused ...
    assert torch.equal(a["w"], torch.ones(3))  # ... a's is not
    staging.release([a["w"]])  # a was forgotten when b was staged: never reused
    d = staging.stage({"w": torch.full((3,), 4.0), "e": torch.zeros(0)})  # c still written
    assert d["w"].data_ptr() not in (a["w"].data_ptr(), c["w"].data_ptr())
    assert torch.equal(a["w"], torch.ones(3)) and torch.equal(c["w"], torch.full((3,), 3.0))


def test_saves_whose_release_never_comes_do_not_pile_up():
    """Process staging releases in DCP's staging process, and a save that fails before it
    writes releases nothing: the stager holds one copy, not one per save."""
    staging = StagingBuffers()
    one_copy = 64 * 4
    for i in range(5):
        staging.stage({"w": torch.full((64,), float(i))})
        assert staging.held_nbytes() == one_copy


def test_a_changed_shape_gets_a_new_buffer_and_plain_values_are_copied():
    staging = StagingBuffers()
    groups = [{"lr": 0.1, "params": [0, 1]}]
    first = staging.stage({"w": torch.ones(3), "groups": groups})
    groups[0]["lr"] = 0.5  # changed after staging: the staged copy keeps 0.1
    assert first["groups"][0]["lr"] == 0.1
    staging.release([first["w"]])
    second = staging.stage({"w": torch.ones(4)})
    assert second["w"].shape == (4,) and torch.equal(second["w"], torch.ones(4))
    assert torch.equal(first["w"], torch.ones(3))  # not resized under the first save


def test_non_blocking_zerostate_saves_share_one_staging_copy(tmp_path):
    import zerostate
    from zerostate import api

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    root = tmp_path / "ckpt"
    zerostate.save({"model": model}, root, blocking=False).wait()
    kept = {k: b.data_ptr() for k, b in api._STAGING._idle.buffers.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    zerostate.save({"model": model}, root, blocking=False).wait()
    assert {k: b.data_ptr() for k, b in api._STAGING._idle.buffers.items()} == kept
    fresh = torch.nn.Linear(6, 4)
    assert zerostate.load({"model": fresh}, root) == 1
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
