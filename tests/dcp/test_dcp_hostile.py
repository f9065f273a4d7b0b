"""A DCP step in zerostate's store cannot run code and cannot steer a load outside its
tensors: pickle payloads where metadata or values belong are never unpickled, and
hostile chunk boxes (overlapping, outside the tensor, of another dtype or shape than the
piece holding them, not covering the tensor) are refused in one line before any read.

One process, no torch.distributed (DCP's no_dist path)."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zerostate.dcp import StorageReader, StorageWriter, check_boxes
from zerostate.errors import CheckpointError, ConfigError, CorruptCheckpointError
from zerostate.store import open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _RunsCode:
    """Unpickling this creates ``path``: the proof that a load ran stored code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state(lr: float = 1e-2) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return {"model": model.state_dict(), "sched": sched.state_dict(), "note": "run-7"}


def _fresh() -> dict:
    """A state of the same keys and other values: DCP loads the keys the target has."""
    state = _state(lr=0.5)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["note"] = ""
    return state


@pytest.fixture
def root(tmp_path) -> Path:
    out = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(str(out)))
    return out


def _commit_path(root: Path) -> Path:
    return root / "step-00000000" / "_zerostate" / "commit" / "zarr.json"


def _edit(root: Path, change) -> None:
    path = _commit_path(root)
    doc = json.loads(path.read_text())
    change(doc["attributes"]["zerostate_commit"]["attrs"]["dcp"])
    path.write_text(json.dumps(doc))


def test_round_trip_in_one_process(root):
    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)))
    want = _state()
    assert state["note"] == "run-7" and state["sched"] == want["sched"]
    for k, v in want["model"].items():
        assert torch.equal(state["model"][k], v), k


def test_commit_record_replaced_by_a_pickle_runs_nothing(root, tmp_path):
    marker = tmp_path / "ran"
    _commit_path(root).write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises((CheckpointException, AssertionError), match="commit record"):
        dcp.load(_fresh(), storage_reader=StorageReader(str(root)))
    with pytest.raises(CorruptCheckpointError, match="commit record"):
        StorageReader(str(root)).read_metadata()
    assert not marker.exists()


def test_pickle_files_beside_the_step_are_never_read(root, tmp_path):
    # What DCP's FileSystemReader would unpickle: a .metadata file, in the root and the step.
    marker = tmp_path / "ran"
    for where in (root, root / "step-00000000"):
        (where / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)))
    assert state["note"] == "run-7"
    assert not marker.exists()


def test_a_value_replaced_by_pickle_bytes_stays_data(root, tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(_RunsCode(marker)).decode("latin-1")
    _edit(root, lambda doc: doc["values"].__setitem__("note", payload))
    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)))
    assert state["note"] == payload  # a string, handed over as a string
    assert not marker.exists()


@pytest.mark.parametrize("marker", ["__zs_bytes__", "__zs_bytesio__"])
def test_a_pickle_stored_as_bytes_stays_bytes(root, tmp_path, marker):
    # Bytes values are data: a pickle in them reaches the state as bytes or a buffer of
    # them; nothing on the way (our reader, DCP's load planner) unpickles the contents.
    ran = tmp_path / "ran"
    payload = pickle.dumps(_RunsCode(ran))
    text = base64.b64encode(payload).decode("ascii")
    stored = {marker: text if marker == "__zs_bytes__" else {"data": text, "pos": 0}}
    _edit(root, lambda doc: doc["values"].__setitem__("note", stored))
    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)))
    got = state["note"]
    assert (got if marker == "__zs_bytes__" else got.getvalue()) == payload
    assert not ran.exists()


def test_a_value_with_a_hostile_marker_is_refused_naming_it(root):
    bad = {"__zs_tensor__": {"dtype": "object", "shape": [1], "data": "AA=="}}
    _edit(root, lambda doc: doc["values"].__setitem__("note", bad))
    with pytest.raises(CorruptCheckpointError, match="'note'"):
        StorageReader(str(root)).read_metadata()


def _weight_chunks(doc: dict) -> list:
    return doc["tensors"]["model.weight"]["chunks"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: _weight_chunks(d)[0].__setitem__("offsets", [1, 0]), "lies outside"),
        (lambda d: _weight_chunks(d).append(dict(_weight_chunks(d)[0])), "two chunks|serves two"),
        (lambda d: d["tensors"]["model.weight"].__setitem__("dtype", "float64"), "needs float64"),
        (lambda d: d["tensors"]["model.weight"].__setitem__("shape", [4, 4]), "cover 12 of"),
        (lambda d: _weight_chunks(d)[0].__setitem__("sizes", [3, 5]), "lies outside"),
        (lambda d: _weight_chunks(d)[0].__setitem__("piece", "../../x"), "piece"),
        (lambda d: _weight_chunks(d)[0].__setitem__("piece", "dcp/absent"), "not in the step"),
        (lambda d: d["tensors"]["model.weight"].__setitem__("dtype", "object"), "dtype"),
        (lambda d: d.__setitem__("version", 99), "version 99"),
    ],
)
def test_hostile_boxes_are_refused_in_one_line(root, change, message):
    _edit(root, change)
    with pytest.raises(CheckpointError, match=message) as info:
        StorageReader(str(root)).read_metadata()
    assert "\n" not in str(info.value)


def test_check_boxes_accepts_tilings_and_refuses_gaps_and_overlaps():
    # FSDP2's uneven Shard(0) of 5 rows over 2 ranks, an empty shard, and a 2 x 3 grid.
    check_boxes((5, 7), [((0, 0), (3, 7)), ((3, 0), (2, 7)), ((5, 0), (0, 7))], "t")
    grid = [((r * 2, c * 3), (2, 3)) for r in range(2) for c in range(3)]
    check_boxes((4, 9), grid, "t")
    check_boxes((), [((), ())], "scalar")
    with pytest.raises(CorruptCheckpointError, match="cover 12 of the tensor's 15"):
        check_boxes((5, 3), [((0, 0), (4, 3))], "t")
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check_boxes((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))], "t")
    with pytest.raises(CorruptCheckpointError, match="overlap"):  # same area, overlapping
        check_boxes((2, 2), [((0, 0), (2, 1)), ((0, 0), (1, 2)), ((1, 1), (1, 1))], "t")


def test_values_json_cannot_hold_are_refused_at_save_naming_the_key(tmp_path):
    state = {"w": torch.ones(2), "extra": {"fn": object()}}
    with pytest.raises(CheckpointException, match=r"ConfigError: non-tensor value 'extra\.fn'"):
        dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "c")))
    assert not (tmp_path / "c").exists() or not any(
        (tmp_path / "c").glob("step-*/_zerostate/commit")
    )


def test_a_committed_step_is_never_overwritten(root):
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.save(_state(), storage_writer=StorageWriter(str(root), step=0))
    with pytest.raises(ConfigError):
        StorageWriter(str(root), keep_last=0)


def test_keep_last_keeps_the_newest_steps(tmp_path):
    root = str(tmp_path / "ckpt")
    for _ in range(3):
        dcp.save(_state(), storage_writer=StorageWriter(root, keep_last=2))
    assert open_checkpoint(root).steps() == [1, 2]


def test_a_step_not_written_through_dcp_is_refused_in_one_line(tmp_path):
    from zerostate.layout.partition import even_layout
    from zerostate.store import StepWriter, TensorSpec

    root = str(tmp_path / "ckpt")
    spec = TensorSpec("model/w", (4,), torch.float32, even_layout(4, 1))
    writer = StepWriter(root, 0, rank=0, world_size=1, specs=[spec])
    writer.write({"model/w": torch.ones(4)})
    writer.commit()
    with pytest.raises(CheckpointError, match="not written through zerostate.dcp"):
        StorageReader(root).read_metadata()


def test_the_default_planner_gets_values_without_any_torch_load(root, monkeypatch):
    """DCP's DefaultLoadPlanner.load_bytes unpickles with weights_only=False; our reader
    hands it the decoded value directly, so no load through our reader unpickles at all."""
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)))
    assert calls == []
    assert state["note"] == "run-7" and state["sched"] == _state()["sched"]


def test_a_planner_with_its_own_load_bytes_still_gets_bytes(root):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen = {}

    class Recording(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            seen[read_item.dest_index.fqn] = value.getvalue()[:2]
            super().load_bytes(read_item, value)

    state = _fresh()
    dcp.load(state, storage_reader=StorageReader(str(root)), planner=Recording())
    assert state["note"] == "run-7" and seen and all(v[:1] == b"P" for v in seen.values())


#: Values a mutation puts in place of a field of the commit record.
_ODD = [
    -1, 0, 1, 2**31, 2**63, 2**70, 1.5, 1e308, True, None, "", "x", "../../etc", "a" * 5000,
    [], {}, [0], [1, 2], {"a": 1}, "float32", "dcp/absent", [-1, 0], [3, 4, 5],
]  # fmt: skip


def _fields(node, path=()):
    if path:
        yield path
    children = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in children:
        yield from _fields(child, (*path, key))


def _mutate(record: dict, rng) -> tuple:
    """Change one field of ``record`` in place: another value, removed, or repeated."""
    path = rng.choice(list(_fields(record)))
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    key, roll = path[-1], rng.random()
    if roll < 0.15 and isinstance(parent, dict):
        del parent[key]
    elif roll < 0.3 and isinstance(parent, list):
        parent.append(json.loads(json.dumps(parent[key])))
    elif roll < 0.45 and type(parent[key]) is int:
        parent[key] += rng.choice([-1, 1, 7, -100])
    else:
        parent[key] = json.loads(json.dumps(rng.choice(_ODD)))
    return path


def test_a_mutated_commit_record_loads_or_is_refused_in_one_line(root, tmp_path):
    # 200 records with one to three fields changed anywhere (the store's entries, the DCP
    # document, its boxes and values): reading the step either refuses it with a zerostate
    # error of one line, or DCP loads it (a changed value, a dropped key that DCP's planner
    # then misses); nothing else escapes (no KeyError, TypeError, IndexError...).
    import random
    import shutil

    rng = random.Random(51)
    original = json.loads(_commit_path(root).read_text())
    outcomes = {"refused": 0, "loaded": 0, "missing": 0}
    for i in range(200):
        copy = tmp_path / f"m{i % 3}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(root, copy)
        record = json.loads(json.dumps(original))
        paths = [
            _mutate(record["attributes"]["zerostate_commit"], rng)
            for _ in range(rng.choice([1, 1, 2, 3]))
        ]
        _commit_path(copy).write_text(json.dumps(record))
        try:
            StorageReader(str(copy)).read_metadata()
        except (CheckpointError, ConfigError) as exc:
            assert "\n" not in str(exc), (paths, str(exc))
            outcomes["refused"] += 1
            continue
        try:
            dcp.load(_fresh(), storage_reader=StorageReader(str(copy)))
            outcomes["loaded"] += 1
        except CheckpointException as exc:
            for failure in exc.failures.values():
                error = failure[0] if isinstance(failure, tuple) else failure
                # DCP's planner, on a tensor the changed document no longer lists.
                assert str(error).startswith("Missing key in checkpoint state_dict"), (paths, error)
            outcomes["missing"] += 1
    assert outcomes["refused"] > 100 and outcomes["loaded"] > 0, outcomes


@pytest.mark.parametrize("key", ["k" * 4097, ""], ids=["too-long", "empty"])
@pytest.mark.parametrize("kind", ["tensor", "value"])
def test_a_key_the_reader_would_refuse_is_refused_at_save(tmp_path, key, kind):
    """A key the reader refuses as damaged (empty, or over 4096 characters) used to be
    saved and committed: a step that no load could read. It is refused before anything is
    written; a key of 4096 characters saves and loads."""
    root = tmp_path / "c"
    state = {"w": torch.ones(2), key: torch.ones(3) if kind == "tensor" else 7}
    with pytest.raises(CheckpointException, match=r"ConfigError: state key .* cannot be stored"):
        dcp.save(state, storage_writer=StorageWriter(str(root)))
    assert not root.exists() or open_checkpoint(str(root)).steps() == []
    longest = {"w": torch.ones(2), "k" * 4096: torch.ones(3) if kind == "tensor" else 7}
    dcp.save(longest, storage_writer=StorageWriter(str(root)))
    target = {"w": torch.zeros(2), "k" * 4096: torch.zeros(3) if kind == "tensor" else 0}
    dcp.load(target, storage_reader=StorageReader(str(root)))
    if kind == "tensor":
        assert torch.equal(target["k" * 4096], torch.ones(3))
    else:
        assert target["k" * 4096] == 7


def test_a_value_nested_past_the_bound_is_refused_in_one_line(root):
    """A stored value nested 900 deep parses as JSON but used to exhaust the interpreter's
    recursion while decoding: a RecursionError, not a refusal."""
    path = _commit_path(root)
    doc = json.loads(path.read_text())
    values = doc["attributes"]["zerostate_commit"]["attrs"]["dcp"]["values"]
    key = next(iter(values))
    values[key] = "DEEP"
    text = json.dumps(doc).replace('"DEEP"', "[" * 900 + "1" + "]" * 900)
    path.write_text(text)
    with pytest.raises(CorruptCheckpointError, match="nested more than 100") as info:
        StorageReader(str(root)).read_metadata()
    assert "\n" not in str(info.value)
