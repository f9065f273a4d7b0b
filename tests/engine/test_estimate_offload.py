"""``zerostate estimate --offload``: the device and host bytes per rank it reports are those a
real engine holds (``memory_stats()``), for every offload mode and stage it applies to."""

from __future__ import annotations

import json

import pytest
from common import batch, local, make_engine, make_model
from helpers_dist import run_distributed
from zerostate_cli.main import main

from zerostate.errors import ConfigError
from zerostate.estimate import estimate, estimate_stage

WIDE = dict(n_embd=128)  # big enough that shard padding is negligible
CASES = ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params"))


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for stage, offload in CASES:
        # 16-bit gradients, as the estimate (the paper) counts them.
        engine = make_engine(
            make_model(**WIDE), stage=stage, precision="bf16", reduce_dtype="bf16",
            offload=offload, grad_accum_steps=2,
        )  # fmt: skip
        x, y = batch(0, 0)
        engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
        out[(stage, offload)] = engine.memory_stats()
    out["psi"] = sum(p.numel() for p in make_model(**WIDE).parameters())
    return out


@pytest.mark.filterwarnings("ignore:offload_threads has no effect")
def test_estimate_tiers_match_a_real_engine(capsys: pytest.CaptureFixture[str]) -> None:
    world_size = 2
    results = run_distributed(_worker, world_size, timeout=300)
    psi = results[0]["psi"]
    rows = {}
    for stage, offload in CASES:
        assert main(["estimate", "--params", str(psi), "--dp", str(world_size), "--stage",
                     str(stage), "--offload", offload, "--json"]) == 0  # fmt: skip
        rows[(stage, offload)] = json.loads(capsys.readouterr().out)["stages"][0]
    for (stage, offload), row in rows.items():
        for rank, r in enumerate(results):
            stats = r[(stage, offload)]
            # The estimate counts model states; the named working buffers are apart.
            device = stats["device_bytes"] - stats["buffers_in_flight"]
            ratios = (device / row["device_bytes"], stats["host_bytes"] / row["host_bytes"])
            print(f"rank {rank} stage {stage} offload={offload}: device {ratios[0]:.4f}, "
                  f"host {ratios[1]:.4f} x the estimate")  # fmt: skip
            assert all(abs(x - 1) <= 0.03 for x in ratios), (stage, offload, stats, row)
            assert stats["host_optimizer_bytes"] == pytest.approx(row["optim_bytes"], rel=0.03)


def test_offload_moves_bytes_between_tiers_only() -> None:
    psi, n = 1_000_003, 7
    for stage in (1, 2, 3):
        plain = estimate_stage(psi, n, stage)
        off = estimate_stage(psi, n, stage, offload="optimizer")
        assert plain.host_bytes == 0 and plain.device_bytes == plain.total_bytes
        assert off.host_bytes == pytest.approx((12 + 4) * psi / n)
        assert off.device_bytes == pytest.approx(plain.total_bytes - 12 * psi / n)
    params = estimate_stage(psi, n, 3, offload="params")
    assert params.device_bytes == pytest.approx(2 * psi / n)  # only the gradient shards
    assert params.host_bytes == pytest.approx((2 + 12 + 4) * psi / n)
    assert [r.stage for r in estimate(psi, n, offload="optimizer")] == [1, 2, 3]
    with pytest.raises(ConfigError, match="stage 1, 2, 3, not stage 0"):
        estimate_stage(psi, n, 0, offload="optimizer")
    with pytest.raises(ConfigError, match="only stage 3 partitions"):
        estimate_stage(psi, n, 2, offload="params")
    with pytest.raises(ConfigError, match="not an offload mode"):
        estimate_stage(psi, n, 2, offload="cpu")


def test_estimate_text_shows_both_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "device" in out and "host" in out and "offload=optimizer" in out
    # Stage 2: 2 Psi + 2 Psi / N on the device, (12 + 4) Psi / N on the host.
    assert "14.19 GiB" in out and "1.75 GiB" in out
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--offload", "params"]) == 0
    assert "223.52 MiB" in capsys.readouterr().out  # stage 3 device: 2 Psi / N
