"""Format v2 specifics: per-rank state, objects per step, resharding read amplification,
and commit records that lie."""

from __future__ import annotations

import json

import pytest
import torch
from _store_helpers import make_tensors

from zerostate.errors import ConfigError, CorruptCheckpointError, UnsafeNameError
from zerostate.layout.partition import even_layout
from zerostate.store import StepWriter, local, open_checkpoint, plan_specs, save_tensors
from zerostate.store.format import COMMIT_PATH
from zerostate.store.storage import LocalStorage


def transformer_state(d: int, layers: int, vocab: int, seed: int = 0) -> dict:
    """AdamW state of a GPT-like model: model weights, both moments, a few buffers."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (64, d)}
    for i in range(layers):
        shapes.update(
            {
                f"h.{i}.ln_1.weight": (d,),
                f"h.{i}.ln_1.bias": (d,),
                f"h.{i}.attn.c_attn.weight": (3 * d, d),
                f"h.{i}.attn.c_attn.bias": (3 * d,),
                f"h.{i}.attn.c_proj.weight": (d, d),
                f"h.{i}.attn.c_proj.bias": (d,),
                f"h.{i}.ln_2.weight": (d,),
                f"h.{i}.ln_2.bias": (d,),
                f"h.{i}.mlp.c_fc.weight": (4 * d, d),
                f"h.{i}.mlp.c_fc.bias": (4 * d,),
                f"h.{i}.mlp.c_proj.weight": (d, 4 * d),
                f"h.{i}.mlp.c_proj.bias": (d,),
            }
        )
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    out = {}
    for prefix in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        for name, shape in shapes.items():
            out[f"{prefix}/{name}"] = torch.randn(shape, generator=gen)
    out["buffers/attn.bias"] = torch.ones(64, 64, dtype=torch.bool).tril()
    out["buffers/step"] = torch.tensor(7)
    return out


def _buffers_on_rank0(tensors: dict, world_size: int) -> list:
    """Even layouts for trainable state, buffers whole on rank 0 (what the engine saves)."""
    specs = plan_specs(tensors, world_size)
    out = []
    for spec in specs:
        if spec.name.startswith("buffers/"):
            n = spec.layout.numel
            layout = type(spec.layout)(n, world_size, max(1, n), 0)
            spec = type(spec)(spec.name, spec.shape, spec.dtype, layout)
        out.append(spec)
    return out


def _save(root, tensors, world_size, rank_states=None):
    specs = _buffers_on_rank0(tensors, world_size)
    for rank in [*range(1, world_size), 0]:
        w = StepWriter(
            str(root),
            1,
            rank=rank,
            world_size=world_size,
            specs=specs,
            rank_state=(rank_states or {}).get(rank),
        )
        shards = {}
        for spec in specs:
            lo, hi = spec.layout.owned_range(rank)
            if hi > lo:
                shards[spec.name] = tensors[spec.name].reshape(-1)[lo:hi]
        w.write(shards)
        w.commit(wait=False)


# ------------------------------------------------------------------------ rank state
def test_rank_state_round_trip(tmp_path):
    states = {0: {"rng": [1, 2, 3], "note": "zero"}, 2: {"sampler": {"epoch": 4}}}
    save_tensors(str(tmp_path), 1, make_tensors(), world_size=3, rank_states=states)
    st = open_checkpoint(str(tmp_path)).step(1)
    assert [st.rank_state(r) for r in range(3)] == [states[0], None, states[2]]
    with pytest.raises(ConfigError, match="rank must be"):
        st.rank_state(3)
    # A sibling of format 1's reader, not a subclass with methods switched off.
    assert not hasattr(st, "iter_chunks") and st.row_objects()


@pytest.mark.parametrize(
    "state, match",
    [
        ([1, 2], "JSON object"),
        ({"x": float("nan")}, "NaN"),
        ({"blob": "x" * (4 << 20)}, "4194304-byte limit"),
        ({"t": torch.zeros(1)}, "JSON-serialisable"),
    ],
)
def test_rank_state_is_validated(tmp_path, state, match):
    specs = plan_specs(make_tensors(), 1)
    with pytest.raises(ConfigError, match=match):
        StepWriter(str(tmp_path), 1, rank=0, world_size=1, specs=specs, rank_state=state)


def test_tampered_manifest_fails_rank_state_and_verify(tmp_path):
    save_tensors(str(tmp_path), 1, make_tensors(), world_size=2, rank_states={1: {"a": 1}})
    path = "step-00000001/_zerostate/manifests/rank-00001/zarr.json"
    storage = LocalStorage(str(tmp_path))
    storage.write(path, [storage.read(path).replace(b'"a": 1', b'"a": 2')])
    st = open_checkpoint(str(tmp_path)).step(1)
    with pytest.raises(CorruptCheckpointError, match="manifest of rank 1.*checksum"):
        st.rank_state(1)
    with pytest.raises(CorruptCheckpointError, match="1 problem.*manifest"):
        st.verify()


# ------------------------------------------------------------------- objects per step
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_objects_per_step_do_not_grow_with_tensors(tmp_path, world_size):
    tensors = transformer_state(d=16, layers=12, vocab=50)
    assert len(tensors) > 400  # hundreds of tensors
    states = {r: {"rng": [r] * 100} for r in range(world_size)}
    _save(tmp_path, tensors, world_size, states)
    files = [p for p in (tmp_path / "step-00000001").rglob("*") if p.is_file()]
    st = open_checkpoint(str(tmp_path)).step(1)
    # rows (3 per rank + buffers on rank 0), manifests, 4 array documents, 'optim', 4 more
    assert len(files) == st.object_count == 4 * world_size + 10
    assert st.object_count <= 4 * world_size + 64
    assert all(torch.equal(st.read(n), t) for n, t in tensors.items())


def test_groups_that_contain_groups_are_refused(tmp_path):
    tensors = {"a/x": torch.zeros(3), "a/b/y": torch.zeros(3)}
    with pytest.raises(ConfigError, match="group 'a'.*parent of group 'a/b'"):
        save_tensors(str(tmp_path), 1, tensors, world_size=2)


# ---------------------------------------------------------------- read amplification
def _amplification(root, tensors, monkeypatch, new_world_size: int) -> float:
    """Bytes the storage layer returns for every new rank loading its even share of every
    tensor, over the bytes those shares hold."""
    returned = []
    original = local._preadv_all  # under every ranged read, with or without a handle

    def counting(fd, offset, parts):
        got = original(fd, offset, parts)
        returned.append(got)
        return got

    monkeypatch.setattr(local, "_preadv_all", counting)
    st = open_checkpoint(str(root)).step(1)
    needed = 0
    for rank in range(new_world_size):  # each new rank reads all its ranges in one call
        requests = []
        for name, info in st.tensors.items():
            lo, hi = even_layout(info.numel, new_world_size).owned_range(rank)
            requests.append((name, lo, hi, None))
            needed += (hi - lo) * info.dtype.itemsize
        outs = st.read_many(requests)
        for (name, lo, hi, _), out in zip(requests, outs, strict=True):
            assert torch.equal(out, tensors[name].reshape(-1)[lo:hi]), name
    monkeypatch.setattr(local, "_preadv_all", original)
    return sum(returned) / needed


@pytest.mark.parametrize("shape", [(64, 12, 1000), (48, 24, 500)], ids=["d64x12", "d48x24"])
@pytest.mark.parametrize("src, dst", [(4, 3), (4, 2), (2, 3)])
@pytest.mark.parametrize("fill", [False, True], ids=["asked", "filled"])
def test_resharding_load_read_amplification(tmp_path, monkeypatch, shape, src, dst, fill):
    """The pieces a resharding read asks for are at most 1.1x the bytes it needs. A local
    stream also reads through short gaps ([Note: filled gaps] in reader_v2.py), bytes
    that another rank on the host reads anyway; that stays under 1.5x (1.02-1.35x here)."""
    from zerostate.store import reader_v2

    monkeypatch.setattr(reader_v2, "FILL_GAPS", fill)
    tensors = transformer_state(*shape)
    _save(tmp_path, tensors, src)
    ratio = _amplification(tmp_path, tensors, monkeypatch, dst)
    print(f"read amplification {shape} {src}->{dst} fill={fill}: {ratio:.4f}")
    assert 1.0 <= ratio <= (1.5 if fill else 1.1)


# ------------------------------------------------------------------ lying records
def _edit(tmp_path, fn):
    save_tensors(str(tmp_path), 1, make_tensors(), world_size=3, min_shard_numel=8)
    storage = LocalStorage(str(tmp_path))
    path = f"step-00000001/{COMMIT_PATH}"
    doc = json.loads(storage.read(path))
    fn(doc["attributes"]["zerostate_commit"])
    storage.write(path, [json.dumps(doc).encode()])
    return open_checkpoint(str(tmp_path))


def _model(record):
    return record["groups"]["model"]


@pytest.mark.parametrize(
    "lie, match",
    [
        (lambda r: r["tensors"]["model/wte"].update(offset=4), "offset"),
        (lambda r: r["tensors"]["model/wte"].update(offset=1 << 60), "offset"),
        (lambda r: r["tensors"]["model/wte"].update(group="buffers"), "group"),
        (lambda r: _model(r).update(row_nbytes=1 << 40), "row_nbytes"),
        (lambda r: _model(r).update(inner_chunk_nbytes=1 << 40), "inner_chunk_nbytes"),
        (lambda r: _model(r).update(inner_chunk_nbytes=0), "inner_chunk_nbytes"),
        (lambda r: _model(r)["rows"].pop(), "rows"),
        (lambda r: _model(r)["rows"].__setitem__(0, {"nbytes": -1}), "nbytes"),
        (lambda r: r["groups"].pop("buffers"), "groups"),
        (lambda r: r["manifests"].pop(), "manifests"),
        (lambda r: r["manifests"][0].update(nbytes=1 << 40), "manifest 0"),
        (lambda r: r["tensors"]["model/wte"].update(shape=[1 << 40, 1 << 40]), "shape"),
        (lambda r: r["tensors"]["model/wte"]["layout"].update(chunk_numel=1), "layout"),
    ],
)
def test_lying_commit_record_is_refused_on_open(tmp_path, lie, match):
    reader = _edit(tmp_path, lie)
    with pytest.raises(CorruptCheckpointError, match=match):
        reader.step(1)


def test_row_size_that_contradicts_the_plan_is_refused_before_reading(tmp_path):
    def lie(record):
        for row in _model(record)["rows"]:
            if row is not None:
                row["nbytes"] += 1 << 30

    st = _edit(tmp_path, lie).step(1)
    with pytest.raises(CorruptCheckpointError, match="row .* recorded as .* the plan says"):
        st.read("model/wte")
    st.read("optim/exp_avg/tiny")  # other groups are fine


def test_group_tree_conflict_in_record_is_unsafe(tmp_path):
    def lie(record):
        record["tensors"]["model/x/y"] = record["tensors"].pop("model/wte")

    with pytest.raises((UnsafeNameError, CorruptCheckpointError)):
        _edit(tmp_path, lie).step(1)


def test_large_reads_check_the_data_exists_before_allocating(tmp_path, monkeypatch):
    from zerostate.store import reader_v2

    monkeypatch.setattr(reader_v2, "PROBE_NBYTES", 16)  # "large" for this tiny step
    save_tensors(str(tmp_path), 1, make_tensors(), world_size=3)
    st = open_checkpoint(str(tmp_path)).step(1)
    path, _ = st.locate("model/h.0.attn.weight", st.tensors["model/h.0.attn.weight"].numel - 1)
    (tmp_path / path).write_bytes((tmp_path / path).read_bytes()[:10])
    allocations = []
    real_empty = torch.empty
    monkeypatch.setattr(
        torch, "empty", lambda *a, **k: allocations.append(a) or real_empty(*a, **k)
    )
    with pytest.raises(CorruptCheckpointError, match="does not hold the .* bytes"):
        st.read("model/h.0.attn.weight")
    assert allocations == []
