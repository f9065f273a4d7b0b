"""The checkpoint-root object: one open storage per root, the save guard from one listing,
retention through the same object; an engine opens each root once for its life and keeps
the save guard's memory per root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn
from world_of_one import world_of_one  # noqa: F401 - fixture

from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import (
    CheckpointReader,
    CheckpointRoot,
    LocalStorage,
    open_checkpoint,
    prune_steps,
    save_tensors,
)
from zerostate.store import format as fmt


def _save(root, step: int, tensors: dict[str, torch.Tensor]) -> None:
    save_tensors(root, step, tensors)


def _model(width: int = 6) -> dict[str, torch.Tensor]:
    return {"model/w": torch.arange(width * 3, dtype=torch.float32).reshape(width, 3)}


def _partial(tmp: Path, step: int) -> Path:
    d = tmp / fmt.step_dir(step)
    d.mkdir(parents=True)
    (d / "junk").write_bytes(b"x")
    return d


def test_open_takes_a_path_a_storage_or_a_root(tmp_path: Path) -> None:
    root = CheckpointRoot.open(str(tmp_path))
    assert isinstance(root.storage, LocalStorage)
    assert CheckpointRoot.open(root) is root
    storage = LocalStorage(str(tmp_path))
    assert CheckpointRoot.open(storage).storage is storage
    assert open_checkpoint(storage).storage is storage
    assert root.location == "file://" + os.path.realpath(tmp_path)
    with pytest.raises(ConfigError, match="already open"):
        CheckpointRoot.open(root, {"anon": True})
    with pytest.raises(ConfigError, match="already open"):
        CheckpointRoot.open(storage, {"anon": True})
    with pytest.raises(ConfigError, match="needs a Storage"):
        CheckpointRoot("not a storage")  # type: ignore[arg-type]
    assert CheckpointReader is CheckpointRoot  # the former name still works


def test_check_save_verdicts(tmp_path: Path) -> None:
    _save(str(tmp_path), 5, _model())
    root = CheckpointRoot.open(str(tmp_path))
    shapes = {"model/w": (6, 3)}

    ok = root.check_save(7, model_shapes=shapes, newer_ok=False)
    assert ok.ok and ok.committed == (5,) and ok.latest == 5

    exists = root.check_save(5, model_shapes=shapes)
    assert exists.exists and not exists.ok

    newer = root.check_save(3, model_shapes=shapes, newer_ok=False)
    assert newer.newer == 5 and not newer.ok
    assert root.check_save(3, model_shapes=shapes, newer_ok=True).ok

    other = root.check_save(7, model_shapes={"model/w": (6, 4)})
    assert other.refusal and "shape (6, 3) there, (6, 4) here" in other.refusal
    other = root.check_save(7, model_shapes={"model/v": (6, 3)})
    assert other.refusal and "'model/v' only in this model" in other.refusal
    # Without shapes the model is not checked (the engine checks a root once).
    assert root.check_save(7, model_shapes=None).ok

    inner = CheckpointRoot.open(str(tmp_path / fmt.step_dir(5) / "x"))
    refusal = inner.check_save(1, model_shapes=shapes).refusal
    assert refusal and "inside the step directory 'step-00000005'" in refusal


def test_check_save_removes_the_steps_partial_directory_only_when_the_save_may_go_on(
    tmp_path: Path,
) -> None:
    _save(str(tmp_path), 5, _model())
    root = CheckpointRoot.open(str(tmp_path))
    stale_3, stale_7, other = _partial(tmp_path, 3), _partial(tmp_path, 7), _partial(tmp_path, 8)
    # Refused (older than the latest, not this run's root): the partial step stays.
    assert root.check_save(3, newer_ok=False).newer == 5 and stale_3.exists()
    # Refused (another model): stays.
    assert root.check_save(7, model_shapes={"model/w": (1,)}).refusal and stale_7.exists()
    # Accepted: the save's own partial directory goes, nothing else.
    check = root.check_save(7, model_shapes={"model/w": (6, 3)})
    assert check.ok and not stale_7.exists() and stale_3.exists() and other.exists()
    assert root.scan() == ([5], [3, 8])


def test_retention_and_deletion_go_through_the_root(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(str(tmp_path), step, _model())
    _partial(tmp_path, 0)
    root = CheckpointRoot.open(str(tmp_path))
    assert root.prune(keep_last=2, partial_below=4) == ([1, 2], [0])
    assert root.steps() == [3, 4]
    root.delete_step(3)
    assert root.steps() == [4]
    with pytest.raises(CheckpointError, match="no step 3"):
        root.delete_step(3)
    with pytest.raises(ConfigError, match="keep_last"):
        root.prune(keep_last=True, partial_below=None)
    # The path-taking functions are the same operations on a root opened for the call.
    _save(str(tmp_path), 6, _model())
    assert prune_steps(str(tmp_path), keep_last=1, partial_below=None) == ([4], [])


# ------------------------------------------------------------- engine.save
def _counting_worker(rank: int, world_size: int, tmp: str) -> dict:
    import zerostate
    from zerostate.store import local

    path = os.path.realpath(os.path.join(tmp, "ckpt"))
    counts = {"storages": 0, "root_listings": 0}
    init, list_dir = local.LocalStorage.__init__, local.LocalStorage.list_dir
    own = {name: vars(local.LocalStorage)[name] for name in ("__init__", "list_dir")}

    def counted_init(self, root, *a, **k):
        init(self, root, *a, **k)
        if os.path.realpath(os.fspath(root)) == path:
            counts["storages"] += 1

    def counted_list(self, p):
        if p in ("", ".") and os.path.realpath(self.root) == path:
            counts["root_listings"] += 1
        return list_dir(self, p)

    local.LocalStorage.__init__ = counted_init
    local.LocalStorage.list_dir = counted_list
    try:  # undone before returning: the ranks may be pooled workers that run other tests
        return _count_saves(zerostate, path, counts)
    finally:
        for name, value in own.items():  # the class's own entries, not what lookup gives
            setattr(local.LocalStorage, name, value)


def _count_saves(zerostate, path: str, counts: dict) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    model[0].weight.requires_grad_(False)  # frozen: the save plans references to it
    engine = zerostate.Engine(model, stage=3)
    out = {}
    counts.update(storages=0, root_listings=0)
    for i in range(3):
        engine.backward(engine(torch.ones(3, 6)).square().mean())
        engine.step()
        listed = counts["root_listings"]
        engine.save(path, keep_last=2)
        out[f"save{i}"] = {"root_listings": counts["root_listings"] - listed}
    out["storages"] = counts["storages"]  # over the three saves
    engine.backward(engine(torch.ones(3, 6)).square().mean())
    engine.step()
    counts.update(storages=0, root_listings=0)
    engine.save(path, keep_last=2, blocking=False).wait()
    out["async"] = dict(counts)
    out["roots_open"] = len(engine._ckpt().roots)
    engine.close()
    out["roots_after_close"] = len(engine._ckpt().roots)
    with open_checkpoint(path).step() as st:
        out["refs"] = sorted(st.refs)
    out["steps"] = open_checkpoint(path).steps()
    return out


def test_engine_save_opens_its_root_once_and_lists_it_only_on_rank_0(tmp_path: Path) -> None:
    results = run_distributed(_counting_worker, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        # One root object for the engine's life ([Note: one root per location]): the
        # first save opens its storage, the later ones (async included) reuse it.
        assert r["storages"] == 1, (rank, r)
        assert r["async"]["storages"] == 0, (rank, r)
        assert (r["roots_open"], r["roots_after_close"]) == (1, 0), (rank, r)
        for key in ("save0", "save1", "save2", "async"):
            # Rank 0 lists the root once, in the save guard, and retention reuses that
            # listing ([Note: one scan per save]); the others take what they need (the
            # latest step) from rank 0's listing.
            assert r[key]["root_listings"] == (1 if rank == 0 else 0), (rank, key, r[key])
        # keep_last=2 keeps steps 3 and 4, and step 1, which holds the frozen weight they
        # refer to; step 2 goes.
        assert r["steps"] == [1, 3, 4]
        # The frozen weight is referred to from the step that holds it (the guard's
        # latest step reached every rank).
        assert r["refs"] == ["model/0.weight"]


def _trained(seed: int):
    import zerostate

    torch.manual_seed(seed)
    engine = zerostate.Engine(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2)), stage=2)
    engine.backward(engine(torch.ones(3, 6)).square().mean())
    engine.step()
    return engine


@pytest.mark.usefixtures("world_of_one")
def test_each_root_keeps_its_own_guard_memory_and_one_storage(tmp_path: Path, monkeypatch) -> None:
    from zerostate.store import local

    a, b = tmp_path / "a", tmp_path / "b"
    other = _trained(1)  # another run, same model: its steps are the newest in both roots
    other.save(str(a), step=50)
    other.save(str(b), step=100)
    other.close()

    opened: list[str] = []
    init = local.LocalStorage.__init__

    def counted_init(self, root, *args, **kwargs):
        init(self, root, *args, **kwargs)
        opened.append(os.path.realpath(self.root))

    monkeypatch.setattr(local.LocalStorage, "__init__", counted_init)
    engine = _trained(2)
    engine.load(str(a))  # continues that run in root a: a is this run's own
    engine.save(str(a), step=7)  # older than 50, accepted: resuming this run in a
    # What this engine did in a says nothing of b: b's newest step is another run's.
    with pytest.raises(ConfigError, match="newer than step 8"):
        engine.save(str(b), step=8)
    assert not (b / fmt.step_dir(8)).exists()
    # Another spelling of a is the same root, still this run's own.
    engine.save(os.path.relpath(a) + "/./", step=9)
    assert opened.count(str(a.resolve())) == 1, opened  # load and two saves: one storage
    assert opened.count(str(b.resolve())) == 1, opened
    assert len(engine._ckpt().roots) == 2
    engine.close()
    assert len(engine._ckpt().roots) == 0
    assert open_checkpoint(str(a)).steps() == [7, 9, 50]
    assert open_checkpoint(str(b)).steps() == [100]
