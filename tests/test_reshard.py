"""Offline resharding N -> M: contents, layouts, attrs, refusal of clobbering."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerostate.errors import ConfigError
from zerostate.layout.partition import even_layout, plan_layouts
from zerostate.store import open_checkpoint, save_tensors
from zerostate.store.reshard import reshard

SHAPES = {
    "model/wte.weight": (37, 19),
    "model/h.0.w": (19, 23),
    "model/h.0.b": (23,),
    "optim/exp_avg/wte.weight": (37, 19),
    "optim/exp_avg_sq/wte.weight": (37, 19),
    "buffers/step": (),
}
ATTRS = {"engine": {"stage": 2, "precision": "bf16", "world_size": 3}, "client_state": {"x": 1}}


def source_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], world_size: int) -> None:
    save_tensors(str(root), 5, tensors, world_size=world_size, min_shard_numel=64, attrs=ATTRS)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("src")
    tensors = source_tensors()
    write_checkpoint(root, tensors, 3)
    return root, tensors


@pytest.mark.parametrize("world_size", [1, 2, 4, 5])
def test_reshard_reads_back_equal_and_verifies(source, tmp_path: Path, world_size: int) -> None:
    root, tensors = source
    dst = tmp_path / "dst"
    seen: list[tuple[int, int]] = []
    result = reshard(
        str(root),
        str(dst),
        world_size,
        min_shard_numel=64,
        progress=lambda d, t: seen.append((d, t)),
    )
    assert (result.src_world_size, result.world_size, result.step) == (3, world_size, 5)
    assert seen and seen[-1][0] == seen[-1][1] == result.total_bytes

    src_order = list(open_checkpoint(str(root)).step().tensors)
    st = open_checkpoint(str(dst)).step()
    assert st.world_size == world_size and list(st.tensors) == src_order
    # The plan is over the tensors in the source step's order, as an engine would make it.
    want = plan_layouts([tensors[n].numel() for n in src_order], world_size, 64)
    assert [info.layout for info in st.tensors.values()] == want
    for name, t in tensors.items():
        assert st.tensors[name].shape == tuple(t.shape)
        assert torch.equal(st.read(name), t), name
    st.verify()
    assert st.attrs["engine"]["world_size"] == world_size
    assert st.attrs["engine"]["stage"] == 2 and st.attrs["client_state"] == {"x": 1}
    assert st.attrs["resharded_from"] == {"world_size": 3, "step": 5}


def test_existing_step_needs_force(source, tmp_path: Path) -> None:
    root, tensors = source
    dst = tmp_path / "dst"
    reshard(str(root), str(dst), 2)
    with pytest.raises(ConfigError, match="--force"):
        reshard(str(root), str(dst), 4)
    reshard(str(root), str(dst), 4, force=True)
    st = open_checkpoint(str(dst)).step()
    assert st.world_size == 4
    assert torch.equal(st.read("model/h.0.w"), tensors["model/h.0.w"])


def test_bad_arguments(source, tmp_path: Path) -> None:
    root, _ = source
    with pytest.raises(ConfigError, match="world_size"):
        reshard(str(root), str(tmp_path / "x"), 0)
    with pytest.raises(ConfigError, match="same checkpoint"):
        reshard(str(root), str(root), 2)


def test_default_plan_is_even_v2_and_streams_the_source_in_blocks(
    source, tmp_path: Path, monkeypatch
) -> None:
    from zerostate.store import reshard as module

    monkeypatch.setattr(module, "BLOCK_NBYTES", 40)  # many small blocks, unaligned to rows
    root, tensors = source
    reshard(str(root), str(tmp_path / "dst"), 4)
    st = open_checkpoint(str(tmp_path / "dst")).step()
    assert st.format_version == 2 and st.world_size == 4
    assert all(info.layout == even_layout(info.numel, 4) for info in st.tensors.values())
    for name, t in tensors.items():
        assert torch.equal(st.read(name), t), name
    st.verify()
