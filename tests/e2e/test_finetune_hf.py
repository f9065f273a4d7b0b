"""examples/finetune_hf.py end to end: a Llama created as safetensors, loaded with
load_pretrained into a meta-device stage-3 engine, trained with a warm-up + cosine schedule,
saved asynchronously; run (a) uninterrupted on 2 ranks and (b) as two torchrun "nodes"
(c10d rendezvous on 127.0.0.1) stopped at step 6, then resumed under --nnodes=1 on one rank.
The resumed run's losses equal the uninterrupted run's (the schedule continued, not
restarted), and the consolidated directory opens with transformers' from_pretrained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_dist import free_port

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "finetune_hf.py"
STEPS, STOP = 12, 6
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def _torchrun(launch: list[str], args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, str(EXAMPLE), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)  # fmt: skip


def _finish(*procs: subprocess.Popen, timeout: float = 240) -> list[str]:
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, out[-6000:]
        outs.append(out)
    return outs


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _run_args(work: Path, log: Path, *extra: str) -> list[str]:
    return ["--workdir", str(work), "--steps", str(STEPS), "--log-json", str(log), *extra]


@pytest.mark.slow
def test_finetune_example_two_nodes_resumed_on_one(tmp_path) -> None:
    # (a) Uninterrupted, 2 ranks on one node: the plain way to run the example.
    ref_log = tmp_path / "ref.jsonl"
    t0 = time.perf_counter()
    (out,) = _finish(
        _torchrun(["--nproc_per_node=2", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}"], _run_args(tmp_path / "ref", ref_log))
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    print(f"2-rank end-to-end run: {elapsed:.1f} s")
    assert elapsed < 180, elapsed
    assert "loaded" in out and "missing=[]" in out

    # (b) Two "nodes" of one process each, rendezvous through c10d, stopped at step 6.
    work, log = tmp_path / "run", tmp_path / "run.jsonl"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _torchrun(["--nnodes=2", "--nproc_per_node=1", f"--node-rank={rank}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=ft"],
                  _run_args(work, log, "--stop-at", str(STOP)))
        for rank in (0, 1)
    ]  # fmt: skip
    _finish(*nodes)
    assert sorted(p.name for p in (work / "ckpt").iterdir() if p.name.startswith("step-")) == [
        "step-00000003",
        "step-00000006",
    ]
    assert not (work / "hf").exists()  # the schedule is not finished: nothing exported
    # ... resumed as a single node of one process.
    (out,) = _finish(
        _torchrun(["--nnodes=1", "--nproc_per_node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=ft-resume"],
                  _run_args(work, log, "--resume"))
    )  # fmt: skip
    assert f"resumed at step {STOP} on 1 rank(s)" in out, out[-3000:]

    ref, got = _losses(ref_log), _losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    assert ref[STEPS] < 0.9 * ref[1], ref  # training moves the loss: the comparison means something
    for step in range(1, STEPS + 1):
        assert abs(got[step] - ref[step]) <= 1e-5 * ref[step], (step, got[step], ref[step])

    # The export: checked in the script against the engine's logits, and opened here.
    diff = float(re.search(r"logits vs engine: max abs diff (\S+)", out).group(1))
    assert diff <= 1e-5, out[-3000:]
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        str(work / "hf"), local_files_only=True, output_loading_info=True
    )
    assert hf.config.num_hidden_layers == 2
    # The export holds what state_dict() holds: no rotary inv_freq, nothing missing.
    assert not info["unexpected_keys"] and not info["missing_keys"], info
