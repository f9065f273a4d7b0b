"""Habits DeepSpeed and FSDP users bring, each of which used to be silent or hang: a
scheduler on the optimizer they built, ``opt.step()``, a load without ``stateful=``, a fresh
run saving into an old run's root, a save under ``if rank == 0:``, a second Engine on the
same model, ``lr=`` next to ``optimizer=``."""

from __future__ import annotations

import logging
import time
import warnings

import pytest
import torch
from common import batch, local, log_messages, make_model
from helpers_dist import WorkerError, run_distributed

import zerostate
from zerostate.errors import CheckpointError, CollectiveTimeoutError, ConfigError


def _lambda(step: int) -> float:
    return (step + 1) / 4


def _train(engine, steps: int, rank: int, world_size: int, sched=None, via=None) -> None:
    for s in range(steps):
        x, y = batch(s, 0)
        engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
        (via or engine).step()
        if sched is not None:
            sched.step()


def _scheduler_on_user_optimizer(rank: int, world_size: int, stage: int) -> dict:
    model = make_model()
    reference = make_model()  # same seed: same initial weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched_first = None
    if stage == 3:  # a scheduler built before the engine works too
        sched_first = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    engine = zerostate.Engine(model, stage=stage, optimizer=opt)
    sched = sched_first or torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _lambda)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            x, y = batch(s, 0)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            opt.step() if s % 2 else engine.step()  # opt.step() is engine.step()
            sched.step()
            lrs.append((engine.optimizer.param_groups[0]["lr"], opt.param_groups[0]["lr"]))
            ref_opt.zero_grad()
            reference(x, y).backward()
            ref_opt.step()
            ref_sched.step()
    full = engine.full_state_dict()
    ref = reference.state_dict()
    err = max((full[n] - ref[n]).abs().max().item() for n, _ in reference.named_parameters())
    try:
        opt.step(closure=lambda: 0.0)
        closure_error = ""
    except ConfigError as exc:
        closure_error = str(exc)
    return {
        "lrs": lrs,
        "ref_lrs": ref_sched.get_last_lr(),
        "steps": engine.optimizer_steps,
        "err": err,
        "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        "closure_error": closure_error,
        "isinstance": isinstance(opt, torch.optim.AdamW),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_scheduler_on_the_users_optimizer_drives_the_engine(stage: int) -> None:
    r = run_distributed(_scheduler_on_user_optimizer, 2, stage)[0]
    expected = [0.01 * _lambda(s + 1) for s in range(3)]
    assert [a for a, _ in r["lrs"]] == pytest.approx(expected)
    assert [b for _, b in r["lrs"]] == pytest.approx(expected)
    assert r["ref_lrs"][0] == pytest.approx(expected[-1])
    assert r["steps"] == 3
    assert r["err"] < 1e-5, r["err"]  # the same trajectory as torch with the same schedule
    assert r["warnings"] == []
    assert "engine.step()" in r["closure_error"]
    assert r["isinstance"]


def _lr_with_optimizer(rank: int, world_size: int) -> str:
    model = make_model()
    try:
        zerostate.Engine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), lr=0.5)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_lr_next_to_optimizer_names_the_fix() -> None:
    message = run_distributed(_lr_with_optimizer, 1)[0]
    assert "lr=0.5" in message and "optimizer=SGD" in message
    assert "drop them from Engine(...)" in message


def _load_without_stateful(rank: int, world_size: int, root: str) -> dict:
    with log_messages() as records:
        return _load_without_stateful_logged(records, root, rank, world_size)


def _load_without_stateful_logged(records: list[str], root: str, rank: int, world_size: int):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = zerostate.Engine(model, stage=2, optimizer=opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    _train(engine, 2, rank, world_size, sched)
    engine.save(root, stateful={"scheduler": sched})

    fresh_model = make_model()
    fresh = zerostate.Engine(
        fresh_model, stage=2, optimizer=torch.optim.AdamW(fresh_model.parameters())
    )
    fresh.load(root)
    try:
        fresh.load(root, strict_state=True)
        strict_error = ""
    except CheckpointError as exc:
        strict_error = str(exc)
    again = make_model()
    sched2 = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(again.parameters()), _lambda)
    records_before = len(records)
    zerostate.Engine(again, stage=2, optimizer=sched2.optimizer).load(
        root, stateful={"scheduler": sched2}, strict_state=True
    )
    return {
        "records": records[:records_before],
        "after_full_load": records[records_before:],
        "strict_error": strict_error,
        "epoch": sched2.last_epoch,
    }


def test_load_without_stateful_says_what_it_left(tmp_path) -> None:
    results = run_distributed(_load_without_stateful, 2, str(tmp_path / "ckpt"))
    first, second = results
    left = [m for m in first["records"] if "unrestored" in m]
    assert len(left) == 1 and "stateful['scheduler']" in left[0], first["records"]
    assert not [m for m in second["records"] if "unrestored" in m]  # rank 0 only
    for r in results:
        assert "stateful['scheduler']" in r["strict_error"]
        assert r["after_full_load"] == [] and r["epoch"] == 2


def _fresh_run_into_old_root(rank: int, world_size: int, root: str) -> dict:
    old = zerostate.Engine(make_model(), stage=1)
    _train(old, 1, rank, world_size)
    for step in (8, 12):
        old.save(root, step=step)
    fresh = zerostate.Engine(make_model(), stage=1)
    _train(fresh, 1, rank, world_size)
    try:
        fresh.save(root, step=4)
        refusal = ""
    except ConfigError as exc:
        refusal = str(exc)
    fresh.save(root, step=5, allow_older_step=True)
    resumed = zerostate.Engine(make_model(), stage=1)
    resumed.load(root)  # step 12: this engine now continues that run
    resumed.save(root, step=9)  # rewinding its own run is allowed
    return {"refusal": refusal, "steps": zerostate.store.open_checkpoint(root).steps()}


def test_fresh_run_saving_into_an_old_root_is_refused(tmp_path) -> None:
    for r in run_distributed(_fresh_run_into_old_root, 2, str(tmp_path / "ckpt")):
        assert "committed step 12" in r["refusal"] and "step 4" in r["refusal"], r["refusal"]
        assert "allow_older_step=True" in r["refusal"]
        assert r["steps"] == [5, 8, 9, 12]


def _rank0_only_save(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    engine = zerostate.Engine(make_model(), stage=2, collective_timeout_s=3.0)
    _train(engine, 1, rank, world_size)
    out: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            engine.save(root)
        except CollectiveTimeoutError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - t0
        store.set("test/rank0_gave_up", "1")
    else:
        store.wait(["test/rank0_gave_up"])
        try:  # too late: rank 0 gave up on this call; this rank must not enter it alone
            engine.save(root)
        except CollectiveTimeoutError as exc:
            out["error"] = str(exc)
    engine.save(root)  # every rank: works, the calls are back in step
    out["steps"] = zerostate.store.open_checkpoint(root).steps()
    return out


# New (forked) processes, never pooled workers: one rank gives up on a collective that the
# other never enters, and the ranks signal each other through a key in the default group's
# store.
def test_rank0_only_save_fails_within_the_bound(tmp_path) -> None:
    first, second = run_distributed(_rank0_only_save, 2, str(tmp_path / "ckpt"), timeout=180)
    assert "rank(s) 1 of 2 did not enter it" in first["error"], first
    assert first["error"].startswith("save is collective")
    assert 2.5 < first["seconds"] < 60, first["seconds"]
    assert "did not enter" in second["error"]
    assert first["steps"] == second["steps"] == [1]


def _double_wrap(rank: int, world_size: int) -> list[str]:
    model = make_model()
    engine = zerostate.Engine(model, stage=2)
    messages = []
    try:
        zerostate.Engine(model, stage=2)
    except ConfigError as exc:
        messages.append(str(exc))
    del engine
    zerostate.Engine(model, stage=2)  # the first engine is gone: its hooks are inert
    sharded = make_model()
    engine3 = zerostate.Engine(sharded, stage=3)
    del engine3
    try:
        zerostate.Engine(sharded, stage=3)
    except ConfigError as exc:
        messages.append(str(exc))
    return messages


def test_second_engine_on_the_same_model_is_refused() -> None:
    try:
        messages = run_distributed(_double_wrap, 2)[0]
    except WorkerError as exc:  # show the traceback of the rank that failed
        raise AssertionError(str(exc)) from None
    assert len(messages) == 2, messages
    assert "already wrapped by a zerostate Engine (stage 2)" in messages[0]
    assert "stage-3 Engine, which partitioned its parameters" in messages[1]


def _progress_and_mismatched_calls(rank: int, world_size: int, root: str) -> dict:
    with log_messages("zerostate.engine", logging.INFO) as lines:
        return _progress_and_mismatched_calls_logged(lines, root, rank, world_size)


def _progress_and_mismatched_calls_logged(lines: list[str], root: str, rank: int, world_size: int):
    from zerostate.errors import DistributedMismatchError

    engine = zerostate.Engine(make_model(), stage=2, log_every=2, grad_accum_steps=2)
    for s in range(4):
        for micro in range(2):
            x, y = batch(s, micro)
            engine.backward(engine(local(x, rank, world_size), local(y, rank, world_size)))
            engine.step()
    try:  # ranks in different collective calls: both fail, naming both calls
        engine.save(root) if rank == 0 else engine.full_state_dict()
        mismatch = ""
    except DistributedMismatchError as exc:
        mismatch = str(exc)
    zerostate.dist.collectives.barrier(group=None)  # rank 0 hosts the store: let rank 1 finish
    return {"lines": lines, "mismatch": mismatch}


def test_progress_line_and_ranks_in_different_calls(tmp_path) -> None:
    first, second = run_distributed(_progress_and_mismatched_calls, 2, str(tmp_path / "c"))
    assert len(first["lines"]) == 2 and second["lines"] == []  # rank 0 only, every 2 steps
    line = first["lines"][-1]
    assert line.startswith("step 4, loss "), line
    for part in ("step time", "samples/s", "tokens/s", "lr 0.001", "grad norm", "MiB/rank"):
        assert part in line, line
    for r in (first, second):
        assert "called" in r["mismatch"] and "save" in r["mismatch"], r["mismatch"]
        assert "full_state_dict" in r["mismatch"]


def _shape_mismatch(rank: int, world_size: int, root: str) -> str:
    zerostate.Engine(make_model(), stage=1).save(root)
    wider = zerostate.Engine(make_model(n_embd=48), stage=1)
    try:
        wider.load(root)
    except CheckpointError as exc:
        return str(exc)
    return ""


def test_shape_mismatch_lists_every_tensor(tmp_path) -> None:
    message = run_distributed(_shape_mismatch, 1, str(tmp_path / "ckpt"))[0]
    count = int(message.split(": ")[1].split(" tensor(s)")[0])
    assert count > 10 and f"and {count - 10} more" in message, message
    assert message.count("(checkpoint (") == 10, message
    assert "model/transformer.wte.weight (checkpoint (64, 32), model (64, 48))" in message


def _last_call_then_exit(rank: int, world_size: int) -> str:
    # Rank 1 arrives first and sleeps in its poll; rank 0 (hosting the store under a plain
    # init_process_group) arrives later, and its worker exits right after the call.
    engine = zerostate.Engine(make_model(), stage=0)
    if rank == 0:
        time.sleep(1.5)
    state = engine.full_state_dict()
    return f"{len(state)} tensors"


# New (forked) processes, never pooled workers: what it checks is each worker exiting right
# after its last call, which a forked worker does as a spawned one would (the store's host
# goes away with its process either way).
def test_store_host_does_not_leave_before_the_others_read_the_verdict() -> None:
    for _ in range(3):
        results = run_distributed(_last_call_then_exit, 2, timeout=120)
        assert results[0] == results[1] and results[0].endswith("tensors"), results
