"""[Note: one coordinator]: the engine binds its control collectives once, and the stage-3
runtime's forward-order checks, the checkpointer's save and load phases and
load_pretrained's agreement all go through that one Coordinator; only the runtime's
per-step exchanges are counted in comm_stats."""

from __future__ import annotations

import pytest
from common import batch, make_engine, make_model
from safetensors.torch import save_file
from world_of_one import world_of_one  # noqa: F401 - fixture

from zerostate.dist.coordinator import Coordinator


def _step(engine, step: int) -> None:
    x, y = batch(step, 0)
    engine.backward(engine(x, y))
    engine.step()


@pytest.mark.usefixtures("world_of_one")
def test_every_component_speaks_through_the_engines_coordinator(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, Coordinator, bool]] = []

    def recorded(name):
        method = getattr(Coordinator, name)

        def call(self, *args, **kwargs):
            calls.append((name, self, kwargs.get("every_step", False)))
            return method(self, *args, **kwargs)

        return call

    for name in ("arrive", "barrier", "exchange", "agree"):
        monkeypatch.setattr(Coordinator, name, recorded(name))
    engine = make_engine(make_model(), stage=3)
    bound = engine.coordinator
    for step in range(2):
        _step(engine, step)
    # The runtime's forward-order checks: the engine's own coordinator, counted per step.
    assert [n for n, _, _ in calls].count("exchange") >= 2, calls
    assert all(c is bound and (every or n == "arrive") for n, c, every in calls), calls
    counted = engine.comm_stats()
    assert counted["all_gather"]["calls"] > 0

    calls.clear()
    engine.save(str(tmp_path / "ckpt"))
    engine.load(str(tmp_path / "ckpt"))
    save_file(
        {k: v.contiguous() for k, v in engine.full_state_dict().items()}, tmp_path / "w.safetensors"
    )
    engine.load_pretrained(str(tmp_path / "w.safetensors"))
    # Save, load and load_pretrained: the same group, rank, device and counters, with
    # their own error to raise, and never counted as a step's traffic.
    assert {n for n, _, _ in calls} == {"arrive", "barrier", "exchange", "agree"}, calls
    for _, c, every in calls:
        assert not every
        assert (c.group, c.rank, c.world_size, c.device, c.stats) == (
            bound.group,
            bound.rank,
            bound.world_size,
            bound.device,
            bound.stats,
        )
        assert c.arrival_timeout_s == bound.arrival_timeout_s
    # The step after them moves what a step moves: their exchanges went uncounted.
    _step(engine, 2)
    assert engine.comm_stats() == counted
    engine.close()
