"""What a checkpoint keeps beside the tensors: JSON state, RNG states, the model config.

``stateful`` objects (schedulers, samplers) and ``client_state`` are stored as JSON
(tensors encoded by :mod:`zerostate.jsonstate`, never pickle); each rank's RNG states go
into its own manifest; a Hugging Face model's config goes into the commit record so that
``zerostate consolidate`` can write ``config.json`` beside the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch

from zerostate import jsonstate
from zerostate.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


def digest(value: Any) -> int:
    """A 63-bit fingerprint of a JSON value, for comparing it across ranks."""
    raw = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def check_stateful(stateful: Any, *, loading: bool) -> dict:
    """``stateful`` as a dict after checking each object has the method the call needs."""
    if stateful is None:
        return {}
    if not isinstance(stateful, dict) or not all(isinstance(k, str) for k in stateful):
        raise ConfigError("stateful must be a dict of {name: object with state_dict()}")
    method = "load_state_dict" if loading else "state_dict"
    for name, obj in stateful.items():
        if not callable(getattr(obj, method, None)):
            raise ConfigError(
                f"stateful[{name!r}] ({type(obj).__name__}) has no {method}(); pass objects "
                "with state_dict() and load_state_dict(), such as LR schedulers"
            )
    return stateful


def json_checked(value: Any, what: str) -> Any:
    """``value``, after checking that it serialises to JSON."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serialisable (dicts, lists, str, int, float, bool, None): {exc}"
        ) from exc
    return value


def transformers_config(module: Any) -> dict | None:
    """A Hugging Face model's ``config.json`` content (what ``from_pretrained`` needs beside
    the weights), or None for other models."""
    module = getattr(module, "_orig_mod", module)  # torch.compile
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json) or not callable(getattr(module, "save_pretrained", None)):
        return None
    try:
        data = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError) as exc:
        log.warning("zerostate: not recording the model's config (not JSON): %s", exc)
        return None
    if isinstance(data, dict) and not data.get("architectures"):
        data["architectures"] = [type(module).__name__]  # as save_pretrained records it
    return data if isinstance(data, dict) else None


def left_behind(st: Any, stateful: dict, world_size: int) -> list[str]:
    """What step ``st`` saved that a load with ``stateful`` at ``world_size`` does not restore."""
    shared, per_rank = st.attrs.get("stateful"), st.attrs.get("stateful_per_rank")
    saved = {n for n in shared if isinstance(n, str)} if isinstance(shared, dict) else set()
    if isinstance(per_rank, list):
        saved |= {n for n in per_rank if isinstance(n, str)}
    left = [f"stateful[{name!r}]" for name in sorted(saved - set(stateful))]
    if st.world_size != world_size and saved_rng(st):
        left.append(
            f"RNG states of {st.world_size} ranks (restored only at the same world size; "
            f"this run has {world_size})"
        )
    return left


def saved_rng(st: Any) -> bool:
    """Whether step ``st`` holds RNG states: every zerostate save keeps each rank's (in its
    manifest, or as ``rng/`` tensors in format 1); a peer's step (DeepSpeed, DCP) is read
    without them."""
    state = st.attrs.get("engine")
    if not (isinstance(state, dict) and state.get("source") in ("deepspeed", "dcp")):
        return True
    return any(name.startswith("rng/") for name in st.tensors)


def rng_state() -> dict:
    """This rank's RNG states, JSON-encoded for the manifest's per-rank slot."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return jsonstate.encode(states, "RNG state")


def saved_rank_state(
    st: Any, stateful: dict, strict: bool, *, rank: int, world_size: int
) -> tuple[dict | None, dict[str, Any]]:
    """``(RNG states to restore or None, {name: decoded state} for ``stateful``)``.

    [Note: per-rank stateful objects]
    A save compares the encoded state of each ``stateful`` object across ranks. One
    that is equal on every rank (a scheduler; a sampler that keeps a global position)
    is stored once, in the commit record, and restored on every rank at any world
    size. Otherwise each rank's states go into its own manifest and can only be restored
    at the same world size, each rank taking its own; at another world size the load
    fails naming them, because no mapping of N ranks' positions onto M ranks is right in
    general: keep such state global (derive per-rank parts such as RNG seeds from a
    saved base seed and the rank) or leave it out. RNG states are per rank too and are
    restored only at the same world size (elsewhere the ranks keep their own streams).
    Each rank reads at most its own manifest."""
    mine = None
    if st.world_size == world_size:
        mine = st.rank_state(rank) or {}
    objects: dict[str, Any] = {}
    shared = st.attrs.get("stateful")
    for name in stateful:
        if isinstance(shared, dict) and name in shared:
            value = shared[name]
        elif mine is not None and name in mine.get("stateful", {}):
            value = mine["stateful"][name]
        elif name in st.attrs.get("stateful_per_rank", ()):
            raise CheckpointError(
                f"stateful[{name!r}] was saved with a different state on each of "
                f"{st.world_size} ranks and cannot be mapped onto {world_size} "
                "ranks; make its state the same on every rank (derive per-rank parts "
                "from the rank) or leave it out of stateful= when the world size "
                "changes"
            )
        elif strict:
            raise CheckpointError(
                f"step {st.step} holds no state for stateful[{name!r}]; was it saved "
                "with engine.save(..., stateful={...}) under that name? (strict=False "
                "leaves the object as it is)"
            )
        else:
            continue
        objects[name] = jsonstate.decode(value, f"stateful[{name!r}]")
    rng = None
    if mine is not None and "rng" in mine:
        rng = jsonstate.decode(mine["rng"], f"RNG state of rank {rank}")
    return rng, objects


def restore_rng(st: Any, rng: dict | None, *, rank: int, world_size: int) -> None:
    """Put this rank's saved RNG states back (only at the world size that saved them)."""
    if st.world_size != world_size:
        return  # RNG streams of N ranks cannot be mapped onto M ranks
    if rng is None:  # format 1 kept them as tensors
        rng = {
            kind: st.read(f"rng/rank-{rank:05d}/{kind}")
            for kind in ("cpu", "cuda")
            if f"rng/rank-{rank:05d}/{kind}" in st.tensors
        }
    if isinstance(rng.get("cpu"), torch.Tensor):
        torch.set_rng_state(rng["cpu"].to(torch.uint8))
    if isinstance(rng.get("cuda"), torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))
