"""The object store misbehaves: a proxy delays, fails (503 SlowDown) or drops a seeded
fraction of requests, and the server is killed in the middle of a save and restarted.
Every save either commits a step that verifies or raises a clear StorageError/
CheckpointError in bounded time; committed steps are never damaged; loads return exact
data or a clear error."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _proxy import FaultyProxy  # noqa: E402
from seaweed import start_seaweedfs, stop_seaweedfs  # noqa: E402

from zerostate.errors import CheckpointError  # noqa: E402
from zerostate.store import open_checkpoint, remove_partial_steps, save_tensors  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (64, 129), "b": (129,), "c": (7, 3, 5), "s": ()}
    return {f"{state}/{n}": torch.randn(s, generator=g)
            for state in ("model", "optim/exp_avg") for n, s in shapes.items()}  # fmt: skip


def _options(server, endpoint_url: str) -> dict:
    opts = dict(server.storage_options)
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=endpoint_url)
    # Short client timeouts so a dropped connection costs seconds, not a minute.
    opts["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 5,
                             "retries": {"max_attempts": 1, "mode": "standard"}}  # fmt: skip
    return opts


def _assert_committed_intact(root: str, opts: dict, expected: dict[int, dict]) -> list[int]:
    reader = open_checkpoint(root, storage_options=opts)
    committed = reader.steps()
    for step in committed:
        st = reader.step(step)
        st.verify()
        for name, value in expected[step].items():
            assert torch.equal(st.read(name), value), (step, name)
    return committed


def test_flaky_object_store_never_damages_a_step(s3_server, capsys):
    bucket, _ = s3_server.new_bucket("flaky")
    direct = _options(s3_server, s3_server.endpoint_url)
    upstream = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    outcomes = {"committed": 0, "clean error": 0, "load exact": 0, "load clean error": 0}
    expected: dict[int, dict] = {}
    with FaultyProxy(upstream, seed=7, error_rate=0.08, drop_rate=0.04, delay_rate=0.1,
                     delay_s=0.3) as proxy:  # fmt: skip
        flaky = _options(s3_server, proxy.endpoint_url)
        root = f"s3://{bucket}/run"
        for step in range(1, 9):
            expected[step] = _tensors(step)
            t0 = time.monotonic()
            try:
                save_tensors(root, step, expected[step], world_size=3, storage_options=flaky)
                outcomes["committed"] += 1
            except CheckpointError:  # StorageError and friends: clear, never a hang
                outcomes["clean error"] += 1
                remove_partial_steps(root, storage_options=direct)
            assert time.monotonic() - t0 < 240, "a save must end in bounded time"
            committed = _assert_committed_intact(root, direct, expected)
            try:
                st = open_checkpoint(root, storage_options=flaky).step(max(committed))
                for name, value in expected[st.step].items():
                    assert torch.equal(st.read(name), value), name
                outcomes["load exact"] += 1
            except CheckpointError:
                outcomes["load clean error"] += 1
        counts = dict(proxy.counts)
    with capsys.disabled():
        print(f"\nflaky S3: {outcomes}; proxy: {counts}")
    assert counts["503"] and counts["dropped"] and counts["delayed"]
    # Retries must make most saves succeed at these rates; every failure was clean.
    assert outcomes["committed"] >= 5, outcomes


def test_server_killed_mid_save_and_restarted(tmp_path):
    server = start_seaweedfs(tmp_path)
    try:
        bucket, _ = server.new_bucket("restart")
        opts = _options(server, server.endpoint_url)
        root = f"s3://{bucket}/run"
        first = _tensors(1)
        save_tensors(root, 1, first, world_size=2, storage_options=opts)
        big = {f"model/w{i}": torch.randn(256, 1024) for i in range(24)}  # ~24 MiB to upload
        error: list[BaseException] = []

        def save() -> None:
            try:
                save_tensors(root, 2, big, world_size=2, storage_options=opts)
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=save)
        t0 = time.monotonic()
        thread.start()
        time.sleep(1.0)  # the upload is under way
        stop_seaweedfs(server)
        thread.join(timeout=300)
        assert not thread.is_alive(), "the save must give up in bounded time"
        elapsed = time.monotonic() - t0
        server = start_seaweedfs(tmp_path, server.ports)  # same data directory and ports
        if error:
            assert isinstance(error[0], CheckpointError), repr(error[0])
        committed = _assert_committed_intact(root, opts, {1: first, 2: big})
        assert 1 in committed
        if 2 not in committed:
            remove_partial_steps(root, storage_options=opts)
            save_tensors(root, 2, big, world_size=2, storage_options=opts)
        assert _assert_committed_intact(root, opts, {1: first, 2: big}) == [1, 2]
        print(
            f"server killed mid-save: save ended after {elapsed:.1f} s with "
            f"{type(error[0]).__name__ if error else 'success'}"
        )
    finally:
        stop_seaweedfs(server)
