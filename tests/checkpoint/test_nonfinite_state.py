"""States holding floats JSON has no number for (``inf``, ``NaN``) save and load through
every door: ``ReduceLROnPlateau`` keeps ``inf`` in its state from its first step, and a
loop's ``best_loss`` often starts as ``inf``. Both were refused at save before."""

from __future__ import annotations

import math

import pytest
import torch
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _plateau(lr: float = 0.1):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)


def test_the_public_api_saves_and_loads_a_plateau_scheduler_and_an_infinite_best(tmp_path):
    model, opt, sched = _plateau()
    sched.step(1.0)
    sched.step(2.0)  # worse: the lr is cut, the scheduler's state moves on
    state = {"model": model, "optim": opt, "sched": sched, "best_loss": float("inf"),
             "history": [float("nan"), 1.0, float("-inf")]}  # fmt: skip
    zerostate.save(state, str(tmp_path / "root"))
    model2, opt2, sched2 = _plateau(lr=0.5)
    got = {"model": model2, "optim": opt2, "sched": sched2, "best_loss": 0.0, "history": []}
    assert zerostate.load(got, str(tmp_path / "root")) == 0
    assert sched2.state_dict() == sched.state_dict()
    assert sched2.mode_worse == math.inf and opt2.param_groups[0]["lr"] == pytest.approx(0.01)
    assert got["best_loss"] == math.inf
    assert math.isnan(got["history"][0]) and got["history"][1:] == [1.0, -math.inf]


@pytest.mark.usefixtures("world_of_one")
def test_the_engine_saves_and_loads_a_plateau_scheduler_as_stateful(tmp_path):
    torch.manual_seed(0)
    engine = zerostate.Engine(torch.nn.Linear(4, 2), lr=0.1)
    _, _, sched = _plateau()
    sched.step(3.0)
    engine.save(str(tmp_path / "root"), stateful={"sched": sched})
    engine.close()
    other = zerostate.Engine(torch.nn.Linear(4, 2), lr=0.1)
    _, _, sched2 = _plateau()
    other.load(str(tmp_path / "root"), stateful={"sched": sched2})
    other.close()
    assert sched2.state_dict() == sched.state_dict() and sched2.mode_worse == math.inf
