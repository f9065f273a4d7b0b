"""Misuse around async saves: parameters changed right after ``save(blocking=False)``
returns, a second save while one is in flight, retention while saves are in flight."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers_dist import run_distributed  # noqa: E402

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks misuse the
# engine on purpose and may leave it mid-save. Each call forks new processes ([Note: forked
# workers] in tests/fork_server.py); nothing here needs a new interpreter, so the ranks are not
# spawned.


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Tanh(), torch.nn.Linear(29, 3))


def _step(engine) -> None:
    g = torch.Generator().manual_seed(engine.optimizer_steps)
    engine.backward(engine(torch.randn(4, 13, generator=g)).square().mean())
    engine.step()


def _worker(rank: int, world_size: int, root: str, stage: int, precision: str) -> dict:
    import zerostate
    from zerostate.store import open_checkpoint

    out = {}
    engine = zerostate.Engine(_model(), stage=stage, precision=precision, lr=1e-2)
    _step(engine)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    handle = engine.save(f"{root}/mutate", blocking=False)
    with torch.no_grad():  # the caller changes the live parameters at once
        for p in engine.module.parameters():
            if p.untyped_storage().nbytes():
                p.add_(100.0)
    handle.wait()
    fresh = zerostate.Engine(_model(), stage=stage, precision=precision, lr=1e-2)
    fresh.load(f"{root}/mutate")
    after = fresh.full_state_dict()
    out["saved values are the old ones"] = all(torch.equal(after[k], before[k]) for k in before)
    fresh.close()

    # A second save while one is in flight waits for the first; both commit.
    engine.load(f"{root}/mutate")
    _step(engine)
    first = engine.save(f"{root}/two", step=10, blocking=False)
    second = engine.save(f"{root}/two", step=11, blocking=False)
    second.wait()
    out["both committed"] = first.done() and open_checkpoint(f"{root}/two").steps() == [10, 11]

    # Retention while saves are in flight keeps only committed, complete steps.
    for step in (20, 21, 22):
        _step(engine)
        engine.save(f"{root}/keep", step=step, blocking=False, keep_last=1)
    engine.close()  # on rank 0 this includes the last save's retention
    zerostate.dist.collectives.barrier(group=None)
    reader = open_checkpoint(f"{root}/keep")
    out["retention"] = reader.scan()
    reader.step().verify()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (2, "fp32"), (3, "bf16")])
def test_async_save_misuse(tmp_path, stage, precision):
    results = run_distributed(_worker, 2, str(tmp_path), stage, precision, timeout=400)
    for result in results:
        assert result["saved values are the old ones"]
        assert result["both committed"]
        assert result["retention"] == ([22], [])
