"""A door back out: write a step as a DCP checkpoint that FSDP2 + ``set_state_dict`` loads.

The layout is what ``get_state_dict`` gives and DCP saves: ``{"model": {fqn: tensor},
"optimizer": {"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [{..., "params":
[fqn, ...]}]}}``, full (unsharded) tensors, which DCP reshards onto any world size at load.
Tied aliases are written under both names, as ``get_state_dict`` writes them. The tensors
are written by torch's own DCP writer (``no_dist``), one process; it holds the step's
model and optimizer tensors in memory while it writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerostate import jsonstate
from zerostate.errors import ConfigError, CorruptCheckpointError
from zerostate.store import format as fmt


@dataclass(frozen=True, slots=True)
class ConvertResult:
    step: int
    out: Path
    num_tensors: int
    total_bytes: int


def dcp_state_dict(st: Any) -> dict:
    """``{"model": ..., "optimizer": ...}`` of step ``st`` in ``get_state_dict``'s layout."""
    engine = st.attrs.get("engine") if isinstance(st.attrs.get("engine"), dict) else {}
    model: dict[str, torch.Tensor] = {}
    for name, info in st.tensors.items():
        for prefix in ("model/", "buffers/"):
            if name.startswith(prefix):
                model[name[len(prefix) :]] = _logical(st.read(name), info, name)
    for alias, canonical in (engine.get("tied") or {}).items():
        if canonical in model:
            model[alias] = model[canonical]
    meta = engine.get("optimizer") if isinstance(engine.get("optimizer"), dict) else {}
    state: dict[str, dict[str, Any]] = {}
    for fqn, entry in (meta.get("state") or {}).items():
        values: dict[str, Any] = {}
        for key, enc in (entry.get("scalars") or {}).items():
            values[key] = jsonstate.decode(enc, f"optimizer state {key} of {fqn}")
        for key in entry.get("tensors") or []:
            name = f"optim/{key}/{fqn}"
            if name not in st.tensors:
                raise CorruptCheckpointError(f"{st.url}: optimizer state {name} is missing")
            values[key] = st.read(name)
        state[fqn] = values
    groups = []
    for members, enc in zip(
        meta.get("group_params") or [], meta.get("param_groups") or [], strict=False
    ):
        if not members:
            continue  # an empty group (no no-decay parameters) is not a torch param group
        hyper = dict(jsonstate.decode(enc, "param group"))
        # zerostate does not record the kernel choice (it depends on where the step ran);
        # torch's optimizers keep both keys in every group, with None meaning "pick one".
        for key in ("foreach", "fused"):
            hyper.setdefault(key, None)
        hyper["params"] = list(members)
        groups.append(hyper)
    out: dict[str, Any] = {"model": model}
    if groups:
        out["optimizer"] = {"state": state, "param_groups": groups}
    return out


def _logical(tensor: torch.Tensor, info: Any, name: str) -> torch.Tensor:
    """A stored tensor as the model holds it: the real pairs of a complex tensor as that
    complex tensor ([Note: complex tensors] in zerostate.store.format)."""
    shape = tuple(info.shape)
    if fmt.complex_dtype(info.attrs, info.dtype, shape, f"tensor {name!r}") is None:
        return tensor
    return torch.view_as_complex(tensor.reshape(shape).contiguous())


def convert_to_dcp(source: Any, out: str | os.PathLike, *, step: int | None = None,
                   force: bool = False) -> ConvertResult:  # fmt: skip
    """Write step ``step`` (latest by default) of the opened checkpoint ``source`` as a
    DCP checkpoint directory ``out``."""
    import torch.distributed.checkpoint as dcp

    path = Path(os.fspath(out))
    if "://" in os.fspath(out):
        raise ConfigError(f"output {os.fspath(out)!r} is a URL: convert writes a local directory")
    if path.exists() and any(path.iterdir()) and not force:
        raise ConfigError(f"output {str(path)!r} exists and is not empty; pass --force")
    st = source.step(step)
    state = dcp_state_dict(st)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    return ConvertResult(
        st.step, path, len(tensors), sum(t.numel() * t.element_size() for t in tensors)
    )


def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]
