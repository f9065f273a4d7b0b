"""``zerostate estimate --tp --dp-replicate``: the model-state bytes per rank it reports are
those a real engine holds (``memory_stats()``) at (dp_shard 2 x tp 2), stages 0-3, with a
transformers Llama parallelized by torch's ``parallelize_module``."""

from __future__ import annotations

import json

import pytest
from helpers_dist import run_distributed
from llama_tp import llama, parallelize
from torch.distributed.device_mesh import init_device_mesh
from zerostate_cli.main import main

import zerostate
from zerostate.dist import collectives
from zerostate.errors import ConfigError
from zerostate.estimate import estimate, mesh_shape

pytest.importorskip("transformers")

STAGES = (0, 1, 2, 3)


def _llama():
    return llama(vocab=1000, hidden=96, inter=200, heads=4, kv=2)


def _parallelize(model, tp_mesh):
    return parallelize(model, tp_mesh)


def _worker(rank: int, world_size: int) -> dict:
    import torch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out = {}
    for stage in STAGES:
        model = _parallelize(_llama(), mesh["tp"])
        if stage == 0:
            out["psi"] = sum(p.numel() for p in _llama().parameters())
            out["tp_replicated"] = sum(
                p.numel() for p in model.parameters() if not collectives.is_dtensor(p)
            )
        # 16-bit gradients, as the estimate (the paper) counts them.
        engine = zerostate.Engine(
            model, mesh=mesh, stage=stage, precision="bf16", reduce_dtype="bf16"
        )
        x = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(rank // 2))
        engine.backward(engine(input_ids=x, labels=x).loss)
        out[stage] = engine.memory_stats()
        engine.close()
    return out


def test_estimate_with_tp_matches_a_real_engine(capsys: pytest.CaptureFixture[str]) -> None:
    results = run_distributed(_worker, 4, timeout=600)
    psi, rep = results[0]["psi"], results[0]["tp_replicated"]
    for r in results:
        assert (r["psi"], r["tp_replicated"]) == (psi, rep)
    argv = ["estimate", "--params", str(psi), "--dp", "2", "--tp", "2", "--json"]
    assert main([*argv, "--tp-replicated", str(rep)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["dp_shard"], data["tp"], data["dp_replicate"]) == (2, 2, 1)
    rows = {row["stage"]: row for row in data["stages"]}
    assert main(argv) == 0  # every parameter split by tp: Psi / TP
    plain = {row["stage"]: row for row in json.loads(capsys.readouterr().out)["stages"]}
    for stage in STAGES:
        for rank, r in enumerate(results):
            held = r[stage]["model_states"]
            ratio = held / rows[stage]["total_bytes"]
            print(
                f"rank {rank} stage {stage}: model_states {held:,} B, estimate "
                f"{rows[stage]['total_bytes']:,} B ({ratio:.4f} x); Psi/TP alone "
                f"{plain[stage]['total_bytes']:,} B ({held / plain[stage]['total_bytes']:.4f} x)"
            )
            assert abs(ratio - 1) <= 0.03, (stage, rank, r[stage], rows[stage])


def test_mesh_shape_divides_as_the_engine_does() -> None:
    psi = 1_000_003
    # (dp_replicate 2 x dp_shard 4) x tp 2 = 16 ranks: ZeRO over 4 ranks of Psi/2 each.
    got = estimate(psi, 8, tp=2, dp_replicate=2)
    want = estimate(-(-psi // 2), 4)
    assert [r.total_bytes for r in got] == [r.total_bytes for r in want]
    assert mesh_shape(psi, 8, tp=4, tp_replicated=3).params_per_tp_rank == 250_000 + 3
    # Replicas divide nothing: dp_replicate 8 of dp_shard 1 is plain data parallelism.
    assert len({r.total_bytes for r in estimate(psi, 8, dp_replicate=8)}) == 1
    with pytest.raises(ConfigError, match="make it a multiple of dp_replicate"):
        estimate(psi, 6, dp_replicate=4)
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        estimate(psi, 2, tp=0)
    with pytest.raises(ConfigError, match="tp_replicated="):
        estimate(psi, 2, tp=2, tp_replicated=psi + 1)


def test_estimate_text_names_the_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--tp", "8",
                 "--dp-replicate", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "dp_replicate 4 x dp_shard 16 x tp 8" in out and "937,500,000" in out
    # Stage 3 over dp_shard 16 of Psi/8: 16 * 937.5M / 16 bytes.
    assert "937,500,000" in out.splitlines()[-1]
