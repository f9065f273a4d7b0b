"""``zerostate.save`` / ``zerostate.load``: a DDP model, torch's AdamW and an LR scheduler
saved at 2 gloo ranks load at 3 ranks and in one process bit for bit; the replicated
state is stored once, spread over the ranks."""

from __future__ import annotations

import pytest
import torch

import zerostate
from tests.dcp import workers
from tests.helpers_dist import run_distributed
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("api") / "ckpt"
    results = run_distributed(workers.ddp_save, 2, str(root))
    assert [r["step"] for r in results] == [0, 0]
    assert_same(results[0], results[1])  # DDP: every rank holds the same state
    return {"root": root, "state": results[0]}


def test_one_process_loads_bit_identical(saved):
    model, opt, sched = workers.ddp_parts(1, 0.5)  # other values: all must be replaced
    step = zerostate.load({"model": model, "optim": opt, "sched": sched}, str(saved["root"]))
    assert step == 0
    want = {k: v for k, v in saved["state"].items() if k != "step"}
    assert_same(workers.ddp_state(model, opt, sched), want)
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.25  # the scheduler's lr after 2 steps


def test_three_ranks_load_bit_identical(saved):
    for got in run_distributed(workers.ddp_load, 3, str(saved["root"])):
        assert_same(got, saved["state"])  # the step number too


def test_replicated_state_is_stored_once_spread_over_ranks(saved):
    state = saved["state"]
    model_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    optim_bytes = sum(
        t.numel() * t.element_size()
        for per_param in state["optim"]["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    with open_checkpoint(str(saved["root"])).step() as step:
        stored = sum(info.numel * info.dtype.itemsize for info in step.tensors.values())
        rows = step.row_objects()
    # Every tensor once: not once per rank.
    assert stored == model_bytes + optim_bytes
    # Both ranks write part of it, and the files hold little besides.
    assert sorted(r for _, r, _ in rows) == [0, 1]
    on_disk = sum(nbytes for _, _, nbytes in rows)
    assert stored <= on_disk < 1.25 * stored, (stored, on_disk)


def test_bad_states_and_roots_are_refused(saved, tmp_path):
    model, opt, _ = workers.ddp_parts(0, 0.1)
    with pytest.raises(ConfigError, match="optimizer 'optim'"):
        zerostate.save({"optim": opt}, str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="dict with string keys"):
        zerostate.save([model], str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        zerostate.load({"model": model}, str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="already committed"):
        zerostate.save({"model": model}, str(saved["root"]), step=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_state_that_does_not_match_the_step_is_refused_in_one_line_naming_the_key(tmp_path):
    root = str(tmp_path / "ckpt")
    zerostate.save({"model": {"w": torch.zeros(3, 4), "b": torch.ones(2)}}, root)
    wider = {"model": {"w": torch.zeros(5, 4), "b": torch.ones(2)}}
    with pytest.raises(ConfigError, match=r"step 0 of .* does not match the state: .*model\.w"):
        zerostate.load(wider, root)
    other = {"model": {"w": torch.zeros(3, 4), "x": torch.ones(2)}}
    with pytest.raises(ConfigError, match=r"does not match the state: .*model\.x") as info:
        zerostate.load(other, root)
    assert "\n" not in str(info.value)
    assert torch.equal(wider["model"]["w"], torch.zeros(5, 4))  # nothing half-loaded into it


def test_plain_values_of_the_state_come_back_into_the_callers_dict(tmp_path):
    """A top-level int, float, string, bool, None, bytes, list or dict of the state is set in
    the caller's dict, as ``dcp.load`` sets it in the dict it is given (the loop's step
    counter used to come back unchanged); tensors are filled in place, and the module,
    optimizer and scheduler restored through their ``load_state_dict``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    values = {"step": 7, "loss": 0.25, "note": "resume me", "done": True, "none": None,
              "raw": b"\x00\x01", "seen": [1, "a", 2.5],
              "data": {"epoch": 3, "order": [2, 0]}}  # fmt: skip
    tensor = torch.arange(6, dtype=torch.int64)
    zerostate.save({"model": model, "optim": opt, "sched": sched, "ids": tensor, **values},
                   str(tmp_path / "root"))  # fmt: skip
    model2 = torch.nn.Linear(5, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    ids = torch.zeros(6, dtype=torch.int64)
    state = {"model": model2, "optim": opt2, "sched": sched2, "ids": ids, "step": 0,
             "loss": 0.0, "note": "", "done": False, "none": None, "raw": b"",
             "seen": [], "data": {"epoch": 0, "order": []}}  # fmt: skip
    assert zerostate.load(state, str(tmp_path / "root")) == 0
    for key, want in values.items():
        assert state[key] == want and type(state[key]) is type(want), key
    assert state["ids"] is ids and torch.equal(ids, tensor)
    assert state["model"] is model2 and torch.equal(model2.weight, model.weight)
    assert state["optim"] is opt2 and opt2.param_groups[0]["lr"] == 0.05
    assert sched2.last_epoch == 1


def test_a_model_left_on_the_meta_device_is_refused_naming_the_tensor(tmp_path):
    """A model built on the meta device and never materialised: every save door refuses it in
    one line naming the tensor, before anything is written (torch's own error was a
    NotImplementedError about copying out of a meta tensor)."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    doors = {
        "save": lambda root: zerostate.save({"model": model}, root),
        "save, not blocking": lambda root: zerostate.save({"model": model}, root, blocking=False),
        "async_save": lambda root: dcp.async_save(
            {"model": model.state_dict()}, storage_writer=StorageWriter(root)
        ).result(),
    }
    for name, door in doors.items():
        root = tmp_path / name.replace(" ", "_").replace(",", "")
        with pytest.raises(ConfigError, match=r"model\.weight: a tensor on the meta device"):
            door(str(root))
        assert not root.exists(), name
