"""The goodput model's arithmetic ([Note: goodput model] in benchmarks/goodput.py) on cases
worked by hand."""

from __future__ import annotations

import pytest

from benchmarks import goodput as gp


def test_failure_rate_is_linear_in_the_gpu_count():
    assert gp.mtbf_s(16384) == pytest.approx(3 * 3600)
    assert gp.mtbf_s(1024) == pytest.approx(16 * 3 * 3600)
    assert gp.mtbf_s(8, mtbf_h=2.0, ref_gpus=4) == pytest.approx(3600)


def test_durable_only_at_young_daly():
    # c = w = 2 s, L = 98 s, M = 10,000 s, 1 s steps: P* = sqrt(2 * 2 * 10,000) = 200 s,
    # so 198 steps + 2 s blocked; lost = 200 / 2 + 2 + 0 + 98 = 200 s per interruption;
    # goodput = 198 / 200 * (1 - 200 / 10,000) = 0.99 * 0.98.
    policy = gp.durable_only(gp.Costs(2.0, 2.0, 98.0), 10_000.0, 1.0, 0.0)
    assert policy.steps == 198
    assert policy.lost_s == pytest.approx(200.0)
    assert policy.goodput == pytest.approx(0.99 * 0.98)


def test_the_interval_is_never_shorter_than_a_save_takes_to_commit():
    # Young/Daly would save every step (c = 0.1 s, M = 100 s: P* = 4.5 s < one 10 s step),
    # but a save takes 50 s to commit: (50 - 0.1) / 10 rounds up to 5 steps.
    assert gp.young_daly_steps(0.1, 100.0, 10.0, 50.0) == 5
    assert gp.young_daly_steps(0.1, 100.0, 10.0, 0.1) == 1


def test_memory_tier_with_a_share_of_interruptions_losing_both_copies():
    # Every step (10 s, nothing blocked or pending), R = 5 s. Half the interruptions keep
    # the memory copy: 10 / 2 + 0 + 5 + 10 (L_m) = 20 s lost; half restart from the durable
    # copy of every 3rd step: 3 * 10 / 2 + 0 + 20 (w_d) + 5 + 30 (L_d) = 70 s.
    # lost = 0.5 * 20 + 0.5 * 70 = 45 s; goodput = 10 / 10 * (1 - 45 / 1,000).
    memory, durable = gp.Costs(0.0, 0.0, 10.0), gp.Costs(0.0, 20.0, 30.0)
    policy = gp.memory_tier(memory, durable, 1000.0, 10.0, 5.0, 3, 0.5, steps=1)
    assert policy.lost_s == pytest.approx(45.0)
    assert policy.goodput == pytest.approx(0.955)
    # No loss: the durable copy does not count.
    kept = gp.memory_tier(memory, durable, 1000.0, 10.0, 5.0, 3, 0.0, steps=1)
    assert kept.lost_s == pytest.approx(20.0) and kept.goodput == pytest.approx(0.98)


def test_memory_tier_interval_weighs_the_durable_fallback():
    # c = 2 s, M = 10,000 s, K = 10, p = 1/3: weight 2/3 + 10/3 = 4, P* = sqrt(40,000 / 4)
    # = 100 s, so 98 one-second steps.
    memory, durable = gp.Costs(2.0, 2.0, 1.0), gp.Costs(2.0, 2.0, 1.0)
    policy = gp.memory_tier(memory, durable, 10_000.0, 1.0, 0.0, 10, 1 / 3)
    assert policy.steps == 98


def test_costs_scale_with_bytes_and_the_durable_tier_with_the_job():
    args = gp.parse_args(
        ["--measured-gb", "0.1", "--gb-per-gpu", "0.2", "--durable-gbps", "1"]
        + ["--mem-blocked", "0.01", "--mem-committed", "0.5", "--mem-load", "0.25"]
        + ["--disk-blocked", "0.02", "--disk-load", "0.3", "--disk-committed", "0.5"]
    )
    memory, durable = gp.scaled(args, 1000)
    assert memory == gp.Costs(pytest.approx(0.02), pytest.approx(1.0), pytest.approx(0.5))
    # 1000 GPUs x 0.2 GB over 1 GB/s: 200 s to write and to read the step.
    assert durable == gp.Costs(pytest.approx(0.04), pytest.approx(200.0), pytest.approx(200.0))
    small, _ = gp.scaled(args, 1)
    assert small == memory  # the memory tier's costs do not grow with the job


def test_the_table_names_every_gpu_count():
    out = gp.table(gp.parse_args(["--gpus", "1024", "16384"]))
    assert "| 1,024 | 48.00 h |" in out and "| 16,384 | 3.00 h |" in out
    assert len(out.splitlines()) == 4
