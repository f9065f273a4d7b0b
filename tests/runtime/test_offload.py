"""ZeRO-Offload ([Note: offload] in zerostate.runtime.offload): masters and optimizer states on
the host give the same training as without, the tiers are counted, checkpoints do not depend
on where the step ran, and saves do not grow host memory."""

from __future__ import annotations

import pytest
import torch
from common import engine_steps, make_engine, make_model
from helpers_dist import run_distributed

import zerostate
from zerostate.engine.config import EngineConfig
from zerostate.errors import ConfigError

STEPS = 10
TOL = 1e-6  # fused host AdamW vs foreach: rounding only; SGD and Muon: the same arithmetic


def _optimizer(model, kind: str):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    assert kind == "muon"
    return [torch.optim.Muon(matrices, lr=0.02, momentum=0.9), torch.optim.AdamW(rest)]


def _run(stage: int, offload, kind: str, rank: int, world_size: int) -> dict:
    model = make_model()
    if kind == "adamw":  # the built-in AdamW, with clipping and accumulation
        engine = make_engine(
            model, stage=stage, offload=offload, grad_clip=0.05, grad_accum_steps=2
        )
        engine_steps(engine, rank, world_size, STEPS, accum=2)
        assert engine.last_grad_norm > 0.05  # clipping was active
    elif kind == "sgd_fp16":  # 16-bit working copy, separate masters, dynamic loss scale
        opt = _optimizer(model, "sgd")
        engine = zerostate.Engine(
            model, stage=stage, offload=offload, optimizer=opt, precision="fp16", grad_clip=0.5
        )
        engine_steps(engine, rank, world_size, STEPS)
        assert engine.loss_scale > 1.0
    else:
        opt = _optimizer(model, kind)
        engine = zerostate.Engine(model, stage=stage, offload=offload, optimizer=opt)
        engine_steps(engine, rank, world_size, STEPS)
    if offload is not None:
        stats = engine.memory_stats()
        assert stats["device_optimizer_bytes"] == 0, stats
        assert all(sp.master.device.type == "cpu" for sp in engine._trainable)
    return engine.full_state_dict()


def _parity_worker(rank: int, world_size: int) -> dict:
    worst = {}
    for stage in (1, 2, 3):
        for kind in ("adamw", "sgd", "muon", "sgd_fp16"):
            base = _run(stage, None, kind, rank, world_size)
            modes = ["optimizer"] + (["params"] if stage == 3 and kind == "adamw" else [])
            for mode in modes:
                got = _run(stage, mode, kind, rank, world_size)
                worst[(stage, kind, mode)] = max(
                    (got[n] - base[n]).abs().max().item() for n in base
                )
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_offload_matches_device_step(world_size: int) -> None:
    results = run_distributed(_parity_worker, world_size, timeout=600)
    worst = results[0]
    assert len(worst) == 3 * 4 + 1
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, bad
    # SGD runs the same arithmetic on the host: bitwise (fp16 loss scaling included).
    assert all(v == 0.0 for (_, kind, _), v in worst.items() if "sgd" in kind), worst


def test_offload_settings_are_validated() -> None:
    assert EngineConfig(stage=1, offload="optimizer").offload == "optimizer"
    assert EngineConfig(stage=3, offload="params", offload_threads=2).offload_threads == 2
    with pytest.raises(ConfigError, match="stage 1, 2 or 3"):
        EngineConfig(stage=0, offload="optimizer")
    with pytest.raises(ConfigError, match="only stage 3 partitions"):
        EngineConfig(stage=2, offload="params")
    with pytest.raises(ConfigError, match="not an offload mode"):
        EngineConfig(stage=2, offload="cpu")
    with pytest.raises(ConfigError, match="offload_threads"):
        EngineConfig(stage=2, offload="optimizer", offload_threads=0)


def _tiers_and_save_worker(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for stage, offload in ((2, "optimizer"), (1, None), (3, "params")):
        engine = make_engine(make_model(), stage=stage, offload=offload, offload_threads=1)
        numel = sum(sp.numel for sp in engine._trainable)
        stats = engine.memory_stats()
        out[("tiers", stage, offload)] = (stats, numel)
        engine_steps(engine, rank, world_size, 3)
        engine.save(f"{root}/{stage}-{offload}")
        out[("state", stage, offload)] = engine.full_state_dict()
        out[("optim", stage, offload)] = engine._optimizer.metadata()["param_groups"]
    return out


def _load_worker(rank: int, world_size: int, root: str) -> dict:
    out = {}
    # Saved with offload, loaded without (and the reverse), at another world size and stage.
    for saved, stage, offload in (
        ("2-optimizer", 3, None),
        ("1-None", 2, "optimizer"),
        ("3-params", 1, "optimizer"),
    ):
        engine = make_engine(make_model(seed=5), stage=stage, offload=offload)
        engine.load(f"{root}/{saved}")
        out[saved] = engine.full_state_dict()
        engine_steps(engine, rank, world_size, 2, first_step=3)
        out[(saved, "trained")] = engine.full_state_dict()
        out[(saved, "steps")] = engine.optimizer_steps
    return out


@pytest.mark.filterwarnings("ignore:offload_threads has no effect")
def test_tiers_and_checkpoints_across_offload(tmp_path) -> None:
    root = str(tmp_path)
    saved = run_distributed(_tiers_and_save_worker, 2, root, timeout=300)[0]
    for stage, offload in ((2, "optimizer"), (1, None), (3, "params")):
        stats, numel = saved[("tiers", stage, offload)]
        per_rank = numel / 2
        if offload is None:
            assert stats["host_bytes"] == 0 and stats["host_optimizer_bytes"] == 0
            assert stats["device_optimizer_bytes"] == stats["optim_states"] > 0
            continue
        assert stats["device_optimizer_bytes"] == 0, stats
        assert stats["device_bytes"] + stats["host_bytes"] == stats["total"]
        if offload == "optimizer":  # fp32 master + two moments; + the host gradient shard
            assert abs(stats["host_optimizer_bytes"] / (12 * per_rank) - 1) < 0.05, stats
            assert abs(stats["host_bytes"] / (16 * per_rank) - 1) < 0.05, stats
        else:  # the host shard is the fp32 master; two moments; the host gradient shard
            assert abs(stats["host_bytes"] / (16 * per_rank) - 1) < 0.05, stats
            assert (
                stats["params"] == stats["host_bytes"] - stats["host_grads"] - stats["optim_states"]
            )
    # What is saved does not name the kernel the step ran with.
    assert saved[("optim", 2, "optimizer")] == saved[("optim", 1, None)]

    loaded = run_distributed(_load_worker, 3, root, timeout=300)[0]
    for name, key in (("2-optimizer", (2, "optimizer")), ("1-None", (1, None)),
                      ("3-params", (3, "params"))):  # fmt: skip
        ref = saved[("state", *key)]
        assert all(torch.equal(loaded[name][n], ref[n]) for n in ref), name
        assert loaded[(name, "steps")] == 5
        moved = max((loaded[(name, "trained")][n] - ref[n]).abs().max().item() for n in ref)
        assert moved > 0
    # Resumed with and without offload from equal states: the same training.
    a, b = loaded[("2-optimizer", "trained")], loaded[("3-params", "trained")]
    ra, rb = saved[("state", 2, "optimizer")], saved[("state", 3, "params")]
    assert all(torch.allclose(ra[n], rb[n], atol=TOL, rtol=0) for n in ra)
    assert all(torch.allclose(a[n], b[n], atol=1e-5, rtol=0) for n in a)


def _rss_worker(rank: int, world_size: int, root: str) -> list[int]:
    import gc

    import psutil

    proc = psutil.Process()
    model = make_model(n_embd=256, n_layer=4, vocab_size=512)  # ~3.3M parameters
    engine = make_engine(model, stage=2, offload="optimizer")
    rss = []
    for step in range(20):
        engine_steps(engine, rank, world_size, 1, first_step=step)
        engine.save(root, keep_last=2)
        gc.collect()
        rss.append(proc.memory_info().rss)
    return [*rss, engine.memory_stats()["host_bytes"]]


def test_host_memory_is_flat_across_saves(tmp_path) -> None:
    *rss, host_bytes = run_distributed(_rss_worker, 1, str(tmp_path), timeout=400)[0]
    assert host_bytes > 40e6  # the offloaded state is large enough for a leak to show
    # RSS wobbles by a few tens of MB from save to save (allocator caching); a leak of the
    # saved state would add one copy of it per save, 10 copies over the last 10 saves.
    # Measured: +15 MB from the first 10 saves' peak to the last 10's, for 52 MB of state.
    growth = max(rss[10:]) - max(rss[:10])
    assert growth < host_bytes, (growth, rss)


def test_host_buffers_without_an_accelerator_are_unpinned_with_one_log_line(caplog) -> None:
    from zerostate.runtime import offload

    assert torch.accelerator.current_accelerator() is None  # this suite runs on CPU
    offload._warned_unpinned = False
    with caplog.at_level("INFO", logger="zerostate.runtime.offload"):
        first = offload.host_empty(8, torch.float32)
        second = offload.to_host(torch.arange(4.0))
    assert not first.is_pinned() and torch.equal(second, torch.arange(4.0))
    lines = [r for r in caplog.records if "not pinned" in r.getMessage()]
    assert len(lines) == 1


def test_offload_threads_apply_to_the_step_only() -> None:
    from zerostate.runtime.offload import HostTier

    tier = HostTier([], [], device=torch.device("cpu"), params_too=False, threads=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with tier.step_threads():
            inside = torch.get_num_threads()
        assert inside == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _copy_timing_worker(rank: int, world_size: int) -> dict:
    from zerostate.runtime.offload import HostTier

    calls: list[tuple[int, bool]] = []
    original = HostTier.copy_group

    def recording(self, key, positions, grads):
        calls.append((key, torch._C._current_graph_task_id() != -1))  # inside backward?
        return original(self, key, positions, grads)

    HostTier.copy_group = recording
    out = {}
    try:
        for stage in (1, 2, 3):
            engine = make_engine(
                make_model(n_layer=4), stage=stage, offload="optimizer", bucket_mb=0.01,
                grad_accum_steps=2,
            )  # fmt: skip
            calls.clear()
            engine_steps(engine, rank, world_size, 2, accum=2)
            groups = len(engine._runtime.reduced_groups())
            out[stage] = (list(calls), groups)
    finally:
        HostTier.copy_group = original
    return out


def test_gradient_copies_start_while_backward_runs() -> None:
    """Each group's reduced gradients leave for the host from its reduce's completion hook,
    once per optimizer step (on the accumulation boundary), most of them inside backward."""
    from zerostate.dist.comm import MAX_IN_FLIGHT

    out = run_distributed(_copy_timing_worker, 2, timeout=300)
    for rank_out in out:
        for stage, (calls, groups) in rank_out.items():
            assert groups >= 5, (stage, groups)  # small buckets, or 4 blocks + root
            assert len(calls) == 2 * groups, (stage, calls)  # 2 steps, each group once
            for step_calls in (calls[:groups], calls[groups:]):
                assert sorted(k for k, _ in step_calls) == sorted({k for k, _ in step_calls})
                inside = sum(during for _, during in step_calls)
                # Only the last launches can still be pending when backward returns (at
                # stage 3 the root's reduce is launched only then, completing one more).
                assert inside >= groups - MAX_IN_FLIGHT - (stage == 3), (stage, step_calls)


def _predivided_worker(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (1, 2):
        for offload in (None, "optimizer"):
            model = make_model()
            engine = zerostate.Engine(
                model, stage=stage, offload=offload, optimizer=_optimizer(model, "sgd"),
                precision="fp16", reduce_dtype="fp16", grad_clip=0.5,
            )  # fmt: skip
            assert engine._ctx.predivide == 2.0  # 4 ranks: fp16 sums are kept halved
            engine_steps(engine, rank, world_size, 3)
            out[(stage, offload)] = engine.full_state_dict()
    return out


def test_offload_multiplies_back_predivided_fp16_sums_alike() -> None:
    out = run_distributed(_predivided_worker, 4, timeout=300)[0]
    for stage in (1, 2):
        base, got = out[(stage, None)], out[(stage, "optimizer")]
        assert all(torch.equal(got[n], base[n]) for n in base), stage  # SGD: bitwise
