"""The Lightning strategy and the HF Trainer pass ``mesh=`` and ``tp_plan="auto"`` through to
the engine: a transformers Llama, parallelized by the engine from its own
``base_model_tp_plan`` (TP on q/k/v/o/gate/up/down), trains on 4 gloo ranks at (dp_shard 2 x
tp 2) under torchrun (Lightning's ranks forked as torchrun starts them), stage 2, SGD, and
its weights after 3 steps equal single-process SGD on the global batches the data-parallel
ranks trained on (the tp ranks of each data-parallel coordinate saw the same batches, the
two coordinates different ones)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked_launch
import pytest

pytest.importorskip("transformers")

WORKER = Path(__file__).resolve().parent / "_mesh_worker.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def _run(which: str, out: Path) -> dict:
    """The HF run under real torchrun; the Lightning run with ranks forked from servers that
    imported Lightning once ([Note: forked launches] in tests/forked_launch.py)."""
    forked_launch.run_example(WORKER, 4, [which, str(out)], env=ENV, workdir=out,
                              preload=forked_launch.LIGHTNING, torchrun=which == "hf",
                              timeout=600)  # fmt: skip
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("which", ["hf", "lightning"])
def test_trainer_with_a_tp_mesh_matches_single_process_sgd(which: str, tmp_path: Path) -> None:
    if which == "lightning":
        pytest.importorskip("lightning")
    result = _run(which, tmp_path)
    print(f"\n{which}: largest weight difference to single-process SGD {result['worst']:.2e} "
          f"(relative to the tensor's largest value); training moved weights by up to "
          f"{result['moved']:.2e}")  # fmt: skip
    assert result["missing"] == [] and result["steps"] == [3, 3, 3, 3], result
    assert result["tp_applied"], result  # the model's own plan was applied
    assert result["tp_peers_same"] and result["dp_ranks_differ"], result
    assert result["moved"] > 1e-3  # the comparison is not between untrained models
    assert result["worst"] <= 1e-5, result
