"""Several processes write one step; the step reads back at other world sizes and with
plain zarr; a rank that dies mid-save leaves earlier steps intact."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zarr
from _store_helpers import (
    doc_snippet_read_tensor,
    make_specs,
    make_tensors,
    owned_shards,
    raw_bytes,
)
from helpers_dist import free_port  # [Note: free ports]

from zerostate.errors import CheckpointError, CheckpointNotFoundError, CommitTimeoutError
from zerostate.layout.partition import plan_layouts
from zerostate.store import StepWriter, open_checkpoint, remove_partial_steps

WORKER = Path(__file__).with_name("_store_worker.py")


def _spawn(mode: str, root: Path, rank: int, world_size: int, port: int) -> subprocess.Popen:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(root), str(rank), str(world_size), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _run_ranks(mode: str, root: Path, world_size: int) -> list[tuple[int, str]]:
    port = free_port()
    procs = [_spawn(mode, root, r, world_size, port) for r in range(world_size)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        results.append((proc.returncode, out.decode(errors="replace")[-3000:]))
    return results


@pytest.fixture(scope="module")
def three_rank_step(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multirank") / "ckpt"
    for code, out in _run_ranks("save", root, 3):
        assert code == 0, out
    return root


@pytest.mark.slow
def test_plain_zarr_sees_every_tensor(three_rank_step):
    tensors = make_tensors(seed=1)
    url = str(three_rank_step / "step-00000001")
    group = zarr.open_group(url, mode="r")
    read_tensor = doc_snippet_read_tensor()
    for name, t in tensors.items():
        got = read_tensor(url, name)
        assert list(got.shape) == list(t.shape) and got.tobytes() == raw_bytes(t), name
    assert isinstance(group["model"], zarr.Array) and group["model"].shape[0] == 3


@pytest.mark.slow
@pytest.mark.parametrize("new_world_size", [1, 2, 4, 5])
def test_reads_back_at_any_world_size(three_rank_step, new_world_size):
    tensors = make_tensors(seed=1)
    st = open_checkpoint(str(three_rank_step)).step()
    assert st.world_size == 3 and st.attrs == {"written_by": 3}
    names = list(st.tensors)
    layouts = plan_layouts([st.tensors[n].numel for n in names], new_world_size, 8)
    for name, layout in zip(names, layouts, strict=True):
        pieces = []
        for rank in range(new_world_size):  # each new rank reads only its own range
            start, stop = layout.owned_range(rank)
            pieces.append((start, st.read_range(name, start, stop)))
        flat = torch.empty(layout.numel, dtype=st.tensors[name].dtype)
        for start, piece in pieces:
            flat[start : start + piece.numel()] = piece
        assert torch.equal(flat.reshape(tensors[name].shape), tensors[name]), name


@pytest.mark.slow
def test_rank_killed_mid_save(tmp_path):
    root = tmp_path / "ckpt"
    tensors = make_tensors(seed=1)
    specs = make_specs(tensors, 3)
    # step 1: a complete save
    for rank in (1, 2, 0):
        w = StepWriter(str(root), 1, rank=rank, world_size=3, specs=specs)
        w.write(owned_shards(tensors, specs, rank))
        w.commit(wait=False)
    # step 2: rank 2 completes, rank 1 dies after its first chunk, rank 0 waits in vain
    w2 = StepWriter(str(root), 2, rank=2, world_size=3, specs=specs)
    w2.write(owned_shards(tensors, specs, 2))
    proc = _spawn("crash", root, 1, 3, 0)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 17, out.decode(errors="replace")
    chunk_files = [p for p in (root / "step-00000002").rglob("c/*")]
    assert chunk_files, "the crashed rank should have written something"
    assert not (root / "step-00000002/_zerostate/manifests/rank-00001/zarr.json").exists()
    w0 = StepWriter(str(root), 2, rank=0, world_size=3, specs=specs, timeout_s=1.0)
    w0.write(owned_shards(tensors, specs, 0))
    with pytest.raises(CommitTimeoutError, match=r"ranks \[1\]"):
        w0.commit()

    reader = open_checkpoint(str(root))
    assert reader.steps() == [1] and reader.latest_step() == 1
    with pytest.raises(CheckpointNotFoundError):
        reader.step(2)
    st = reader.step()
    for name, t in tensors.items():
        assert torch.equal(st.read(name), t), name
    st.verify()
    assert remove_partial_steps(str(root)) == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    assert open_checkpoint(str(root)).step(1).step == 1


@pytest.mark.parametrize("waiting_rank", [0, 1])
def test_step_removed_during_the_wait_fails_the_waiter_at_once(tmp_path, waiting_rank):
    """A cleanup that deletes the step while a rank waits for the commit (rank 0 for the
    manifests, another rank for the commit record) ends the wait with a clear error, not
    at the commit timeout."""
    root = tmp_path / "ckpt"
    tensors = make_tensors(seed=1)
    specs = make_specs(tensors, 3)
    manifest = root / f"step-00000001/_zerostate/manifests/rank-{waiting_rank:05d}/zarr.json"
    writer = StepWriter(str(root), 1, rank=waiting_rank, world_size=3, specs=specs, timeout_s=60)
    writer.write(owned_shards(tensors, specs, waiting_rank))
    outcome: dict[str, object] = {}

    def wait() -> None:
        t0 = time.monotonic()
        try:
            writer.commit()
        except Exception as exc:  # the test inspects it
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - t0

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 30
    while not manifest.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manifest.exists(), "the waiting rank never wrote its manifest"
    time.sleep(0.3)  # let it poll at least once with the step in place
    assert remove_partial_steps(str(root)) == [1]
    thread.join(timeout=60)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, CheckpointError), error
    assert "removed" in str(error) and f"rank {waiting_rank}" in str(error), error
    assert outcome["elapsed"] < 15, outcome  # the commit timeout is 60 s
    assert open_checkpoint(str(root)).steps() == []
