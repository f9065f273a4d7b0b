"""What users hand the engine, made uniform: parameter names of compiled modules, forward
inputs, and the checkpoint root a save goes to.

[Note: canonical names]
``torch.compile(module)`` returns an ``OptimizedModule`` that holds the original as
``_orig_mod``; compiling a submodule in place (``model.h[0] = torch.compile(block)``)
puts ``_orig_mod`` in the middle of every name below it. ``module.compile()`` compiles in
place and changes no name. Checkpoint names must not depend on how the model was compiled,
so the engine names every parameter and buffer by :func:`canonical_name`, which drops each
``_orig_mod`` component. Loading then works compiled -> uncompiled and the reverse, and
consolidation gives the names of the plain model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerostate.errors import ConfigError

log = logging.getLogger("zerostate")

_COMPILED_WRAPPER = "_orig_mod"


# ------------------------------------------------------------------- canonical names
def canonical_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components torch.compile wrappers add."""
    if _COMPILED_WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILED_WRAPPER)


def canonical_named(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(canonical_name(n), x)`` for each pair; refuses two entries that collide."""
    out: list[tuple[str, Any]] = []
    seen: dict[str, str] = {}
    for name, value in pairs:
        canonical = canonical_name(name)
        if canonical in seen and seen[canonical] != name:
            raise ConfigError(
                f"{name!r} and {seen[canonical]!r} both name {canonical!r} once the "
                "torch.compile wrapper (_orig_mod) is removed; rename the attribute"
            )
        seen[canonical] = name
        out.append((canonical, value))
    return out


def named_parameters(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], dict[str, str]]:
    """The engine's partitioned parameters: ``(canonical name, parameter)`` once per
    floating-point parameter, and ``tied`` (``{alias: canonical name of the first owner}``).
    Frozen non-floating-point parameters are replicated state instead, see
    :func:`replicated_state`."""
    named = canonical_named((n, p) for n, p in model.named_parameters() if p.is_floating_point())
    first = {id(p): n for n, p in named}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(name)
        if id(p) in first and first[id(p)] != name:
            tied[name] = first[id(p)]
    return named, tied


def replicated_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the state every rank keeps whole: buffers, then frozen
    non-floating-point parameters (an integer ``nn.Parameter(..., requires_grad=False)``:
    nothing to optimise, so it is neither partitioned nor given optimizer state; it is
    checkpointed like a buffer, as ``buffers/<name>`` in its own dtype). Names as the
    module has them (``_orig_mod.`` included)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.is_floating_point()]
    return list(model.named_buffers()) + frozen


def buffers_with_persistence(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, buffer, persistent)`` of every buffer, names as the module has them (the
    first name of a shared buffer). ``persistent=False`` buffers (a rotary ``inv_freq``)
    are the ones ``model.state_dict()`` leaves out."""
    out: dict[str, tuple[str, torch.Tensor, bool]] = {}
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for n, b in module._buffers.items():
            if b is not None:
                name = f"{prefix}.{n}" if prefix else n
                out.setdefault(name, (name, b, n not in skip))
    return list(out.values())


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """Canonical names of the buffers ``model.state_dict()`` leaves out; checkpoints leave
    them out too ([Note: buffers as torch treats them])."""
    buffers = buffers_with_persistence(model)
    return sorted({canonical_name(n) for n, _, persistent in buffers if not persistent})


# [Note: buffers as torch treats them]
# * A non-persistent buffer (``register_buffer(..., persistent=False)``: a rotary
#   ``inv_freq`` or ``freqs_cis``) is what the model recomputes from its configuration;
#   ``state_dict()`` leaves it out and ``load_state_dict`` neither wants nor restores it.
#   The engine does the same: a save does not write it, a load neither reads nor misses
#   it (an older step that holds one is read without it), so ``consolidate`` never sees
#   it. Only its start-up value is made equal on every rank (``sync_module_states``).
# * A buffer that is a DTensor (torch's tensor parallelism, or a model that distributes
#   its own cache) is computed with through its local tensor, which is what the engine
#   broadcasts, saves and loads. ``sync_module_states`` broadcasts that local tensor over
#   the data-parallel group(s) only, as it does a DTensor parameter's local shard: the
#   data-parallel peers of a rank hold the same tensor-parallel coordinate, so the first
#   peer's local tensor is the right value for all of them. Across the tensor-parallel
#   ranks it is left as torch's ``parallelize_module`` left it (torch never broadcasts a
#   buffer there, and a sharded buffer's pieces differ by design). A DTensor whose
#   placements are all ``Replicate()`` holds its whole value locally, so it is saved
#   whole, from the step's rank 0, and loads back in place, bit for bit. One sharded
#   (``Shard(d)``) on the engine's ``tp`` mesh is saved as a parameter is, as its tp x dp
#   pieces of the global tensor ([Note: tensor-parallel checkpoints] in
#   zerostate.checkpoint.tensor_parallel), so any layout reads it and each rank loads its own
#   shard in place. Any other placement (``Partial``, or sharded over a mesh that is not
#   the engine's ``tp``) is refused at save and load, naming the buffer.
# * A complex buffer is stored as its real pairs ([Note: complex tensors] in
#   zerostate.store.format), read back into the buffer's own memory bit for bit.
def buffer_to_sync(buf: torch.Tensor, tp_mesh: Any = None) -> torch.Tensor | None:
    """The tensor ``sync_module_states`` broadcasts over the data-parallel group(s) for
    buffer ``buf``: ``buf`` itself; a DTensor's local tensor when its data-parallel peers
    hold the same piece (all placements ``Replicate()``, or on the engine's ``tp`` mesh
    ``tp_mesh``); None, left alone, for a DTensor sharded over another mesh."""
    from zerostate.dist import collectives

    if not collectives.is_dtensor(buf):
        return buf
    replicated = all(p == "replicate" for p in collectives.dtensor_placements(buf))
    if replicated or (tp_mesh is not None and buf.device_mesh == tp_mesh):
        return collectives.dtensor_local(buf)
    return None


@dataclass(frozen=True)
class StoredBuffer:
    """What a checkpoint holds of one persistent buffer ([Note: buffers as torch treats
    them]): ``local`` is the buffer's own memory as stored (a DTensor's local tensor; a
    complex one as its real pairs), so a load reads straight into it; ``shape`` the stored
    global shape; ``tp_dim`` the dimension a DTensor buffer is sharded along the engine's
    ``tp`` mesh (None: whole on every rank)."""

    local: torch.Tensor
    attrs: dict
    shape: tuple[int, ...]
    tp_dim: int | None = None


def stored_buffer(name: str, buf: torch.Tensor, tp_mesh: Any = None) -> StoredBuffer:
    """How persistent buffer ``name`` is stored; ``tp_mesh``: the engine's ``tp`` mesh,
    the one mesh a sharded DTensor buffer may be on. Raises ``ConfigError`` naming the
    buffer for what cannot be stored."""
    from zerostate.dist import collectives
    from zerostate.store import format as fmt

    local, tp_dim = buf, None
    if collectives.is_dtensor(buf):
        placements = collectives.dtensor_placements(buf)
        sharded = [p for p in placements if p != "replicate"]
        on_tp = tp_mesh is not None and buf.device_mesh == tp_mesh
        if sharded and not (on_tp and len(sharded) == 1 and sharded[0].startswith("shard(")):
            raise ConfigError(
                f"buffer {name!r} is a DTensor with placements {placements} on mesh "
                f"{buf.device_mesh.mesh_dim_names}; the engine saves a DTensor buffer that "
                "is replicated, or sharded (Shard(d)) on the mesh's 'tp' dimension. Register "
                "it with persistent=False if the model recomputes it (as a RoPE cache), or "
                "redistribute it (DTensor.redistribute(mesh, [Replicate()]))"
            )
        if sharded:
            tp_dim = int(sharded[0][len("shard(") : -1])
        local = collectives.dtensor_local(buf)
    stored, attrs = fmt.as_real_pairs(local)
    fmt.dtype_name(stored.dtype, f"buffers/{name}")  # refused here, naming the buffer
    shape = tuple(buf.shape) + tuple(stored.shape[local.dim() :])  # + (2,) for pairs
    return StoredBuffer(stored, attrs, shape, tp_dim)


def check_compile(model: nn.Module, stage: int) -> None:
    """Refuse the torch.compile uses stage 3 cannot run, before anything is built.

    [Note: stage 3 and torch.compile]
    Stage 3 gathers a unit's parameters in forward hooks and frees them (storage resized
    to zero) after it. A whole-model ``torch.compile(model)`` or any ``module.compile()``
    puts those hooks inside the compiled region: Dynamo traces the storage resizes, and
    once parameter sizes vary they become symbolic, which Inductor cannot lower
    (``LoweringException: ... resize_storage_bytes_``). ``torch.compile(block)`` assigned
    in place of a block keeps the hooks on the wrapper, outside the compiled code, and
    works, as it does with FSDP2. Stages 0-2 run hooks only on gradients and take any of
    the three forms.
    """
    if stage != 3:
        return
    fix = (
        "stage 3 gathers and frees parameters in module hooks, which a compiled region "
        "cannot contain. Compile each block instead and assign it in place, before "
        "wrapping: `for i, block in enumerate(model.h): model.h[i] = torch.compile(block)` "
        "(the blocks are the children of an nn.ModuleList, stage 3's units), or use "
        "stage=2 to compile the whole model"
    )
    if _is_compiled_wrapper(model):
        raise ConfigError(f"torch.compile(model) cannot be trained at stage 3: {fix}")
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            where = f"{name}.compile()" if name else "model.compile()"
            raise ConfigError(f"{where} cannot be trained at stage 3: {fix}")


def _is_compiled_wrapper(module: nn.Module) -> bool:
    return isinstance(getattr(module, _COMPILED_WRAPPER, None), nn.Module) and hasattr(
        module, "_torchdynamo_orig_callable"
    )


# ------------------------------------------------------------------- forward inputs
def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """Floating-point tensors in ``args``/``kwargs`` (also inside lists, tuples and
    dicts) cast to ``dtype``; everything else (integer token ids, masks, non-tensors)
    passed through untouched; ``dtype=None`` casts nothing. Mirrors FSDP2's
    ``cast_forward_inputs``."""
    if dtype is None or not _needs_cast((args, kwargs), dtype):
        return args, kwargs  # the common case: no rebuild of the argument structure
    return _cast(args, dtype), _cast(kwargs, dtype)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


def _needs_cast(value: Any, dtype: torch.dtype) -> bool:
    return any(t.is_floating_point() and t.dtype != dtype for t in _tensors(value))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


# ------------------------------------------------------------------- partial loads
def report_skipped(path: str, step: int, wanted: list[str], stored: Iterable[str]) -> list[str]:
    """For ``load(strict=False)``: log what is skipped either way (model state the step
    lacks, stored model tensors the model lacks) and return the skipped names. Raises
    when none of the model's parameters is in the step: that is the wrong checkpoint (or
    names that changed), never a partial load."""
    from zerostate.errors import CheckpointError

    stored = set(stored)
    missing = [n for n in wanted if n not in stored]
    extra = sorted(n for n in stored if n.startswith("model/") and n not in set(wanted))
    params = [n for n in wanted if n.startswith("model/")]
    if params and all(n in missing for n in params):
        shown = ", ".join(extra[:3]) or "no model tensors"
        raise CheckpointError(
            f"step {step} in {path} holds none of this model's {len(params)} parameters "
            f"(it has {shown}); strict=False skips some state, it does not load another "
            "model: check the path and the model"
        )
    if missing:
        log.warning(
            "zerostate: load(strict=False) from %s step %d left %d tensor(s) as they were: %s",
            path, step, len(missing), _shown(missing),
        )  # fmt: skip
    if extra:
        log.warning(
            "zerostate: load(strict=False) from %s step %d ignored %d stored tensor(s) the "
            "model lacks: %s",
            path, step, len(extra), _shown(extra),
        )  # fmt: skip
    return missing


def _shown(names: list[str], limit: int = 10) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
