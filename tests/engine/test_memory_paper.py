"""Live model-state bytes per rank within 5% of the ZeRO paper at default settings.

Two transformers models of shapes unlike the test fixture (a Llama and a GPT-2 built from
configs), bf16, N = 2 and 4, every stage: after the first backward of an accumulation, the
bytes of every live tensor storage in the process, less the working buffers that
``memory_stats()`` names and the model's own buffers, against the paper's formula with
gradients counted at the reduce dtype's bytes (fp32 by default; with
``reduce_dtype="bf16"``, the paper's own 2 bytes). See benchmarks/memory.py.
"""

from __future__ import annotations

import pytest
from helpers_dist import run_distributed

from benchmarks import memory


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_live_bytes_are_the_papers_plus_named_buffers(world_size: int) -> None:
    results = run_distributed(memory._worker, world_size, timeout=600)
    for rank, table in enumerate(results):
        for (name, reduce_dtype, stage), r in sorted(table.items()):
            unnamed = r["live"] - r["named"] - r["buffers"]
            ratio = unnamed / r["paper"]
            print(f"rank {rank} {name} reduce={reduce_dtype} stage {stage}: {ratio:.4f}")
            assert abs(ratio - 1.0) <= 0.05, (rank, name, reduce_dtype, stage, ratio)
            # What memory_stats() reports as model states is what is really live.
            assert abs(r["reported"] / unnamed - 1.0) <= 0.01, (name, stage, r)
