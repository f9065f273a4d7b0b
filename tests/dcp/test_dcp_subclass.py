"""Tensor subclasses as chunk data through ``zerostate.dcp`` (``plain_data`` in
zerostate.dcp.common).

torchao's float8 training keeps each weight as a ``WeightWithDynamicFloat8CastTensor``, a
wrapper subclass with no storage of its own, and FSDP2's DTensors hold such wrappers as
their local tensors (torchtitan's ``float8`` converter with FSDP float8 all-gather). A save
of that state through our writer failed after writing its row ("Attempted to access the
data pointer on an invalid python storage"), where DCP's ``FileSystemWriter`` saves it.
``Wrapped`` below is such a wrapper: its operations run on the tensor it wraps, and the
ones that keep a tensor's identity (``detach``, views) wrap their result again. torchao is
not a test dependency; an FSDP2 state of its float8 weights (torchao 0.18, two ranks) saved
through our writer and loaded through our reader to the same values as DCP's own pair."""

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
        return f"Wrapped({self._tensor!r})"

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


def test_a_subclass_that_cannot_be_copied_is_refused_naming_it(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"w": Opaque(_values(0, 5, 3))}
    with pytest.raises((CheckpointException, ConfigError), match=r"w: a Opaque cannot be copied"):
        dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "c")))


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
