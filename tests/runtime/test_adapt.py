"""zerostate.runtime.adapt without processes: canonical names, input casting, compile checks."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from zerostate.errors import ConfigError, StorageError
from zerostate.runtime.adapt import (
    canonical_name,
    canonical_named,
    cast_inputs,
    check_compile,
    named_parameters,
    replicated_state,
)
from zerostate.store import save_tensors

Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("_orig_mod.h.0.w", "h.0.w"),
        ("h.0._orig_mod.attn.w", "h.0.attn.w"),
        ("_orig_mod.h.1._orig_mod.w", "h.1.w"),
        ("h.my_orig_mod.w", "h.my_orig_mod.w"),  # only whole components are dropped
    ],
)
def test_canonical_name(name: str, want: str) -> None:
    assert canonical_name(name) == want


def test_colliding_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="both name 'a.w'"):
        canonical_named([("a.w", 1), ("a._orig_mod.w", 2)])


def test_named_parameters_of_compiled_models_are_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight = model[0].weight  # tied
    plain = named_parameters(model)
    whole = named_parameters(torch.compile(model))
    model[0] = torch.compile(model[0])
    block = named_parameters(model)
    for named, tied in (whole, block):
        assert [n for n, _ in named] == [n for n, _ in plain[0]] == ["0.weight", "0.bias", "1.bias"]
        assert tied == plain[1] == {"1.weight": "0.weight"}


def test_frozen_integer_parameter_is_replicated_state() -> None:
    model = nn.Linear(2, 2)
    model.ids = nn.Parameter(torch.arange(3), requires_grad=False)
    model.register_buffer("seen", torch.zeros(1))
    assert [n for n, _ in named_parameters(model)[0]] == ["weight", "bias"]
    assert [n for n, _ in replicated_state(model)] == ["seen", "ids"]


def test_cast_inputs() -> None:
    x = torch.ones(2)
    ids = torch.arange(3)
    args, kwargs = cast_inputs(
        (x, [x, ids], Pair(x, ids), "text"), {"d": {"m": x, "i": ids}}, torch.bfloat16
    )
    assert args[0].dtype == args[1][0].dtype == args[2].a.dtype == torch.bfloat16
    assert args[1][1] is ids and args[2].b is ids and args[3] == "text"
    assert isinstance(args[2], Pair) and isinstance(args[1], list)
    assert kwargs["d"]["m"].dtype == torch.bfloat16 and kwargs["d"]["i"] is ids
    # Nothing to cast, or casting off: the very same objects come back.
    same = ((x, ids), {"k": x})
    assert cast_inputs(*same, torch.float32) == same
    half = ((x.half(),), {})
    assert cast_inputs(*half, None)[0][0].dtype == torch.float16
    assert cast_inputs(*half, torch.float32)[0][0].dtype == torch.float32


def test_check_compile() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    for stage in (0, 1, 2):
        check_compile(torch.compile(model), stage)
    with pytest.raises(ConfigError, match=r"torch.compile\(model\) cannot be trained at stage 3"):
        check_compile(torch.compile(model), 3)
    model[0] = torch.compile(model[0])
    check_compile(model, 3)  # per block: fine
    inner = nn.Sequential(nn.Linear(2, 2))
    inner[0].compile()
    with pytest.raises(ConfigError, match=r"0.compile\(\) cannot be trained at stage 3"):
        check_compile(inner, 3)


def test_a_file_where_a_checkpoint_root_should_be_written(tmp_path: Path) -> None:
    path = tmp_path / "oops.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(StorageError, match="is a file, not a directory"):
        save_tensors(str(path), 1, {"model/w": torch.ones(2)}, world_size=1)
    assert path.read_bytes() == b"x"
