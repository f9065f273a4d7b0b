"""A real ``lightning.pytorch.Trainer`` (examples/lightning_train.py on 2 gloo ranks, under
real torchrun at stage 3, with forked ranks otherwise: [Note: forked launches] in
tests/forked_launch.py) with ``ZeroStateStrategy`` at stages 1-3: the loss of every
micro-batch equals Lightning's own DDP strategy on the same seed (AdamW, warm-up schedule, gradient
accumulation and clipping from the Trainer's flags); ``ckpt_path`` resume from an epoch's
checkpoint (saved asynchronously at stage 2) at 1 and 3 devices continues the
uninterrupted curve."""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked_launch
import pytest

from zerostate.store import open_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_train.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
RTOL = 1e-5
PRELOAD = forked_launch.LIGHTNING


def _run(
    work: Path, nproc: int, log: Path, *args: str, torchrun: bool = False
) -> list[tuple[int, float]]:
    """The example on ``nproc`` ranks: under real ``torchrun`` when asked, else with ranks
    forked from servers that imported Lightning once ([Note: forked launches])."""
    argv = ["--workdir", str(work), "--log-json", str(log), *args]
    forked_launch.run_example(EXAMPLE, nproc, argv, env=ENV, workdir=work, preload=PRELOAD,
                              torchrun=torchrun)  # fmt: skip
    return [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]


def _close(got, want, rtol=RTOL):
    assert [s for s, _ in got] == [s for s, _ in want]
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert worst <= rtol, (worst, got, want)
    return worst


@pytest.fixture(scope="module")
def ddp_curve(tmp_path_factory):
    work = tmp_path_factory.mktemp("ddp")
    return _run(work, 2, work / "log.jsonl", "--strategy", "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("stage,resume_devices", [(1, [3]), (2, [1]), (3, [1, 3])])
def test_lightning_strategy_matches_ddp_and_resumes(tmp_path, ddp_curve, stage, resume_devices):
    extra = ["--async-save"] if stage == 2 else []  # saves in the background at stage 2
    # Stage 3 under real torchrun, as users launch it; the other runs fork their ranks.
    curve = _run(tmp_path, 2, tmp_path / "log.jsonl", "--stage", str(stage), *extra,
                 torchrun=stage == 3)  # fmt: skip
    assert len(curve) == 16 and curve[-1][0] == 7  # 2 epochs x 8 micro-batches, 8 steps
    worst = _close(curve, ddp_curve)
    print(f"\nstage {stage}: max relative loss difference to DDP {worst:.2e}")
    root = tmp_path / "ckpt" / "epoch=0.ckpt"
    st = open_checkpoint(str(root)).step()
    assert st.step == 4 and st.world_size == 2
    assert st.attrs["client_state"]["epoch"] == 0  # Lightning's state rides as JSON
    second_epoch = [r for r in curve if r[0] >= 4]
    for devices in resume_devices:
        work = tmp_path / f"resume{devices}"
        resumed = _run(work, devices, work / "log.jsonl", "--stage", str(stage),
                       "--resume", str(root))  # fmt: skip
        worst = _close(resumed, second_epoch, rtol=1e-4)
        print(f"stage {stage}: resumed on {devices} device(s), max relative difference {worst:.2e}")
