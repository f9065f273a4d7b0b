"""The memory estimator against the ZeRO paper's worked example."""

from __future__ import annotations

import pytest

from zerostate.errors import ConfigError
from zerostate.estimate import estimate, estimate_stage, format_bytes, parse_count


def test_paper_example_7_5b_params_64_ranks() -> None:
    # Rajbhandari et al., figure 1: Psi = 7.5B, N_d = 64, K = 12 (GB = 1e9 bytes).
    got = [round(row.total_bytes / 1e9, 1) for row in estimate(7_500_000_000, 64)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_stage_components_follow_the_formulas() -> None:
    psi, n, k = 1_000_003, 7, 12
    s1 = estimate_stage(psi, n, 1, k)
    assert s1.params_bytes == 2 * psi and s1.grads_bytes == 2 * psi
    assert s1.optim_bytes == pytest.approx(k * psi / n)
    s2 = estimate_stage(psi, n, 2, k)
    assert s2.total_bytes == pytest.approx(2 * psi + (2 + k) * psi / n)
    s3 = estimate_stage(psi, n, 3, k)
    assert s3.total_bytes == pytest.approx((4 + k) * psi / n)


def test_one_rank_makes_every_stage_equal() -> None:
    totals = {row.total_bytes for row in estimate(350_000_000, 1)}
    assert totals == {16 * 350_000_000}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7.5e9", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("7.5b", 7_500_000_000),
        ("350M", 350_000_000),
        ("125K", 125_000),
        ("1.2T", 1_200_000_000_000),
        ("1_000", 1000),
        ("42", 42),
    ],
)
def test_parse_count(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "7.5X", "-3", "0", "1e400"])
def test_parse_count_rejects_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ConfigError, match="parameter count"):
        parse_count(text)


def test_bad_arguments_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="dp"):
        estimate(100, 0)
    with pytest.raises(ConfigError, match="stage"):
        estimate_stage(100, 2, 4)


def test_format_bytes_uses_binary_units() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
