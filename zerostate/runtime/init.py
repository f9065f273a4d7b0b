"""Deterministic per-module initialisation, and materialising a ``meta`` model shard by shard.

A model built under ``torch.device("meta")`` is materialised module by module (in
``named_modules`` order): the module's own parameters and meta buffers are allocated in
full, ``init_fn(module)`` (default: the model's ``_init_weights`` as Hugging Face models
define it, else ``module.reset_parameters()``; what nothing initialises is left unset, see
[Note: unset state]) runs under a generator seeded from ``(init_seed, module name)``, the
rank keeps its slices, and the full tensors are dropped before the next module. At most one
module's parameters are ever full. A tied parameter is initialised by the first module that
owns it. :func:`deterministic_init` applies the same per-module initialisation to an
ordinary model, giving identical values.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from zerostate.runtime import hollow
from zerostate.runtime.sharded import ShardedParam
from zerostate.runtime.tp import empty_like_param, model_param


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _run_init(
    root: nn.Module, module: nn.Module, init_fn: Callable[[nn.Module], None] | None
) -> None:
    """The first initialiser that applies: ``init_fn``; the model's own per-module
    ``_init_weights`` (the Hugging Face ``PreTrainedModel`` convention, which also recomputes
    derived buffers such as a rotary embedding's ``inv_freq``); ``reset_parameters()``.
    Whatever none of them writes is left to :func:`_placeholder` (see [Note: unset state])."""
    if init_fn is not None:
        init_fn(module)
        return
    model_init = getattr(root, "_init_weights", None)
    if callable(model_init):
        model_init(module)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


# [Note: unset state]
# A meta-device module may have no initialiser at all (a Hugging Face RMSNorm has no
# reset_parameters) because its values are about to come from a pretrained file. Its
# parameters and buffers get a placeholder (zeros) and their names are reported as unset;
# the engine refuses to run a forward until ``load_pretrained`` or ``load`` has written
# every one of them, so an unloaded placeholder never trains silently. "Written" means the
# initialiser changed the tensor in place (its version counter moved: ``nn.init`` and
# in-place ops) or, for floating tensors, left no element of the NaN we pre-fill (writes
# through ``.data``, which has its own version counter).
def _prefill(t: torch.Tensor) -> int:
    t.fill_(float("nan") if t.is_floating_point() else 0)
    return t._version


def _placeholder(t: torch.Tensor, version: int) -> bool:
    """Zero ``t`` and return True when the initialiser did not write it."""
    if t._version != version:
        return False
    if t.is_floating_point() and not bool(torch.isnan(t).all()):
        return False
    t.zero_()
    return True


def deterministic_init(
    model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None, seed: int = 0
) -> list[str]:
    """Initialise ``model`` in place exactly as a stage-3 ``meta`` build does; returns the
    names of parameters no initialiser wrote (zeroed, see [Note: unset state])."""
    done: set[int] = set()
    unset: list[str] = []
    with torch.no_grad():
        for _ in _init_modules(model, init_fn, seed, done, None, unset):
            pass
    return unset


def _init_modules(
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None,
    seed: int,
    done: set[int],
    device: torch.device | None,
    unset: list[str],
) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Per module owning not-yet-initialised parameters: (maybe) materialise, init, yield
    ``(original parameter, value)`` for each new one, then restore the originals. Names of
    parameters and materialised buffers nothing initialised are appended to ``unset``."""
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        meta_buffers = device is not None and any(
            b is not None and b.is_meta for b in module._buffers.values()
        )
        if not meta_buffers and not any(id(p) not in done for _, p in own):
            continue
        originals = dict(own)
        for n, p in own:
            if device is not None or id(p) in done:
                # Materialise, or shield an already-initialised tied weight from init_fn.
                dev = device if device is not None else p.device
                fresh = torch.empty(p.shape, dtype=p.dtype, device=dev)
                module._parameters[n] = nn.Parameter(fresh, requires_grad=p.requires_grad)
        fresh_buffers = []
        if device is not None:
            for n, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device=device)
                    fresh_buffers.append(n)
        before = {id(t): (t, _prefill(t)) for t in module._parameters.values() if t is not None}
        before.update({id(t): (t, _prefill(t)) for t in map(module._buffers.get, fresh_buffers)})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_module_seed(seed, name))
            _run_init(model, module, init_fn)
        prefix = f"{name}." if name else ""
        for n in fresh_buffers:
            entry = before.get(id(module._buffers[n]))
            if entry is not None and _placeholder(*entry):
                unset.append(prefix + n)
        for n, p in own:
            if id(p) not in done:
                done.add(id(p))
                value = module._parameters[n]
                entry = before.get(id(value))
                if entry is not None and _placeholder(*entry):
                    unset.append(prefix + n)
                yield p, value.detach()
        module._parameters.update(originals)


def materialise(
    model: nn.Module,
    sparams: list[ShardedParam],
    *,
    dtype: torch.dtype,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    seed: int,
) -> list[str]:
    """Give every ``ShardedParam`` its local/master slices and swap in storage-resizable
    full-shape parameters (see [Note: stage-3 parameters]). Returns the names of parameters
    and buffers left unset (see [Note: unset state]); parameter names are canonical."""
    by_id = {id(model_param(sp.param)): sp for sp in sparams}
    unset: list[str] = []
    if any(sp.param.is_meta for sp in sparams):
        with torch.no_grad():
            found: list[str] = []
            for param, value in _init_modules(model, init_fn, seed, set(), device, found):
                _take_shard(by_id[id(param)], value, dtype, device)
            # Each parameter was named by the first module owning it, as named_parameters
            # names it, so these are the canonical names.
            unset = found
    else:
        for sp in sparams:
            # A DTensor parameter is partitioned as its local tp shard.
            _take_shard(sp, sp.param.data, dtype, device)
    replaced = {}
    for sp in sparams:
        fresh = empty_like_param(sp.param, dtype, device, sp.trainable)
        hollow.release(fresh, sp.name)  # [Note: reading a parameter outside a gather]
        replaced[id(model_param(sp.param))] = model_param(fresh)
        sp.param = fresh
    for module in model.modules():
        for n, p in module._parameters.items():
            if p is not None and id(p) in replaced:
                module._parameters[n] = replaced[id(p)]
    return unset


def _take_shard(sp: ShardedParam, value: torch.Tensor, dtype: torch.dtype, device) -> None:
    flat = value.reshape(-1)[sp.start : sp.stop]
    sp.shard = flat.to(device=device, dtype=dtype).clone()
    if dtype == torch.float32:
        sp.master, sp.master_aliased = sp.shard, True
    else:
        sp.master = flat.to(device=device, dtype=torch.float32).clone()
