"""``model.load_state_dict(sd)`` after the engine is built, as a DDP script restores
weights ([Note: model.load_state_dict after wrapping] in zerostate.engine): at stages 0-2
the load lands in the fp32 masters too (in bf16 the next step used to write the old
weights back), at stage 3 it works inside ``gathered()`` and is refused outside it (torch's
copy into the empty parameters used to crash the process)."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.errors import ConfigError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(9, 14), nn.Tanh(), nn.Linear(14, 14), nn.Tanh(), nn.Linear(14, 3)
    )


def _target() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) for k, v in _model().state_dict().items()}


def _exact(engine: zerostate.Engine, want: dict[str, torch.Tensor]) -> bool:
    got = engine.full_state_dict()  # the fp32 masters, gathered
    return all(torch.equal(got[k].float(), want[k]) for k in want)


def _step(engine: zerostate.Engine, rank: int) -> None:
    x = torch.randn(2, 9, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).float().square().mean())
    engine.step()


def _worker(rank: int, world: int, stage: int, precision: str) -> dict:
    torch.set_num_threads(1)
    target = _target()
    out: dict = {}
    model = _model()
    engine = zerostate.Engine(model, stage=stage, precision=precision, lr=0.0, weight_decay=0.0)
    if stage == 3:
        try:
            model.load_state_dict(target)
            out["outside"] = None
        except ConfigError as exc:
            out["outside"] = str(exc)
        out["outside_unchanged"] = _exact(engine, _model().state_dict())
        try:  # rank 0 alone holds the weights here; it would write only its own shards
            with engine.gathered(rank0_only=True):
                if rank == 0:
                    model.load_state_dict(target)
            out["rank0_only"] = None
        except ConfigError as exc:
            out["rank0_only"] = str(exc)
        out["rank0_only_unchanged"] = _exact(engine, _model().state_dict())
        try:  # a part gathered, the whole loaded: refused before the part is written
            with engine.gathered(modules=[model[0]]):
                model.load_state_dict(target)
            out["part"] = None
        except ConfigError as exc:
            out["part"] = str(exc)
        out["part_unchanged"] = _exact(engine, _model().state_dict())
        with engine.gathered():
            model.load_state_dict(target)
    else:
        model.load_state_dict(target)
    out["masters_are_target"] = _exact(engine, target)
    _step(engine, rank)  # lr 0: the weights stay what was loaded
    out["after_step"] = _exact(engine, target)
    # A partial dict (strict=False) writes only what it holds.
    part = {k: v + 1 for k, v in target.items() if k.startswith("2.")}
    if stage == 3:
        with engine.gathered():
            model.load_state_dict(part, strict=False)
    else:
        model.load_state_dict(part, strict=False)
    out["partial"] = _exact(engine, {**target, **part})
    try:  # assign=True would swap in new parameters the engine does not train
        model.load_state_dict(target, assign=True)
        out["assign"] = None
    except ConfigError as exc:
        out["assign"] = str(exc)
    out["assign_unchanged"] = _exact(engine, {**target, **part})
    engine.close()
    # After close() the module is plain torch again.
    model.load_state_dict(target)
    out["after_close"] = all(
        torch.equal(v, target[k].to(v.dtype)) for k, v in model.state_dict().items()
    )
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_module_load_state_dict_after_wrapping_lands_in_the_masters(stage, precision):
    for rank, r in enumerate(run_distributed(_worker, 2, stage, precision)):
        if stage == 3:
            assert "engine.gathered()" in r["outside"], r
            assert r["outside_unchanged"], r
            assert r["rank0_only_unchanged"], r
            assert "holds no storage here" in r["part"] and r["part_unchanged"], r
            if rank == 0:
                assert "inside gathered(rank0_only=True)" in r["rank0_only"], r
            else:
                assert r["rank0_only"] is None, r
        assert r["masters_are_target"], r
        assert r["after_step"], r
        assert r["partial"], r
        assert "assign=True" in r["assign"] and r["assign_unchanged"], r
        assert r["after_close"], r
