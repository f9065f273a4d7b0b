"""Measured model-state memory and communication per step against the ZeRO paper (bf16).

Memory is read after the first backward of a 2-micro-step accumulation, where each stage
holds what the paper counts: full gradients for stages 0/1, gradient shards for 2/3. The
expected bytes are the paper's plus what the reduce precision costs (docs/engine.md,
"Precision"): with the default fp32 reduction, fp32 instead of bf16 gradients (2 Psi more
at stages 0/1, 2 Psi / N more at 2/3); with ``reduce_dtype="bf16"``, nothing.
Communication is the last of two optimizer steps without accumulation.
"""

from __future__ import annotations

import pytest
from common import batch, local, make_engine, make_model
from helpers_dist import run_distributed

WIDE = dict(n_embd=128)  # big enough that shard padding is negligible


def _paper_bytes(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[
        stage
    ]


def _reduce_surcharge(stage: int, psi: int, n: int, reduce_dtype: str) -> float:
    if reduce_dtype != "fp32":
        return 0.0  # 16-bit gradients, as the paper counts them
    return 2 * psi / n if stage >= 2 else 2 * psi  # fp32 shards / fp32 accumulation buffer


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for stage in range(4):
        settings = dict(stage=stage, precision="bf16", bucket_mb=0.25)
        for reduce_dtype in ("fp32", "bf16"):
            engine = make_engine(
                make_model(**WIDE), grad_accum_steps=2, reduce_dtype=reduce_dtype, **settings
            )
            x, y = batch(0, 0)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            out[("memory", stage, reduce_dtype)] = engine.memory_stats()
        engine = make_engine(make_model(**WIDE), **settings)
        for step in range(2):
            x, y = batch(step, 0)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            engine.step()
        out[("comm", stage)] = engine.comm_stats()
    out["psi"] = sum(p.numel() for p in make_model(**WIDE).parameters())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_and_comm_match_the_paper(world_size: int) -> None:
    results = run_distributed(_worker, world_size, timeout=200)
    psi = results[0]["psi"]
    for rank, r in enumerate(results):
        for stage in range(4):
            for reduce_dtype in ("fp32", "bf16"):
                mem = r[("memory", stage, reduce_dtype)]
                paper = _paper_bytes(stage, psi, world_size)
                expected = paper + _reduce_surcharge(stage, psi, world_size, reduce_dtype)
                ratio = mem["model_states"] / expected
                print(
                    f"N={world_size} rank {rank} stage {stage} reduce {reduce_dtype}: memory "
                    f"{ratio:.4f} x (paper + reduce buffers), {mem['model_states'] / paper:.4f}"
                    f" x paper (in flight {mem['buffers_in_flight'] / paper:.3f})"
                )
                assert abs(ratio - 1) <= 0.05, (stage, reduce_dtype, mem)
            comm = r[("comm", stage)]["total"]["elements"]
            comm_ratio = comm / ((3 if stage == 3 else 2) * psi)
            print(f"N={world_size} stage {stage}: comm {comm_ratio:.4f} x paper")
            assert abs(comm_ratio - 1) <= 0.02, (stage, r[("comm", stage)])
