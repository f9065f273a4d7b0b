"""Format 3: tensors stored as tensor-parallel x data-parallel pieces ([Note: mesh tensors] in
zerostate.store.geometry), written one row per (tp, dp) rank and read back as logical tensors by
every reader path: ranged reads, whole reads, consolidation, verify, the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from tests.foreign.conftest import one_line_refusals, run_cli
from zerostate.errors import CorruptCheckpointError, LayoutError
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.layout.partition import even_layout
from zerostate.store import geometry as mesh_mod
from zerostate.store.root import CheckpointRoot
from zerostate.store.writer import TensorSpec

# (name, shape, dtype, tp_dim, fused_sizes): odd sizes, fused q/k/v and gate/up, a tensor
# replicated across tp, a 3-D one sharded on its last dim, an empty one.
TENSORS = [
    ("model/attn.qkv.weight", (7 + 3 + 3, 10), torch.float32, 0, (7, 3, 3)),
    ("model/attn.o.weight", (10, 7), torch.float32, 1, ()),
    ("model/mlp.gate_up.weight", (2 * 9, 10), torch.bfloat16, 0, (9, 9)),
    ("model/mlp.down.weight", (10, 9), torch.bfloat16, 1, ()),
    ("model/norm.weight", (10,), torch.float32, None, ()),
    ("model/conv.weight", (3, 4, 5), torch.float32, 2, ()),
    ("model/empty", (0, 4), torch.float32, 0, ()),
    ("optim/exp_avg/attn.o.weight", (10, 7), torch.float32, 1, ()),
]


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _mesh(shape, tp_dim, fused, tp, dp):
    if tp_dim is None:
        return MeshLayout(shape=shape, dp_shard=dp)
    return MeshLayout(shape=shape, tp_dim=tp_dim, tp_degree=tp, fused_sizes=fused, dp_shard=dp)


def write_mesh_step(root, step, tp, dp, *, plain=True, attrs=None):
    """Write ``TENSORS`` (and a plain format-2 tensor) at tp x dp, one writer per row, as
    the ranks of a tp x dp job would; returns the logical tensors."""
    world = tp * dp
    full = {name: _values(shape, dtype, i) for i, (name, shape, dtype, *_) in enumerate(TENSORS)}
    specs, meshes = [], {}
    for name, shape, dtype, tp_dim, fused in TENSORS:
        mesh = _mesh(shape, tp_dim, fused, tp, dp)
        meshes[name] = mesh
        specs.append(TensorSpec(name, shape, dtype, mesh_mod.stored_layout(mesh, world), mesh=mesh))
    if plain:
        full["buffers/steps"] = torch.arange(5, dtype=torch.int64)
        specs.append(TensorSpec("buffers/steps", (5,), torch.int64, even_layout(5, world)))
    target = CheckpointRoot.open(str(root))
    for rank in [*range(1, world), 0]:
        t, d = divmod(rank, dp)
        shards = {}
        for spec in specs:
            if spec.mesh is None:
                lo, hi = spec.layout.owned_range(rank)
                if hi > lo:
                    shards[spec.name] = full[spec.name].reshape(-1)[lo:hi].clone()
                continue
            mesh = meshes[spec.name]
            if t >= mesh.num_tp_pieces or spec.layout.numel == 0:
                continue
            chunk = spec.layout.chunk_numel
            flat = full[spec.name].reshape(-1)
            shards[spec.name] = mesh_mod.piece_values(mesh, flat, (t, d), chunk)
        writer = target.writer(step, rank=rank, world_size=world, specs=specs, attrs=attrs or {})
        writer.write(shards)
        writer.commit(wait=rank == 0)
    return full


@pytest.mark.parametrize(("tp", "dp"), [(2, 3), (3, 2), (4, 1), (1, 4), (2, 2)])
def test_logical_reads_of_every_range(tmp_path, tp, dp):
    full = write_mesh_step(tmp_path, 3, tp, dp)
    st = CheckpointRoot.open(str(tmp_path)).step(3)
    assert st.format_version == 3 and st.world_size == tp * dp
    rng = random.Random(tp * 10 + dp)
    for name, tensor in full.items():
        info = st.tensors[name]
        assert tuple(info.shape) == tuple(tensor.shape) and info.dtype == tensor.dtype, name
        assert torch.equal(st.read(name).reshape(tensor.shape), tensor), name
        flat = tensor.reshape(-1)
        n = flat.numel()
        ranges = [(0, n), (n // 3, n - n // 4)]
        ranges += [sorted((rng.randrange(n + 1), rng.randrange(n + 1))) for _ in range(20)]
        requests = [(name, a, b, None) for a, b in ranges if n]
        for (a, b), got in zip(ranges, st.read_many(requests), strict=False):
            assert torch.equal(got, flat[a:b]), (name, a, b)
    st.verify()
    st.close()


def test_consolidate_inspect_verify_cli(tmp_path):
    full = write_mesh_step(tmp_path / "ckpt", 7, 2, 3)
    shown = run_cli("inspect", str(tmp_path / "ckpt"))
    assert shown.returncode == 0, shown.stderr
    assert "model/attn.o.weight" in shown.stdout
    assert run_cli("verify", str(tmp_path / "ckpt")).returncode == 0
    out = tmp_path / "model.safetensors"
    done = run_cli("consolidate", str(tmp_path / "ckpt"), str(out))
    assert done.returncode == 0, done.stderr
    got = load_file(out)
    for name, tensor in full.items():
        if name.startswith("model/"):
            key = name.removeprefix("model/")
            assert torch.equal(got[key], tensor), key


def test_a_flipped_byte_in_a_piece_is_found(tmp_path):
    write_mesh_step(tmp_path, 1, 2, 2, plain=False)
    st = CheckpointRoot.open(str(tmp_path)).step(1)
    name = "model/attn.o.weight"
    element = 10 * 7 - 1  # the last element: tp shard 1 (columns), last dp piece
    path, offset = st.locate(name, element)
    st.close()
    with open(tmp_path / path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    st = CheckpointRoot.open(str(tmp_path)).step(1)
    with pytest.raises(CorruptCheckpointError):
        st.read_range(name, element, element + 1)
    with pytest.raises(CorruptCheckpointError):
        st.verify()
    assert torch.equal(st.read_range("model/norm.weight", 0, 10), _values((10,), torch.float32, 4))


def _commit_path(root, step):
    return root / f"step-{step:08d}" / "_zerostate" / "commit" / "zarr.json"


def _rewrite_mesh(root, step, name, change):
    path = _commit_path(root, step)
    doc = json.loads(path.read_text())
    change(doc["attributes"]["zerostate_commit"]["tensors"][name])
    path.write_text(json.dumps(doc))


HOSTILE = {
    "a tp degree of 0": lambda e: e["mesh"].update(tp_degree=0),
    "more pieces than the step has rows": lambda e: e["mesh"].update(dp_shard=3),
    "a fused split that does not add up": lambda e: e["mesh"].update(fused_sizes=[7, 3, 4]),
    "a shard dim outside the tensor": lambda e: e["mesh"].update(tp_dim=2),
    "a piece larger than its row's chunk": lambda e: e["layout"].update(chunk_numel=1),
    "a shape the stored pieces do not tile": lambda e: e["mesh"].update(shape=[13, 5]),
}


@pytest.mark.parametrize("problem", sorted(HOSTILE))
def test_hostile_mesh_entries_are_refused_by_every_command(tmp_path, problem):
    root = tmp_path / "ckpt"
    write_mesh_step(root, 2, 2, 2, plain=False)
    _rewrite_mesh(root, 2, "model/attn.qkv.weight", HOSTILE[problem])
    with pytest.raises((LayoutError, CorruptCheckpointError)):
        CheckpointRoot.open(str(root)).step(2)
    for args, line in one_line_refusals(root, tmp_path):
        assert "qkv" in line, (problem, args, line)


def test_a_mesh_entry_in_a_version_2_step_is_refused(tmp_path):
    write_mesh_step(tmp_path, 4, 2, 2, plain=False)
    path = _commit_path(tmp_path, 4)
    doc = json.loads(path.read_text())
    doc["attributes"]["zerostate_commit"]["format_version"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="format 3"):
        CheckpointRoot.open(str(tmp_path)).step(4)


def test_writer_refuses_a_stored_layout_that_is_not_the_meshs():
    mesh = MeshLayout(shape=(10, 7), tp_dim=1, tp_degree=2, dp_shard=2)
    with pytest.raises(Exception, match="stored layout"):
        TensorSpec("model/w", (10, 7), torch.float32, even_layout(70, 4), mesh=mesh)


def _read_all(root, step):
    st = CheckpointRoot.open(str(root)).step(step)
    try:
        return {name: st.read(name) for name in st.tensors}, st
    finally:
        st.close()


@pytest.mark.parametrize(
    ("src", "dst"),
    [((2, 3), (4, 1)), ((2, 2), (3, 2)), ((3, 2), (1, 4)), ((1, 4), (2, 2)), ((4, 1), (2, 3))],
)
def test_reshard_between_layouts_and_back_is_byte_identical(tmp_path, src, dst):
    """A -> B -> A gives the same stored bytes; every layout reads the same logical tensors;
    fused sub-tensors and shard dims survive the trip."""
    full = write_mesh_step(tmp_path / "a", 5, *src, plain=False)  # all as a tp job saves
    args = ["--tp", str(dst[0]), "--dp", str(dst[1])]
    done = run_cli("reshard", str(tmp_path / "a"), str(tmp_path / "b"), *args)
    assert done.returncode == 0, done.stderr
    back = ["--tp", str(src[0]), "--dp", str(src[1])]
    done = run_cli("reshard", str(tmp_path / "b"), str(tmp_path / "c"), *back)
    assert done.returncode == 0, done.stderr
    for root in ("b", "c"):
        got, st = _read_all(tmp_path / root, 5)
        for name, tensor in full.items():
            assert torch.equal(got[name].reshape(-1), tensor.reshape(-1)), (root, name)
    st_b = CheckpointRoot.open(str(tmp_path / "b")).step(5)
    # Even at tp 1 the shard dims and fused sub-tensors stay recorded (the way back needs them).
    assert st_b.format_version == 3 and st_b.world_size == dst[0] * dst[1]
    mesh = st_b.mesh_layout("model/attn.qkv.weight")
    assert (mesh.tp_degree, mesh.fused_sizes, mesh.dp_shard) == (dst[0], (7, 3, 3), dst[1])
    assert st_b.mesh_layout("model/norm.weight").tp_dim is None
    st_b.close()
    # A -> B -> A: the same row objects, byte for byte
    rows = sorted((tmp_path / "a").rglob("c/*/0"))
    assert len(rows) >= 4
    for path in rows:
        other = tmp_path / "c" / path.relative_to(tmp_path / "a")
        assert other.read_bytes() == path.read_bytes(), path


@pytest.mark.parametrize("start", [(2, 3), (3, 2)])
def test_every_path_to_one_rank_gives_the_same_bytes(tmp_path, start):
    """Routes through other layouts (odd numels at dp 3 and 4, fused q/k/v and gate/up, bf16,
    a 3-D tensor) end in the same bytes: the consolidated file, and the row objects of a
    reshard to tp 1 x dp 1, which hold the logical tensors."""
    full = write_mesh_step(tmp_path / "a", 2, *start)
    routes = [[], [(4, 1)], [(3, 2)], [(1, 4), (2, 3)], [(2, 2), (3, 1), (1, 3)]]
    files, rows = [], []
    for k, route in enumerate(routes):
        src = tmp_path / "a"
        for i, (tp, dp) in enumerate([*route, (1, 1)]):
            nxt = tmp_path / f"route-{k}-{i}"
            done = run_cli("reshard", str(src), str(nxt), "--tp", str(tp), "--dp", str(dp))
            assert done.returncode == 0, done.stderr
            src = nxt
        out = tmp_path / f"model-{k}.safetensors"
        assert run_cli("consolidate", str(src), str(out)).returncode == 0
        files.append(out.read_bytes())
        rows.append({p.relative_to(src): p.read_bytes() for p in src.rglob("c/*/0")})
    assert all(f == files[0] for f in files[1:])
    assert rows[0] and all(r == rows[0] for r in rows[1:])
    got = load_file(tmp_path / "model-0.safetensors")
    for name, tensor in full.items():
        if name.startswith("model/"):
            assert torch.equal(got[name.removeprefix("model/")], tensor), name


def test_tp_reshard_of_a_data_parallel_step_is_refused(tmp_path):
    write_mesh_step(tmp_path / "a", 1, 2, 2)
    st = CheckpointRoot.open(str(tmp_path / "a")).step(1)
    flat = {name: st.read(name) for name in st.tensors}
    st.close()
    # A data-parallel step of the same tensors (what a job without tp saves).
    root = CheckpointRoot.open(str(tmp_path / "b"))
    specs = [
        TensorSpec(n, tuple(t.shape), t.dtype, even_layout(t.numel(), 1)) for n, t in flat.items()
    ]
    writer = root.writer(1, rank=0, world_size=1, specs=specs, attrs={})
    writer.write({n: t.reshape(-1) for n, t in flat.items() if t.numel()})
    writer.commit()
    result = run_cli("reshard", str(tmp_path / "b"), str(tmp_path / "c"), "--tp", "2", "--dp", "2")
    assert result.returncode != 0
    assert "records no tensor-parallel layout" in result.stderr, result.stderr


def test_scatter_of_strided_copies_equals_one_copy_per_row():
    """[Note: mesh scatter]: a planned copy over several rows, done as one strided copy, lands
    exactly where one copy per row puts it: from a read that starts anywhere in the piece,
    into a view at an offset (as the engine's own tensors may be), with single-row copies
    between them."""
    from zerostate.layout.planner import Copy
    from zerostate.store.reader_v2 import _scatter

    rng = random.Random(5)
    for _ in range(200):
        copies, at, src = [], rng.randrange(4), rng.randrange(5)
        lo = src
        for _ in range(rng.randrange(1, 6)):
            n, rows = rng.randrange(1, 7), rng.randrange(1, 5)
            tstride = n + rng.randrange(0, 4)
            sstride = n + rng.randrange(0, 3)
            if rows == 1:
                tstride = sstride = 0
            copies.append(Copy((0, 0), src, n, at, rows, sstride, tstride))
            at += (rows - 1) * tstride + n + rng.randrange(0, 3)
            src += (rows - 1) * sstride + n + rng.randrange(0, 2)
        data = torch.arange(1, src - lo + 1, dtype=torch.float32)
        want = torch.zeros(at + 8)
        for c in copies:
            for k in c.flat():
                a, s = k.target_offset, k.source_offset - lo
                want[a : a + k.numel] = data[s : s + k.numel]
        base = torch.zeros(at + 11)
        got = base[3:]
        _scatter(got, data, lo, copies)
        assert torch.equal(got, want), copies
        assert torch.equal(base[:3], torch.zeros(3))
