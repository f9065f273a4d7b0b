"""One rank's storage fails while the others succeed, during a save (blocking and async)
and during a load, at 2-4 ranks: every rank raises a clear error within a bounded time
(nobody waits for the commit or process-group timeout), and the previous committed step
still loads. Also: ranks saving different steps, and a real disk filling up (tmpfs)."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers_dist import run_distributed  # noqa: E402

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks fail, fill
# disks and set the commit timeout in the environment. Each call forks new processes ([Note:
# forked workers] in tests/fork_server.py); nothing here needs a new interpreter, so the ranks are
# not spawned.

#: Every rank must have raised within this many seconds of the failure.
BOUND_S = 30.0
#: The commit timeout the ranks run with: far above BOUND_S, so meeting the bound cannot
#: come from waiting it out.
COMMIT_TIMEOUT_S = "300"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def _train_step(engine) -> None:
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(engine.optimizer_steps))
    engine.backward(engine(x).square().mean())
    engine.step()


@contextlib.contextmanager
def _failing_storage(root: str, mode: str, err: int, only: str = ""):
    """Opening a file under ``root`` for writing (mode "w") or reading ("r") fails with
    ``err``: below the store, so it hits whatever objects the format writes or reads."""
    real_os_open, real_open, real_io_open = os.open, builtins.open, io.open
    root = os.path.realpath(root)

    def hit(path, writing: bool) -> bool:
        try:
            path = os.path.realpath(os.fspath(path))
        except TypeError:
            return False
        inside = path.startswith(root + os.sep) and only in path
        return inside and writing == (mode == "w")

    def os_open(path, flags, *args, **kwargs):
        if hit(path, bool(flags & (os.O_WRONLY | os.O_RDWR))):
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    def py_open(file, open_mode="r", *args, **kwargs):
        writing = any(c in open_mode for c in "wax+")
        if isinstance(file, (str, bytes, os.PathLike)) and hit(file, writing):
            raise OSError(err, os.strerror(err), os.fspath(file))
        return real_open(file, open_mode, *args, **kwargs)

    os.open, builtins.open, io.open = os_open, py_open, py_open
    try:
        yield
    finally:
        os.open, builtins.open, io.open = real_os_open, real_open, real_io_open


def _outcome(fn) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the outcome is what the test inspects
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def _worker(rank: int, world_size: int, root: str, stage: int, failing_rank: int) -> dict:
    import zerostate
    from zerostate.store import open_checkpoint, remove_partial_steps

    os.environ["ZEROSTATE_COMMIT_TIMEOUT_S"] = COMMIT_TIMEOUT_S
    engine = zerostate.Engine(_model(), stage=stage, lr=1e-2)
    _train_step(engine)
    engine.save(root)  # step 1: the good step that must survive
    reference = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _train_step(engine)
    out = {}
    scenarios = [
        ("save, disk full", "w", errno.ENOSPC, lambda: engine.save(root)),
        ("save, permission denied", "w", errno.EACCES, lambda: engine.save(root, step=5)),
        ("load, I/O error", "r", errno.EIO, lambda: engine.load(root, step=1)),
        # Background writes cannot use collectives: the failing rank's abort note (written
        # where its data rows failed: here only the model rows) tells the others.
        ("async save, data rows refused", "w", errno.EACCES,
         lambda: engine.save(root, step=6, blocking=False).wait()),
    ]  # fmt: skip
    for name, mode, err, action in scenarios:
        only = f"{os.sep}model{os.sep}" if name.startswith("async") else ""
        if rank == failing_rank:
            with _failing_storage(root, mode, err, only):
                out[name] = _outcome(action)
        else:
            out[name] = _outcome(action)
        # Clean up only once every rank is done with the scenario: removing a step that
        # another rank still waits on is a misuse (remove_partial_steps says so).
        zerostate.dist.collectives.barrier(group=None)
        remove_partial_steps(root) if rank == 0 else None
        zerostate.dist.collectives.barrier(group=None)
    # Ranks that disagree on the step number fail together, before anything is written.
    out["different steps"] = _outcome(lambda: engine.save(root, step=10 + rank))
    # The good step still loads everywhere and holds what was saved.
    engine.load(root, step=1)
    state = engine.full_state_dict()
    out["reloaded equal"] = all(torch.equal(state[k], v) for k, v in reference.items())
    out["steps"] = open_checkpoint(root).steps()
    engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size,stage", [(2, 2), (3, 3), (4, 1)])
def test_one_rank_failing_fails_every_rank_quickly(tmp_path, world_size, stage):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_worker, world_size, root, stage, world_size - 1, timeout=600)
    for name in ("save, disk full", "save, permission denied", "load, I/O error",
                 "async save, data rows refused", "different steps"):  # fmt: skip
        for rank, result in enumerate(results):
            kind, message, elapsed = result[name]
            assert kind != "ok", f"{name}: rank {rank} did not fail"
            assert elapsed < BOUND_S, f"{name}: rank {rank} took {elapsed:.1f} s to fail"
            assert message, f"{name}: rank {rank} raised {kind} without a message"
        failing = results[world_size - 1][name]
        if name != "different steps":
            # The rank that failed names its own cause; the others name the failed rank.
            cause = {"disk full": "No space", "permission": "ermission", "I/O": "Input/output",
                     "refused": "ermission"}  # fmt: skip
            assert any(v in failing[1] for k, v in cause.items() if k in name), failing
            for rank in range(world_size - 1):
                assert f"{world_size - 1}" in results[rank][name][1], results[rank][name]
    for result in results:
        assert result["reloaded equal"] and result["steps"] == [1]


@pytest.mark.slow
def test_a_real_full_disk_fails_the_save_cleanly(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, f"cannot mount a tmpfs for the disk-full test: {proc.stderr}"
    try:
        results = run_distributed(_disk_full_worker, 2, str(mount / "ckpt"), timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    for kind, message, elapsed in results:
        assert kind != "ok" and elapsed < BOUND_S, (kind, message, elapsed)
        assert "No space" in message or "rank" in message, message


def _disk_full_worker(rank: int, world_size: int, root: str) -> tuple[str, str, float]:
    import zerostate
    from zerostate.store import open_checkpoint

    os.environ["ZEROSTATE_COMMIT_TIMEOUT_S"] = COMMIT_TIMEOUT_S
    torch.manual_seed(0)
    small = torch.nn.Linear(8, 8)
    engine = zerostate.Engine(small, stage=2)
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.save(root)  # fits
    big = zerostate.Engine(torch.nn.Linear(1024, 1024), stage=2)  # 12 MiB of state
    outcome = _outcome(lambda: big.save(root + "-big", step=2))  # same full disk
    if rank == 0:
        assert open_checkpoint(root).steps() == [1]
        assert open_checkpoint(root).step(1).verify() is None
    engine.close()
    big.close()
    return outcome
