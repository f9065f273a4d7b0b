"""Buffers as torch treats them: non-persistent buffers are neither saved nor loaded,
complex buffers are stored as their real pairs and read back bit for bit, and DTensor
buffers (torchtitan's RoPE cache after ``parallelize_module``) pass ``sync_module_states``,
save and load ([Note: buffers as torch treats them] in zerostate.runtime.adapt)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from safetensors.torch import load_file
from torch import nn

import zerostate
from zerostate.errors import CheckpointError, ConfigError, ZerostateError
from zerostate.store import open_checkpoint
from zerostate.store.consolidate import consolidate
from zerostate.store.format import COMPLEX_ATTR
from zerostate.store.reshard import reshard


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bits(t: torch.Tensor) -> list[int]:
    """A tensor's exact bits (complex numbers as their real pairs), comparable with ==."""
    t = _local(t).detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view({8: torch.int64, 4: torch.int32}[t.element_size()]).tolist()


def _freqs_cis(n: int = 4, dim: int = 6) -> torch.Tensor:
    """torchtitan's RoPE cache: complex64 ``polar(1, t * freqs)``."""
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return torch.polar(torch.ones(n, dim // 2), torch.outer(torch.arange(n).float(), freqs))


def _step(engine: zerostate.Engine, model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    engine.backward(engine(torch.randn(4, model.width, generator=g)))
    engine.step()


# ------------------------------------------------------------------ non-persistent buffers
class Cached(nn.Module):
    """A persistent buffer beside two non-persistent ones (a complex RoPE cache, as
    torchtitan's ``freqs_cis``, and a rotary ``inv_freq``)."""

    width = 6

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("freqs_cis", _freqs_cis(), persistent=False)
        self.register_buffer("inv_freq", torch.arange(6.0) / 7, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rot = torch.view_as_real(_local(self.freqs_cis)).sum()
        return (self.lin(x * self.inv_freq) * _local(self.scale)).square().mean() + 0 * rot


def _non_persistent_worker(rank: int, world_size: int, root: str, phase: str) -> dict:
    torch.manual_seed(0)
    model = Cached()
    with zerostate.Engine(model, stage=2, lr=1e-2) as engine:
        if phase == "save":
            _step(engine, model, 0)
            with torch.no_grad():
                model.scale.mul_(3)  # a persistent buffer the step must carry
            engine.save(root)
            return {}
        with torch.no_grad():  # what a load must leave alone, as load_state_dict does
            model.freqs_cis.mul_(2)
            model.inv_freq.fill_(0.25)
        engine.load(root)
        return {n: _bits(b) for n, b in model.named_buffers()}


def test_non_persistent_buffers_are_neither_saved_nor_loaded(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_distributed(_non_persistent_worker, 2, root, "save", timeout=300)
    st = open_checkpoint(root).step()
    buffers = {n for n in st.tensors if n.startswith("buffers/")}
    assert buffers == {"buffers/scale"}  # neither freqs_cis (complex) nor inv_freq

    expected = Cached()
    with torch.no_grad():
        expected.scale.mul_(3)
        expected.freqs_cis.mul_(2)
        expected.inv_freq.fill_(0.25)
    want = {n: _bits(b) for n, b in expected.named_buffers()}
    for world in (2, 1):  # strict load at the saved and at another world size
        for got in run_distributed(_non_persistent_worker, world, root, "load", timeout=300):
            assert got == want

    out = tmp_path / "m.safetensors"
    consolidate(root, str(out))
    tensors = load_file(str(out))
    assert sorted(tensors) == sorted(Cached().state_dict())
    assert _bits(tensors["scale"]) == want["scale"]


# ------------------------------------------------------------------ complex buffers
class Complex(nn.Module):
    """Persistent complex64 and complex128 buffers."""

    width = 4

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("rot", _freqs_cis(3, 8))  # complex64 (3, 4)
        g = torch.Generator().manual_seed(1)
        self.register_buffer("phase", torch.randn(5, dtype=torch.complex128, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.view_as_real(self.rot).sum() + torch.view_as_real(self.phase).sum()
        return self.lin(x).square().mean() + 0 * r.float()


def _complex_worker(rank: int, world_size: int, root: str, phase: str) -> dict:
    torch.manual_seed(0)
    model = Complex()
    with zerostate.Engine(model, stage=3, lr=1e-2) as engine:
        if phase == "save":
            _step(engine, model, 0)
            with torch.no_grad():
                model.rot.mul_(torch.polar(torch.tensor(1.0), torch.tensor(0.3)))
                model.phase.mul_(1 / 3)  # values that need every mantissa bit
            engine.save(root)
            return {n: _bits(b) for n, b in model.named_buffers()}
        with torch.no_grad():
            model.rot.zero_()
            model.phase.zero_()
        engine.load(root)
        return {n: _bits(b) for n, b in model.named_buffers()}


def test_complex_buffers_round_trip_bit_for_bit(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_complex_worker, 2, root, "save", timeout=300)[0]
    st = open_checkpoint(root).step()
    for name, dtype, shape, logical in (
        ("buffers/rot", torch.float32, (3, 4, 2), "complex64"),
        ("buffers/phase", torch.float64, (5, 2), "complex128"),
    ):
        info = st.tensors[name]
        assert (info.dtype, tuple(info.shape), info.attrs[COMPLEX_ATTR]) == (
            dtype,
            shape,
            logical,
        )

    for world in (2, 1):
        for got in run_distributed(_complex_worker, world, root, "load", timeout=300):
            assert got == saved

    # Offline reshard keeps the pairs and their dtype; a load from it is bit-identical.
    resharded = str(tmp_path / "w1")
    reshard(root, resharded, 1)
    assert open_checkpoint(resharded).step().tensors["buffers/rot"].attrs[COMPLEX_ATTR] == (
        "complex64"
    )
    assert run_distributed(_complex_worker, 1, resharded, "load", timeout=300)[0] == saved

    # consolidate: complex64 is safetensors' C64; complex128 (no safetensors dtype) is its
    # float64 real pairs, with a warning. Never cast, even when a dtype is asked for.
    out = tmp_path / "m.safetensors"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consolidate(root, str(out), dtype="bf16")
    assert any("buffers/phase is torch.complex128" in str(w.message) for w in caught)
    tensors = load_file(str(out))
    assert tensors["rot"].dtype == torch.complex64 and tensors["rot"].shape == (3, 4)
    assert _bits(tensors["rot"]) == saved["rot"]
    assert tensors["phase"].dtype == torch.float64 and tensors["phase"].shape == (5, 2)
    assert _bits(torch.view_as_complex(tensors["phase"])) == saved["phase"]
    assert tensors["lin.weight"].dtype == torch.bfloat16

    # The way out to DCP (`zerostate convert --to dcp`) hands FSDP2 the complex tensors.
    from zerostate.store.foreign.dcp_write import dcp_state_dict

    model = dcp_state_dict(open_checkpoint(root).step())["model"]
    assert (model["rot"].dtype, model["phase"].dtype) == (torch.complex64, torch.complex128)
    assert _bits(model["rot"]) == saved["rot"] and _bits(model["phase"]) == saved["phase"]


def test_unstorable_dtypes_name_the_tensor() -> None:
    from zerostate.layout.partition import even_layout
    from zerostate.store.writer import TensorSpec

    with pytest.raises(ConfigError, match=r"tensor 'buffers/c' has dtype torch.complex64.*"):
        TensorSpec("buffers/c", (2,), torch.complex64, even_layout(2, 1))
    with pytest.raises(ConfigError, match=r"tensor 'model/q' has dtype torch.float8_e4m3fnuz"):
        TensorSpec("model/q", (2,), torch.float8_e4m3fnuz, even_layout(2, 1))


def test_save_tensors_stores_complex_tensors_as_real_pairs(tmp_path: Path) -> None:
    from zerostate.store.tensors import save_tensors

    g = torch.Generator().manual_seed(2)
    c = torch.randn(3, 5, dtype=torch.complex64, generator=g)
    save_tensors(str(tmp_path), 1, {"buffers/c": c, "model/w": torch.ones(4)}, world_size=2)
    st = open_checkpoint(str(tmp_path)).step()
    info = st.tensors["buffers/c"]
    assert (info.dtype, tuple(info.shape), info.attrs) == (
        torch.float32,
        (3, 5, 2),
        {COMPLEX_ATTR: "complex64"},
    )
    assert _bits(torch.view_as_complex(st.read("buffers/c").reshape(3, 5, 2))) == _bits(c)


def test_complex_attr_from_storage_is_checked() -> None:
    from zerostate.errors import CorruptCheckpointError
    from zerostate.store.format import complex_dtype

    assert complex_dtype({}, torch.float32, (3,), "t") is None
    assert complex_dtype({COMPLEX_ATTR: "complex64"}, torch.float32, (3, 2), "t") is (
        torch.complex64
    )
    for attrs, dtype, shape in (
        ({COMPLEX_ATTR: "complex64"}, torch.float64, (3, 2)),  # complex128's pairs
        ({COMPLEX_ATTR: "complex64"}, torch.float32, (3,)),  # no pair dimension
        ({COMPLEX_ATTR: "float32"}, torch.float32, (3, 2)),
        ({COMPLEX_ATTR: 7}, torch.float32, (3, 2)),
    ):
        with pytest.raises(CorruptCheckpointError, match=COMPLEX_ATTR):
            complex_dtype(attrs, dtype, shape, "tensor 'buffers/x'")


# ------------------------------------------------------------------ DTensor buffers
def _replicated(t: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(t, mesh, [Replicate()])


def _dtensor_dp_worker(rank: int, world_size: int, root: str, phase: str) -> dict:
    """Plain data parallelism over ranks whose model keeps DTensor buffers (replicated
    over a 1-D mesh of the same ranks): ``Engine`` at default settings."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Cached()
    mesh = init_device_mesh("cpu", (world_size,))
    # Different values on each rank: sync_module_states gives every rank rank 0's.
    model.scale = _replicated(model.scale + rank, mesh)
    model.freqs_cis = _replicated(model.freqs_cis, mesh)
    with zerostate.Engine(model, stage=2, lr=1e-2) as engine:
        synced = _bits(model.scale)
        if phase == "save":
            _step(engine, model, rank)
            engine.save(root)
            return {"synced": synced, "scale": _bits(model.scale)}
        with torch.no_grad():
            _local(model.scale).fill_(-1.0)
        engine.load(root)
        return {"synced": synced, "scale": _bits(model.scale)}


def test_engine_syncs_saves_and_loads_dtensor_buffers(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_dtensor_dp_worker, 2, root, "save", timeout=300)
    start = _bits(torch.linspace(0.5, 1.5, 6))
    assert [r["synced"] for r in saved] == [start, start]  # rank 1 took rank 0's value
    st = open_checkpoint(root).step()
    assert {n for n in st.tensors if n.startswith("buffers/")} == {"buffers/scale"}
    for world in (2, 1):
        for got in run_distributed(_dtensor_dp_worker, world, root, "load", timeout=300):
            assert got["scale"] == saved[0]["scale"]
    out = tmp_path / "m.safetensors"
    consolidate(root, str(out))
    assert _bits(load_file(str(out))["scale"]) == saved[0]["scale"]


class TPNet(nn.Module):
    """Two linears for torch's tensor parallelism, a persistent buffer and torchtitan's
    non-persistent complex RoPE cache."""

    width = 6

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("freqs_cis", _freqs_cis(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rot = torch.view_as_real(_local(self.freqs_cis)).sum()
        h = _local(self.down(torch.relu(self.up(x))))
        scale = self.scale  # a sharded buffer is gathered to be used whole
        scale = scale.full_tensor() if hasattr(scale, "full_tensor") else scale
        return (h * scale).square().mean() + 0 * rot


def _tp_model(mesh, placement: str = "replicate") -> TPNet:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = TPNet()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # As torchtitan's model holds them after parallelize: DTensors on the tp mesh.
    model.freqs_cis = _replicated(model.freqs_cis, mesh)
    if placement == "shard":
        model.scale = distribute_tensor(model.scale, mesh, [Shard(0)])
    else:
        model.scale = _replicated(model.scale, mesh)
    return model


def _tp_worker(rank: int, world_size: int, root: str, phase: str, placement: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if phase == "load_plain":  # the same step without tensor parallelism
        torch.manual_seed(0)
        model = TPNet()
        with zerostate.Engine(model, stage=3, lr=1e-2) as engine:
            engine.load(root)
            return {"scale": _bits(model.scale)}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = _tp_model(mesh["tp"], placement)
    # Default settings: sync_module_states=True broadcasts over data parallelism only.
    with zerostate.Engine(model, mesh=mesh, stage=3, lr=1e-2) as engine:
        if phase == "save":
            _step(engine, model, 0)
            with torch.no_grad():
                _local(model.scale).mul_(1 / 3)
            engine.save(root)
            return {"scale": _bits(model.scale), "freqs": _bits(model.freqs_cis)}
        with torch.no_grad():
            _local(model.scale).zero_()
            _local(model.freqs_cis).zero_()
        engine.load(root)
        return {"scale": _bits(model.scale), "freqs": _bits(model.freqs_cis)}


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_tensor_parallel_model_with_dtensor_buffers(tmp_path: Path, placement: str) -> None:
    """torch's tensor parallelism over 2 ranks; the persistent buffer replicated or
    sharded over tp, the RoPE cache a non-persistent replicated DTensor."""
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_tp_worker, 2, root, "save", placement, timeout=300)
    assert saved[0]["freqs"] == saved[1]["freqs"]
    expected = torch.linspace(0.5, 1.5, 6) / 3  # as the ranks computed it: each its shard
    if placement == "replicate":
        assert saved[0]["scale"] == saved[1]["scale"]
        full = saved[0]["scale"]
    else:
        full = saved[0]["scale"] + saved[1]["scale"]  # Shard(0): rank 0's rows, then rank 1's
    assert len(full) == expected.numel()
    st = open_checkpoint(root).step()
    assert {n for n in st.tensors if n.startswith("buffers/")} == {"buffers/scale"}
    assert tuple(st.tensors["buffers/scale"].shape) == (6,)
    loaded = run_distributed(_tp_worker, 2, root, "load", placement, timeout=300)
    zeros = _bits(torch.zeros(4, 3, dtype=torch.complex64))
    for r, got in enumerate(loaded):  # the persistent one loaded, the RoPE cache left alone
        assert got == {"scale": saved[r]["scale"], "freqs": zeros}
    plain = run_distributed(_tp_worker, 1, root, "load_plain", placement, timeout=300)[0]
    assert plain["scale"] == full
    out = tmp_path / "m.safetensors"
    consolidate(root, str(out))
    tensors = load_file(str(out))
    assert "freqs_cis" not in tensors and _bits(tensors["scale"]) == full


def _sharded_elsewhere_worker(rank: int, world_size: int, root: str) -> dict:
    """Data parallelism over a model whose buffer is sharded over a mesh of the same
    ranks, which the engine has no tensor-parallel dimension for."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = Cached()
    mesh = init_device_mesh("cpu", (world_size,))
    model.scale = distribute_tensor(model.scale, mesh, [Shard(0)])
    with zerostate.Engine(model, stage=2, lr=1e-2) as engine:
        kept = _bits(model.scale)  # left alone: its pieces differ by design
        try:
            engine.save(root)
        except ZerostateError as exc:  # rank 0's own error, a pointer to it elsewhere
            return {"kept": kept, "error": str(exc)}
        return {"kept": kept, "error": None}


def test_dtensor_buffer_sharded_off_the_tp_mesh_is_left_alone_and_refused_at_save(
    tmp_path: Path,
) -> None:
    results = run_distributed(_sharded_elsewhere_worker, 2, str(tmp_path / "c"), timeout=300)
    full = _bits(torch.linspace(0.5, 1.5, 6))
    assert [r["kept"] for r in results] == [full[:3], full[3:]]
    assert all(r["error"] is not None for r in results)
    assert "buffer 'scale'" in results[0]["error"] and "persistent=False" in results[0]["error"]
    with pytest.raises(CheckpointError):
        open_checkpoint(str(tmp_path / "c")).step()
