"""Run examples/train_gpt.py, but SIGKILL one rank right after optimizer step
``ZEROSTATE_KILL_AT_STEP`` on torchrun's first attempt only (restart count 0), as a node
failure would. Later attempts run the example untouched."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import zerostate

KILL_AT = int(os.environ.get("ZEROSTATE_KILL_AT_STEP", "0"))
KILL_RANK = int(os.environ.get("ZEROSTATE_KILL_RANK", "1"))
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

if KILL_AT and FIRST_ATTEMPT:
    original_step = zerostate.Engine.step

    def step(self):
        changed = original_step(self)
        if self.rank == KILL_RANK and self.optimizer_steps == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return changed

    zerostate.Engine.step = step

example = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
