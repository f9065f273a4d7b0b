"""The memory tier ([Note: memory tier] in zerostate.checkpoint.tiers): two simulated nodes
on one machine (a memory directory and a GROUP_RANK per group of ranks, as torchrun's
agents give them), gloo on CPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from helpers_dist import run_distributed
from torch import nn

import zerostate
from zerostate.store import open_checkpoint
from zerostate.store.memory_tier import run_id
from zerostate.store.storage import canonical_location


def _node(rank: int, per_node: int, tmp: str) -> str:
    """Make this rank one of ``per_node`` ranks of node ``rank // per_node``."""
    node = rank // per_node
    os.environ["GROUP_RANK"] = str(node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    directory = os.path.join(tmp, f"shm-node{node}")
    os.environ["ZEROSTATE_MEMORY_DIR"] = directory
    return directory


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(engine: zerostate.Engine, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed + engine.optimizer_steps)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        engine.backward(engine(x).square().mean())
        engine.step()


def _state(engine: zerostate.Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _moments(engine: zerostate.Engine) -> list[torch.Tensor]:
    return [v.local.clone() for v in engine.state_views() if v.name.startswith("optim/")]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_load(
    rank: int, world_size: int, tmp: str, per_node: int, stage: int, blocking: bool
) -> dict:
    _node(rank, per_node, tmp)
    root = os.path.join(tmp, "ckpt")
    with zerostate.Engine(_model(), stage=stage, lr=1e-2, memory_durable_every=None) as a:
        _train(a, 2)
        handle = a.save(root, tier="memory", blocking=blocking)
        saved, moments = _state(a), _moments(a)
        _train(a, 2)  # move on, so the load has something to undo
    with zerostate.Engine(_model(), stage=stage, lr=1e-2, memory_durable_every=None) as b:
        b.load(root)
        report = b._ckpt().tiers.last_report
        out = {
            "step": b.optimizer_steps,
            "equal": _same(_state(b), saved),
            "moments": all(torch.equal(x, y) for x, y in zip(_moments(b), moments, strict=True)),
            "report": report,
            "blocked": handle.blocked_s,
            "durable": os.path.exists(root) and open_checkpoint(root).steps() or [],
        }
    return out


@pytest.mark.parametrize("blocking", [False, True])
def test_memory_save_load_two_nodes_one_rank_each(tmp_path, blocking):
    # blocking=False: written, replicated and committed on the background thread, over a
    # side group, while the next steps train (they wait for the snapshot only).
    results = run_distributed(_save_load, 2, str(tmp_path), 1, 2, blocking)
    for r in results:
        assert r["step"] == 2 and r["equal"] and r["moments"], r
        assert r["durable"] == []  # memory only: nothing was written to the root
    assert "memory tier: 2 node(s) from their own memory" in results[0]["report"]
    loc = canonical_location(str(tmp_path / "ckpt"))
    for node in (0, 1):
        run_dir = tmp_path / f"shm-node{node}" / f"run-{run_id(loc)}"
        step = run_dir / "step-00000002"
        assert (step / "_zerostate/commit/zarr.json").exists()
        # Its own rank's row and the other node's replica: both rows of every group.
        assert (step / "model/c/0/0").exists() and (step / "model/c/1/0").exists()


def _flip(path: str, at: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _tiers_and_faults(rank: int, world_size: int, tmp: str, per_node: int) -> dict:
    import torch.distributed as dist

    mine = _node(rank, per_node, tmp)
    root = os.path.join(tmp, "ckpt")
    nodes = [os.path.join(tmp, f"shm-node{n}") for n in range(world_size // per_node)]
    out: dict = {}
    settings = {"stage": 2, "lr": 1e-2, "memory_keep_last": 2, "memory_durable_every": 2}

    def fresh() -> zerostate.Engine:
        return zerostate.Engine(_model(), **settings)

    def loaded(tag: str) -> zerostate.Engine:
        engine = fresh()
        engine.load(root)
        out[f"{tag}_step"] = engine.optimizer_steps
        out[f"{tag}_equal"] = _same(_state(engine), saved[engine.optimizer_steps])
        out[f"{tag}_report"] = engine._ckpt().tiers.last_report
        return engine

    saved: dict[int, dict] = {}
    with fresh() as a:
        for _ in range(5):
            _train(a, 1)
            handle = a.save(root, tier="memory")
            saved[a.optimizer_steps] = _state(a)
            handle.wait()  # steps 2 and 4: their copy to the root
        out["memory_bytes"] = a.memory_stats()["memory_tier_bytes"]
        out["row_bytes"] = _row_bytes(run_dir_of(mine, root))
    dist.barrier()
    run_dir = run_dir_of(mine, root)
    out["memory_steps"] = sorted(p for p in os.listdir(run_dir) if p.startswith("step-"))
    out["durable_steps"] = open_checkpoint(root).steps()
    loaded("memory").close()
    # A replaced machine: node 1's memory is gone; its ranks' rows come from the replicas.
    dist.barrier()
    if rank == per_node:
        shutil.rmtree(nodes[1])
    dist.barrier()
    loaded("replica").close()
    out["restored"] = os.path.exists(os.path.join(run_dir, "step-00000005", COMMIT))
    # A damaged row in node 0's memory, its replica on node 1 intact: the first try fails
    # its checksum, the nodes re-read their copies and node 0 gets that row from node 1.
    run_name = os.path.basename(run_dir)
    dist.barrier()
    if rank == 0:
        _flip(os.path.join(nodes[0], run_name, "step-00000005", "model/c/0/0"))
    dist.barrier()
    loaded("damaged").close()
    # Rank 0's row damaged in every copy of every memory step (node 1, restored above, holds
    # step 5 only): the durable root's step 4.
    dist.barrier()
    if rank == 0:
        for node, step in [(0, 4), (0, 5), (1, 5)]:
            _flip(os.path.join(nodes[node], run_name, f"step-{step:08d}", "model/c/0/0"), at=7)
    dist.barrier()
    loaded("both_damaged").close()
    # Both nodes' memory lost: the newest durable step, said so.
    dist.barrier()
    if rank % per_node == 0:
        shutil.rmtree(mine)
    dist.barrier()
    loaded("lost").close()
    return out


COMMIT = "_zerostate/commit/zarr.json"


def run_dir_of(memory_dir: str, root: str) -> str:
    return os.path.join(memory_dir, f"run-{run_id(canonical_location(root))}")


def _row_bytes(run_dir: str) -> dict[int, int]:
    """Bytes of row objects per source rank, over every step of a run directory."""
    out: dict[int, int] = {}
    for path in Path(run_dir).glob("step-*/**/c/*/0"):
        rank = int(path.parent.name)
        out[rank] = out.get(rank, 0) + path.stat().st_size
    return out


def test_memory_tier_retention_durable_copies_and_faults(tmp_path):
    results = run_distributed(_tiers_and_faults, 2, str(tmp_path), 1)
    for r in results:
        assert r["memory_steps"] == ["step-00000004", "step-00000005"], r  # keep_last=2
        assert r["durable_steps"] == [2, 4]  # every second memory save
        assert r["memory_step"] == 5 and r["memory_equal"], r
        assert r["replica_step"] == 5 and r["replica_equal"] and r["restored"], r
        assert r["damaged_step"] == 5 and r["damaged_equal"], r
        assert r["both_damaged_step"] == 4 and r["both_damaged_equal"], r
        assert r["lost_step"] == 4 and r["lost_equal"], r
        # Host RAM per node: its own rank's rows and the other node's replica, for the
        # 2 kept steps, plus small documents.
        rows = r["row_bytes"]
        assert sorted(rows) == [0, 1] and rows[0] > 0 and rows[1] > 0, rows
        assert sum(rows.values()) <= r["memory_bytes"] <= sum(rows.values()) + 64 * 1024, r
    first = results[0]
    assert "memory tier: 2 node(s) from their own memory" in first["memory_report"]
    assert "node(s) [1] from their peers' replicas" in first["replica_report"]
    damaged = first["damaged_report"]
    assert "step 5 from the memory tier" in damaged, damaged
    assert "node(s) [0] from their peers' replicas after memory step 5 failed to load" in damaged
    both = first["both_damaged_report"]
    assert "from the durable tier" in both and "memory step 5 failed to load" in both, both
    assert "memory step 4 cannot be assembled" in both, both
    assert "durable tier" in first["lost_report"] and "holds no step" in first["lost_report"]


def _save_four(rank: int, world_size: int, tmp: str) -> dict:
    _node(rank, 2, tmp)
    root = os.path.join(tmp, "ckpt")
    with zerostate.Engine(_model(), stage=3, lr=1e-2, memory_durable_every=1) as a:
        _train(a, 3)
        a.save(root, tier="memory", blocking=False).wait()
        state = _state(a)
        again = zerostate.Engine(_model(), stage=3, lr=1e-2)
        again.load(root)
        equal = _same(_state(again), state)
        report = again._ckpt().tiers.last_report
        again.close()
    open_checkpoint(root).step(3).verify()  # the durable copy is a whole, checked step
    return {"state": state, "equal": equal, "report": report}


def _load_two(rank: int, world_size: int, tmp: str, tamper: bool) -> dict:
    _node(rank, 1, tmp)
    root = os.path.join(tmp, "ckpt")
    if tamper and rank == 0:  # node 0's run directory claims to be another run's
        run_file = os.path.join(
            tmp, "shm-node0", f"run-{run_id(canonical_location(root))}", "run.json"
        )
        with open(run_file, "r+b") as f:
            raw = f.read().replace(b'"run_id": "', b'"run_id": "f')
            f.seek(0)
            f.write(raw)
            f.truncate()
    # Another root's memory steps are never looked at.
    other = os.path.join(tmp, f"other-{tamper}")
    with zerostate.Engine(_model(), stage=2, lr=1e-2) as c:
        c.save(other)
        c.load(other)
        other_report = c._ckpt().tiers.last_report
    with zerostate.Engine(_model(), stage=2, lr=1e-2) as b:
        b.load(root)
        return {
            "state": _state(b),
            "step": b.optimizer_steps,
            "report": b._ckpt().tiers.last_report,
            "other_report": other_report,
        }


def test_two_nodes_of_two_ranks_then_two_ranks_and_another_run(tmp_path, capsys, monkeypatch):
    saved = run_distributed(_save_four, 4, str(tmp_path))
    assert all(r["equal"] for r in saved)
    assert "step 3 from the memory tier: 2 node(s)" in saved[0]["report"]
    # `zerostate inspect` on node 1 lists the memory step and the ranks held there: its
    # own two and the two replicas of node 0's ranks.
    monkeypatch.setenv("ZEROSTATE_MEMORY_DIR", str(tmp_path / "shm-node1"))
    code, out, _ = run_cli(["inspect", str(tmp_path / "ckpt")], capsys)
    assert code == 0 and "steps 3 (ranks 0-3 of 4 held here)" in out, out
    # At 2 ranks (one per node directory) the 4-rank memory step is resharded.
    loaded = run_distributed(_load_two, 2, str(tmp_path), False)
    for r in loaded:
        assert r["step"] == 3 and _same(r["state"], saved[0]["state"])
        assert "durable tier" in r["other_report"], r
    assert "step 3 from the memory tier" in loaded[0]["report"]
    # A memory directory whose run.json names another run is refused: the root's step 3.
    refused = run_distributed(_load_two, 2, str(tmp_path), True)
    for r in refused:
        assert r["step"] == 3 and _same(r["state"], saved[0]["state"])
    assert "durable tier" in refused[0]["report"], refused[0]["report"]


def _unwritable_node(rank: int, world_size: int, tmp: str) -> dict:
    _node(rank, 1, tmp)
    if rank == 1:  # node 1's memory directory lies under a regular file: cannot be made
        blocker = os.path.join(tmp, "blocker")
        Path(blocker).write_bytes(b"")
        os.environ["ZEROSTATE_MEMORY_DIR"] = os.path.join(blocker, "shm")
    root = os.path.join(tmp, "ckpt")
    with zerostate.Engine(_model(), stage=2, lr=1e-2) as a:
        _train(a, 1)
        try:
            a.save(root, tier="memory", blocking=False)
            error = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            error = f"{type(exc).__name__}: {exc}"
        _train(a, 1)  # trains on after a refused save (its snapshot's fence released)
        a.save(root)  # and the durable tier still saves
    return {"error": error, "steps": open_checkpoint(root).steps()}


def test_a_node_whose_memory_cannot_be_written_fails_the_save_on_every_rank(tmp_path):
    results = run_distributed(_unwritable_node, 2, str(tmp_path))
    assert "Not a directory" in results[1]["error"] or "NotADirectory" in results[1]["error"]
    assert "rank(s) [1]" in results[0]["error"], results[0]
    # Nothing committed in node 0's memory; the durable save afterwards is whole.
    assert not list(tmp_path.glob("shm-node0/run-*/step-*/_zerostate/commit"))
    assert all(r["steps"] == [2] for r in results)


def _interrupted_commits(rank: int, world_size: int, tmp: str) -> dict:
    import torch.distributed as dist

    mine = _node(rank, 1, tmp)
    root = os.path.join(tmp, "ckpt")
    saved: dict[int, dict] = {}
    settings = {"stage": 2, "lr": 1e-2, "memory_durable_every": None, "memory_keep_last": 3}
    with zerostate.Engine(_model(), **settings) as a:
        for _ in range(2):
            _train(a, 1)
            a.save(root, tier="memory")
            saved[a.optimizer_steps] = _state(a)
    out = {}
    step2 = os.path.join(run_dir_of(mine, root), "step-00000002", COMMIT)

    def load(tag: str) -> None:
        with zerostate.Engine(_model(), **settings) as b:
            b.load(root)
            out[tag] = (b.optimizer_steps, _same(_state(b), saved[b.optimizer_steps]))
            out[f"{tag}_report"] = b._ckpt().tiers.last_report

    # Stopped after node 0 wrote its commit record, before node 1 did: node 0's copy
    # (its rows and node 1's replicas) is whole, and node 1 gets its step back from it.
    dist.barrier()
    if rank == 1:
        os.remove(step2)
    dist.barrier()
    load("one_commit")
    out["recommitted"] = os.path.exists(step2)
    # Stopped before any commit record of step 2: the partial step is never read; step 1 is.
    dist.barrier()
    os.remove(step2)
    dist.barrier()
    load("no_commit")
    return out


def test_a_memory_step_is_loaded_whole_or_not_at_all(tmp_path):
    results = run_distributed(_interrupted_commits, 2, str(tmp_path))
    for r in results:
        assert r["one_commit"] == (2, True) and r["recommitted"], r
        assert r["no_commit"] == (1, True), r
    assert "node(s) [1] from their peers' replicas" in results[0]["one_commit_report"]
    assert "step 1 from the memory tier" in results[0]["no_commit_report"]


def _commit_fails_on_node_1(rank: int, world_size: int, tmp: str) -> dict:
    from zerostate.store.memory_tier import MemoryTier

    _node(rank, 1, tmp)
    root = os.path.join(tmp, "ckpt")
    settings = {"stage": 2, "lr": 1e-2, "memory_durable_every": None}
    if rank == 1:  # node 1 cannot write its copy of the commit record
        write = MemoryTier.write

        def failing(self, step, rel, data):
            if rel == COMMIT:
                raise OSError(28, "No space left on device")
            return write(self, step, rel, data)

        MemoryTier.write = failing
    with zerostate.Engine(_model(), **settings) as a:
        _train(a, 2)
        saved = _state(a)
        try:
            a.save(root, tier="memory")
            error = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            error = f"{type(exc).__name__}: {exc}"
    if rank == 1:
        MemoryTier.write = write
    with zerostate.Engine(_model(), **settings) as b:
        b.load(root)
        loaded = (b.optimizer_steps, _same(_state(b), saved))
    return {"error": error, "loaded": loaded}


def test_a_commit_that_fails_after_node_0_committed_says_the_step_is_there(tmp_path):
    """Rank 0 wrote the commit record, node 1 could not write its copy: the error names what
    is committed where (not "nothing was committed"), and a load resumes that step."""
    results = run_distributed(_commit_fails_on_node_1, 2, str(tmp_path))
    assert "No space left on device" in results[1]["error"], results[1]
    for r in results:
        assert "committed in node 0's memory tier" in r["error"], r
        assert "nothing was committed" not in r["error"], r
        assert r["loaded"] == (2, True), r
