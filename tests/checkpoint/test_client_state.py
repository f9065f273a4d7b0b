"""``client_state`` is copied when ``save`` is called and comes back as it was given, in
the kinds of values a ``state_dict`` holds ([Note: save sources] in
zerostate.checkpoint.source)."""

from __future__ import annotations

import math

import pytest
import torch
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate


@pytest.fixture
def engine():
    torch.manual_seed(0)
    engine = zerostate.Engine(torch.nn.Linear(64, 48), lr=0.1)
    yield engine
    engine.close()


@pytest.mark.usefixtures("world_of_one")
def test_a_non_blocking_save_keeps_the_client_state_of_its_call(engine, tmp_path):
    """The caller goes on changing its dict (the data loader moves) once save() returns:
    the step holds the values of the call. It held the later ones before."""
    root = str(tmp_path / "root")
    state = {"epoch": 1, "order": [3, 1, 2], "sampler": {"pos": 10}}
    handle = engine.save(root, blocking=False, client_state=state)
    state["epoch"] = 2
    state["order"].append(0)
    state["sampler"]["pos"] = 99
    handle.wait()
    assert engine.load(root) == {"epoch": 1, "order": [3, 1, 2], "sampler": {"pos": 10}}


@pytest.mark.usefixtures("world_of_one")
def test_client_state_round_trips_the_values_a_state_dict_holds(engine, tmp_path):
    root = str(tmp_path / "root")
    state = {"best_loss": math.inf, "betas": (0.9, 0.95), "blob": b"\x00\xff",
             "ids": torch.arange(5), "nan": math.nan, 7: "int key"}  # fmt: skip
    engine.save(root, client_state=state)
    got = engine.load(root)
    assert got["best_loss"] == math.inf and math.isnan(got["nan"])
    assert got["betas"] == (0.9, 0.95) and isinstance(got["betas"], tuple)
    assert got["blob"] == b"\x00\xff" and got[7] == "int key"
    assert torch.equal(got["ids"], torch.arange(5))


@pytest.mark.usefixtures("world_of_one")
def test_client_state_that_needs_pickle_is_refused_naming_it(engine, tmp_path):
    with pytest.raises(zerostate.ConfigError, match=r"client_state\['hook'\].*without pickle"):
        engine.save(str(tmp_path / "root"), client_state={"hook": lambda: 0})
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
