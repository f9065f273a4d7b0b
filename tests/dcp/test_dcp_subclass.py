"""Tensor subclasses as chunk data through ``zerostate.dcp`` ([Note: tensor subclasses] in
zerostate.dcp.common).

torchao's float8 training keeps each weight as a ``WeightWithDynamicFloat8CastTensor``, a
wrapper subclass with no storage of its own, and FSDP2's DTensors hold such wrappers as
their local tensors (torchtitan's ``float8`` converter with FSDP float8 all-gather). A save
of that state through our writer failed after writing its row ("Attempted to access the
data pointer on an invalid python storage"), where DCP's ``FileSystemWriter`` saves it.
``Wrapped`` below is such a wrapper: its operations run on the tensor it wraps, and the
ones that keep a tensor's identity (``detach``, views) wrap their result again. torchao is
not a test dependency; an FSDP2 state of its float8 weights (torchao 0.18, two ranks) saved
through our writer and loaded through our reader to the same values as DCP's own pair.

Quantized state is the other kind: its stored form (codes and scales) is not its values,
and storing its values would not load back the same codes (torchao's ``AdamW8bit`` moments,
tried by hand, came back with other codes). ``Quantized`` below is such a tensor; it and a
tensor whose value is the sum of two parts are refused at save, naming them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils import _pytree as pytree

from tests.helpers_dist import run_distributed
from zerostate.dcp import StorageReader, StorageWriter
from zerostate.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
aten = torch.ops.aten
#: Operations whose result is the same tensor's data: wrapped again, as torchao does.
KEEP = {aten.detach.default, aten.alias.default, aten.view.default, aten.slice.Tensor,
        aten.t.default, aten.clone.default, aten._to_copy.default}  # fmt: skip


class Wrapped(torch.Tensor):
    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device, strides=inner.stride()
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self._tensor = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Wrapped(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x._tensor if isinstance(x, Wrapped) else x

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func in KEEP:
            return pytree.tree_map(lambda x: cls(x) if isinstance(x, torch.Tensor) else x, out)
        return out


class Opaque(Wrapped):
    """A wrapper whose values cannot be copied out (``copy_`` refused)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.copy_.default:
            raise NotImplementedError("Opaque does not copy")
        return super().__torch_dispatch__(func, types, args, kwargs)


class Quantized(torch.Tensor):
    """int8 codes and a float scale per row, the scale from the row's mean magnitude (as
    quantizers that clip outliers do): its value is ``codes * scale``, and copying values
    into it quantizes them, so values copied out and back in give other codes."""

    @staticmethod
    def __new__(cls, values: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, dtype=values.dtype)

    def __init__(self, values: torch.Tensor) -> None:
        self.scale = values.abs().mean(dim=-1, keepdim=True) / 32 + 1e-12
        self.codes = (values / self.scale).round().clamp(-127, 127).to(torch.int8)

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def value(x):
            return x.codes.float() * x.scale if isinstance(x, Quantized) else x

        if func is aten.copy_.default and isinstance(args[0], Quantized):
            q = Quantized(value(args[1]))
            args[0].codes.copy_(q.codes)
            args[0].scale.copy_(q.scale)
            return args[0]
        if func is aten.detach.default:
            return args[0]
        return func(*pytree.tree_map(value, args), **pytree.tree_map(value, kwargs or {}))


class TwoParts(Wrapped):
    """A value that is the sum of two inner tensors of its own shape and dtype: neither
    inner tensor is its value."""

    def __init__(self, inner: torch.Tensor) -> None:
        self._tensor, self._delta = inner, torch.full_like(inner, 0.5)

    def __tensor_flatten__(self):
        return ["_tensor", "_delta"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def value(x):
            return x._tensor + x._delta if isinstance(x, TwoParts) else x

        if func is aten.detach.default:
            return args[0]
        return func(*pytree.tree_map(value, args), **pytree.tree_map(value, kwargs or {}))


def _values(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_wrapper_subclass_saves_and_loads_in_one_process(tmp_path):
    state = {"w": Wrapped(_values(0, 5, 3)), "b": _values(1, 4)}
    dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "c")))
    target = {"w": Wrapped(torch.zeros(5, 3)), "b": torch.zeros(4)}
    dcp.load(target, storage_reader=StorageReader(str(tmp_path / "c")))
    assert isinstance(target["w"], Wrapped)
    assert torch.equal(target["w"]._tensor, _values(0, 5, 3))
    assert torch.equal(target["b"], _values(1, 4))


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (Opaque, "w: a Opaque cannot be copied"),
        (Quantized, "w: a Quantized is a tensor subclass whose stored form is not its values"),
        (TwoParts, "w: a TwoParts is a tensor subclass whose stored form is not its values"),
    ],
)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_a_subclass_whose_values_are_not_its_stored_form_is_refused(
    tmp_path, cls, expected, asynchronous
):
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "c"
    state = {"w": cls(_values(0, 5, 3)), "b": _values(1, 4)}
    save = dcp.async_save if asynchronous else dcp.save
    with pytest.raises((CheckpointException, ConfigError), match=expected):
        result = save(state, storage_writer=StorageWriter(str(root)))
        if asynchronous:
            result.result()
    assert not root.exists() or not list(root.glob("step-*/_zerostate/commit"))


def test_quantized_state_would_change_if_stored_as_its_values():
    """Why the refusal above: the values copied out and quantized again give other codes."""
    original = Quantized(_values(0, 5, 300) * torch.linspace(0.1, 3, 300))
    values = torch.empty(5, 300)
    values.copy_(original)
    again = Quantized(torch.zeros(5, 300))
    again.copy_(values)
    assert not torch.equal(again.codes, original.codes) or not torch.equal(
        again.scale, original.scale
    )


def save_sharded(rank: int, world_size: int, root: str, asynchronous: bool) -> None:
    """A DTensor sharded by rows whose local tensor is a wrapper (FSDP2's layout of torchao's
    float8 weights), saved through our writer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    full = _values(5, 7, 3)
    local = full.tensor_split(world_size)[rank].clone()
    w = DTensor.from_local(Wrapped(local), mesh, [Shard(0)], run_check=False, shape=full.shape,
                           stride=full.stride())  # fmt: skip
    state = {"w": w, "n": 3}
    if asynchronous:
        dcp.async_save(state, storage_writer=StorageWriter(root)).result()
    else:
        dcp.save(state, storage_writer=StorageWriter(root))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_fsdp2_style_wrapped_locals_save_at_2_ranks_and_load_in_one_process(tmp_path, asynchronous):
    root = str(tmp_path / "c")
    run_distributed(save_sharded, 2, root, asynchronous)
    target = {"w": torch.zeros(7, 3), "n": 0}
    dcp.load(target, storage_reader=StorageReader(root), no_dist=True)
    assert torch.equal(target["w"], _values(5, 7, 3)) and target["n"] == 3


def test_zerostate_save_of_a_wrapper_loads_into_one(tmp_path):
    import zerostate

    root = str(tmp_path / "s")
    zerostate.save({"w": Wrapped(_values(0, 5, 3)), "k": 2}, root, step=1)
    target = {"w": Wrapped(torch.zeros(5, 3)), "k": 0}
    assert zerostate.load(target, root) == 1
    assert torch.equal(target["w"]._tensor, _values(0, 5, 3)) and target["k"] == 2


class Tagged(torch.Tensor):
    """A subclass over its own storage, with torch's kernels: its bytes are its values."""


class Packed(torch.nn.Parameter):
    """A Parameter subclass with an attribute, as bitsandbytes keeps packed weights."""

    def __new__(cls, data: torch.Tensor, blocksize: int = 64):
        p = torch.Tensor._make_subclass(cls, data, False)
        p.blocksize = blocksize
        return p


@pytest.mark.parametrize("how", ["save", "async_save", "zerostate.save"])
def test_subclasses_over_their_own_storage_are_stored_as_their_bytes(tmp_path, how):
    """2e8af83 refused these (no inner tensor holds their values: they hold them
    themselves); they saved before it and save again."""
    import zerostate

    root = str(tmp_path / "c")
    packed = torch.randint(0, 255, (6, 1), dtype=torch.uint8)
    state = {"t": _values(0, 4, 3).as_subclass(Tagged), "p": Packed(packed)}
    if how == "save":
        dcp.save(state, storage_writer=StorageWriter(root))
    elif how == "async_save":
        dcp.async_save(state, storage_writer=StorageWriter(root)).result()
    else:
        zerostate.save(state, root, step=0)
    target = {"t": torch.zeros(4, 3).as_subclass(Tagged), "p": Packed(torch.zeros_like(packed))}
    dcp.load(target, storage_reader=StorageReader(root))
    assert torch.equal(target["t"].as_subclass(torch.Tensor), _values(0, 4, 3))
    assert torch.equal(target["p"].data, packed)
