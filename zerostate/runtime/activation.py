"""Activation checkpointing, and ZeRO-R's partitioned activation checkpoints (Pa, Pa+cpu).

``Engine(model, activation_checkpointing=...)`` wraps the ``forward`` of selected blocks
(:func:`select_blocks`; default: the children of the model's largest ``nn.ModuleList``,
a transformer's layers). See [Note: activation checkpoints].

[Note: activation checkpoints]
A checkpointed block runs its forward without building a graph and keeps only its inputs;
backward re-runs the forward with the same RNG state and differentiates it. The block is
one ``torch.autograd.Function`` (:class:`_Checkpoint`) whose inputs are the block's tensor
inputs *and its trainable parameters*: backward recomputes, then ``torch.autograd.grad``
returns the gradients of both, so parameter gradients arrive through the outer backward's
own ``AccumulateGrad`` nodes, in the outer graph task, where the engine's per-parameter
hooks expect them (a nested ``backward()`` would accumulate them inside another graph task).
Only the block's ``forward`` is wrapped (an instance attribute): hooks registered on the
block (torch's tensor-parallel input/output hooks sit on its sub-modules and run inside
the recompute like any forward code) run once, outside the checkpoint.

What is kept per block:

* ``"full"``: the tensor inputs, by reference (as ``torch.utils.checkpoint``).
* ``"partitioned"`` (ZeRO-R Pa): every *activation* input (a plain floating-point tensor
  passed positionally, or any plain tensor that requires grad: a transformer's hidden
  states) is kept as this rank's 1/TP slice of its flat storage (padded to TP equal
  segments), and the TP slices are all-gathered over ``mesh["tp"]`` right before the
  recompute. That is only correct for inputs that are the same on every ``tp`` rank, which
  is what torch's ``ColwiseParallel`` / ``RowwiseParallel`` plans give a block (replicated
  plain tensors in, replicated plain tensors out); the first forward of each block checks
  it once (a fingerprint all-reduced over ``tp``) and raises otherwise (a
  ``SequenceParallel`` block input differs per ``tp`` rank: use ``"full"`` there). Other
  tensors (attention masks, rotary tables, position ids: shared by every block, and
  DTensors, already sharded) are kept by reference. Without a ``tp`` mesh dimension
  there is nothing to partition over, and ``"partitioned"`` is ``"full"``.
* ``"partitioned_cpu"`` (Pa+cpu): as ``"partitioned"``, with the slice in host memory
  (pinned when the model is on an accelerator, copied without blocking); the device keeps
  nothing of the block. Without ``tp`` the slice is the whole input.

RNG: the CPU generator (and the accelerator's, on CUDA) is recorded before the forward
and restored, in a forked RNG scope, for the recompute, so dropout masks equal those of
the uncheckpointed run. Random ops on DTensors themselves (torch's distributed RNG
tracker) are not recorded. Keyword arguments are flattened with their structure (tensors
become inputs of the function; other values are passed as they are), and outputs of any
structure (a tensor, a tuple, a dict) come back as the block returned them. A key/value
cache handed to a block in training (transformers' ``use_cache``, ``cache`` /
``past_key_values`` / ``layer_past``) is dropped, with one warning, as transformers does
for its own gradient checkpointing: the recompute would append to it a second time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerostate.dist import collectives
from zerostate.errors import ConfigError

logger = logging.getLogger(__name__)

MODES = ("full", "partitioned", "partitioned_cpu")
#: Keyword arguments holding a key/value cache (transformers' names for it).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


# -- which blocks ------------------------------------------------------------------------
def select_blocks(model: nn.Module, which: Any = None) -> list[tuple[str, nn.Module]]:
    """The modules to checkpoint, outermost only (a module inside a selected one is not
    selected again). ``which``: a module class, a list of classes, a predicate
    ``which(name, module) -> bool``, or None for the children of the model's largest
    ``nn.ModuleList`` (by parameter count). Raises :class:`ConfigError` when none match."""
    if which is None:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise ConfigError(
                "activation_checkpointing found no nn.ModuleList of blocks in the model; "
                "name the blocks with checkpoint_modules= (a module class, a list of "
                "classes or a predicate(name, module))"
            )
        name, biggest = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{n}", m) for n, m in biggest.named_children()]
    match = _matcher(which)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{c}.") or c == "" for c, _ in chosen):
            continue  # inside a block already chosen
        if match(name, module):
            chosen.append((name, module))
    if not chosen:
        raise ConfigError(
            f"checkpoint_modules={which!r} matches no module of the model; pass the class "
            "of its blocks (e.g. LlamaDecoderLayer) or a predicate(name, module)"
        )
    return chosen


def check_blocks(model: nn.Module, which: Any = None) -> list[tuple[str, nn.Module]]:
    """:func:`select_blocks`, refusing a block whose ``forward`` is already an instance
    attribute (another wrapper's): local, so the engine runs it before any collective."""
    chosen = select_blocks(model, which)
    for name, module in chosen:
        if "forward" in module.__dict__:
            raise ConfigError(
                f"module {name} already has a forward of its own (an instance attribute, "
                "set by another wrapper or another engine); activation checkpointing wraps "
                "forward, so leave that module out with checkpoint_modules="
            )
    return chosen


def check_which(which: Any) -> None:
    """Refuse a ``checkpoint_modules`` value of the wrong kind (local, no model needed)."""
    if which is None or isinstance(which, type) or callable(which):
        return
    if isinstance(which, (list, tuple)) and which and all(isinstance(c, type) for c in which):
        return
    raise ConfigError(
        f"checkpoint_modules={which!r} must be a module class, a list of module classes, "
        "a predicate(name, module) -> bool, or None (the children of the largest "
        "nn.ModuleList)"
    )


def _matcher(which: Any) -> Callable[[str, nn.Module], bool]:
    if isinstance(which, type):
        return lambda name, module: isinstance(module, which)
    if isinstance(which, (list, tuple)):
        classes = tuple(which)
        return lambda name, module: isinstance(module, classes)
    return lambda name, module: bool(which(name, module))


# -- what a block keeps -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Where kept slices live and who shares them: ``mesh["tp"]``'s group, this rank's
    position in it and its size (1 without tp), and the host copy for Pa+cpu."""

    group: Any = None
    rank: int = 0
    size: int = 1
    to_host: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(slots=True)
class _Kept:
    """How one tensor input of a block is kept: whole (``slice_of`` None) or as this
    rank's slice of a tensor of shape ``slice_of`` on ``device``."""

    slice_of: torch.Size | None = None
    activation: bool = False  # an activation input (a slice of it under Pa), not a shared one
    device: torch.device | None = None
    requires_grad: bool = False


class _Block:
    """One checkpointed module: its original forward, its parameters, the partition."""

    def __init__(
        self, name: str, module: nn.Module, mode: str, part: Partition, warned_cache: list
    ) -> None:
        self.name = name
        self.module = module
        self.forward = module.forward  # the bound original
        self.mode = mode
        self.part = part
        self.checked = False  # replication over tp verified (first forward)
        self.warned_cache = warned_cache

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def slices(self) -> bool:
        """Whether activation inputs are kept as slices ([Note: activation checkpoints])."""
        return self.mode == "partitioned_cpu" or (self.mode == "partitioned" and self.part.size > 1)

    # -- keep and restore -----------------------------------------------------------------
    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's 1/size slice of ``tensor``'s flat values (host memory for Pa+cpu)."""
        size, rank = self.part.size, self.part.rank
        flat = tensor.detach().reshape(-1)
        seg = -(-flat.numel() // size)
        piece = flat[rank * seg : (rank + 1) * seg]
        if self.part.to_host:
            pin = self.part.device.type == "cuda"
            out = torch.empty(seg, dtype=flat.dtype, device="cpu", pin_memory=pin)
        else:
            out = torch.empty(seg, dtype=flat.dtype, device=flat.device)
        out[piece.numel() :].zero_()
        out[: piece.numel()].copy_(piece, non_blocking=True)
        return out

    def restore(self, kept: torch.Tensor, meta: _Kept) -> torch.Tensor:
        """The whole tensor from this rank's slice (all-gathered over tp)."""
        piece = kept.to(meta.device, non_blocking=True)
        if self.part.size == 1:
            full = piece
        else:
            full = torch.empty(
                piece.numel() * self.part.size, dtype=piece.dtype, device=piece.device
            )
            collectives.all_gather(full, piece, group=self.part.group, stats=None)
        numel = meta.slice_of.numel()
        return full[:numel].view(meta.slice_of)

    def check_replicated(self, tensors: list[torch.Tensor]) -> None:
        """Once per block: the partitioned inputs are equal on every tp rank (collective
        over tp; every rank reaches the same verdict)."""
        self.checked = True
        if self.part.size == 1 or not tensors:
            return
        prints = [
            torch.stack([t.double().sum(), t.double().abs().sum(), torch.tensor(t.numel())])
            for t in tensors
        ]
        mine = torch.cat([p.to(self.part.device) for p in prints]).double()
        both = torch.cat([mine, -mine])
        collectives.all_reduce(both, group=self.part.group, stats=None, op="max")
        n = mine.numel()
        if not torch.equal(both[:n], -both[n:]):
            raise ConfigError(
                f"activation_checkpointing={self.mode!r}: the inputs of block {self.name} "
                "differ across the tp ranks (a sequence-parallel or otherwise sharded "
                "activation), so a 1/TP slice of them cannot be all-gathered back; use "
                "activation_checkpointing='full' for this model"
            )

    def drop_cache(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Without a key/value cache in training ([Note: activation checkpoints])."""
        changed = []
        if kwargs.get("use_cache"):
            kwargs = {**kwargs, "use_cache": False}
            changed.append("use_cache=False")
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs = {**kwargs, key: None}
                changed.append(f"{key}=None")
        if changed and not self.warned_cache:
            self.warned_cache.append(True)  # shared by the model's blocks: one warning
            warnings.warn(
                f"activation checkpointing runs block {self.name} without its key/value "
                f"cache ({', '.join(changed)}): the recompute would append to it twice",
                stacklevel=4,
            )
        return kwargs


# -- the autograd function ------------------------------------------------------------------
class _Measure(threading.local):
    kinds: dict[int, str] | None = None


_measure = _Measure()


@dataclass(slots=True)
class _Call:
    """What one forward call of a block hands its backward (besides the saved tensors)."""

    block: _Block
    in_spec: Any
    leaves: list[Any]  # the flat inputs with None where a tensor goes
    tensor_at: list[int]  # index into leaves of each tensor input
    kept: list[_Kept]
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)
    out_tensor_at: list[int] = field(default_factory=list)
    rng: Any = None


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, num_inputs: int, *tensors: torch.Tensor) -> Any:
        block = call.block
        inputs = tensors[:num_inputs]
        call.rng = _rng_snapshot(block.part.device)
        saved = []
        for t, meta in zip(inputs, call.kept, strict=True):
            saved.append(block.keep(t) if meta.slice_of is not None else t)
            _note(saved[-1], meta, block.part.to_host)
        with torch.no_grad():
            out = _run(call, list(inputs))
        out_leaves, call.out_spec = pytree.tree_flatten(out)
        call.out_tensor_at = [i for i, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
        outs = [out_leaves[i] for i in call.out_tensor_at]
        call.out_leaves = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        ctx.call = call
        ctx.num_inputs = num_inputs
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        """Recompute and differentiate the block.

        [Note: checkpoints under create_graph]
        A backward with ``create_graph=True`` (a gradient penalty: WGAN-GP, R1) needs the
        block's gradients as functions of its inputs and parameters. This backward used to
        recompute from detached copies of the inputs and call ``torch.autograd.grad``
        without ``create_graph``, so the gradients came back as constants and every
        second-order term through a checkpointed block was dropped: a WGAN-GP critic of
        three checkpointed residual blocks ended 0.059 away from torch's AdamW after 3
        steps at stages 0, 2 and 3, with no error (torch's own non-reentrant checkpoint
        gives the same gradients as no checkpoint). Autograd runs such a backward with
        grad mode on; then the recompute starts from the saved inputs themselves (which
        keep their place in the outer graph), the gradients are taken with
        ``create_graph=True``, and the recorded call is kept for the backward that
        differentiates them. Inputs kept as tp slices (``"partitioned"`` with a ``tp``
        mesh, ``"partitioned_cpu"``) have lost that place, so there such a backward is
        refused, naming ``"full"``."""
        call: _Call = ctx.call
        block = call.block
        create_graph = torch.is_grad_enabled()
        inputs = []
        for kept, meta in zip(ctx.saved_tensors, call.kept, strict=True):
            if meta.slice_of is not None and create_graph:
                raise ConfigError(
                    f"activation_checkpointing={block.mode!r} keeps the inputs of "
                    f"{block.name!r} as slices, which a backward with create_graph=True (a "
                    "gradient penalty) cannot differentiate through; use "
                    "activation_checkpointing='full'"
                )
            if create_graph:
                inputs.append(kept if meta.requires_grad else kept.detach())
                continue
            t = block.restore(kept, meta) if meta.slice_of is not None else kept
            inputs.append(t.detach().requires_grad_(meta.requires_grad))
        params = block.params()
        with _rng_restored(call.rng, block.part.device), torch.enable_grad():
            out = _run(call, inputs)
        outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        wrt = [t for t in inputs if t.requires_grad] + params
        found: list[Any] = [None] * len(wrt)
        if pairs and wrt:
            found = list(
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    wrt,
                    [g for _, g in pairs],
                    allow_unused=True,
                    create_graph=create_graph,
                )
            )
        found_iter = iter(found)
        input_grads = [next(found_iter) if t.requires_grad else None for t in inputs]
        param_grads = list(found_iter)
        if not create_graph:
            ctx.call = None  # the recompute's graph and the restored inputs go now
        return (None, None, *input_grads, *param_grads)


def _run(call: _Call, tensors: list[torch.Tensor]) -> Any:
    leaves = list(call.leaves)
    for i, t in zip(call.tensor_at, tensors, strict=True):
        leaves[i] = t
    args, kwargs = pytree.tree_unflatten(leaves, call.in_spec)
    return call.block.forward(*args, **kwargs)


def _rng_snapshot(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    acc = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), acc


@contextlib.contextmanager
def _rng_restored(snapshot: Any, device: torch.device) -> Iterator[None]:
    cpu, acc = snapshot
    devices = [device] if acc is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu)
        if acc is not None:
            torch.cuda.set_rng_state(acc, device)
        yield


def _is_activation(tensor: torch.Tensor, positional: bool) -> bool:
    """A block input that is one of its activations ([Note: activation checkpoints])."""
    if collectives.is_dtensor(tensor) or not tensor.is_floating_point():
        return False
    return positional or tensor.requires_grad


def _note(saved: torch.Tensor, meta: _Kept, to_host: bool) -> None:
    kinds = _measure.kinds
    if kinds is not None:
        if meta.slice_of is None:
            kind = "activation" if meta.activation else "shared"
        else:
            kind = "host_slice" if to_host else "slice"
        kinds[id(saved)] = kind


def _checkpointed(block: _Block) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        params = block.params()
        if not torch.is_grad_enabled():
            return block.forward(*args, **kwargs)  # no backward to recompute for
        given = pytree.tree_leaves((args, kwargs))
        if not params and not any(isinstance(v, torch.Tensor) and v.requires_grad for v in given):
            return block.forward(*args, **kwargs)  # nothing here is differentiated
        kwargs = block.drop_cache(kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        num_positional = len(pytree.tree_leaves(args))
        tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_at]
        kept = []
        for i, t in zip(tensor_at, tensors, strict=True):
            act = _is_activation(t, positional=i < num_positional)
            kept.append(
                _Kept(
                    slice_of=t.shape if act and block.slices else None,
                    activation=act,
                    device=t.device,
                    requires_grad=t.requires_grad,
                )
            )
        if not block.checked:
            block.check_replicated(
                [t.detach() for t, k in zip(tensors, kept, strict=True) if k.slice_of is not None]
            )
        call = _Call(
            block=block,
            in_spec=spec,
            leaves=[None if isinstance(v, torch.Tensor) else v for v in leaves],
            tensor_at=tensor_at,
            kept=kept,
        )
        try:
            outs = _Checkpoint.apply(call, len(tensors), *tensors, *params)
        finally:
            if _measure.kinds is not None:
                _measure.kinds.clear()  # ids are only meaningful while the apply runs
        out_leaves = list(call.out_leaves)
        for i, o in zip(call.out_tensor_at, outs, strict=True):
            out_leaves[i] = o
        result = pytree.tree_unflatten(out_leaves, call.out_spec)
        call.out_leaves = []  # the backward needs only the structure
        return result

    return forward


# -- the engine's handle ------------------------------------------------------------------------
class ActivationCheckpointing:
    """The checkpointed blocks of one model; :meth:`remove` restores their forwards."""

    def __init__(self, blocks: list[_Block]) -> None:
        self.blocks = blocks

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def modules(self) -> list[nn.Module]:
        """The modules whose forward is checkpointed (replaced in their ``__dict__``)."""
        return [b.module for b in self.blocks]

    def remove(self) -> None:
        for b in self.blocks:
            b.module.__dict__.pop("forward", None)
        self.blocks = []


def apply(
    model: nn.Module,
    mode: str,
    which: Any = None,
    *,
    tp: Any = None,
    device: torch.device,
) -> ActivationCheckpointing:
    """Checkpoint the blocks of ``model`` chosen by ``which`` in ``mode`` (one of
    :data:`MODES`); ``tp`` is the engine's tensor-parallel dimension or None."""
    if mode not in MODES:
        raise ConfigError(f"activation_checkpointing={mode!r} is not one of {MODES} or None")
    if mode == "partitioned" and (tp is None or tp.size == 1):
        warnings.warn(
            "activation_checkpointing='partitioned' without a 'tp' mesh dimension has "
            "nothing to partition over: blocks keep their whole inputs, as 'full'",
            stacklevel=3,
        )
    part = Partition(
        group=tp.group if tp is not None else None,
        rank=tp.rank if tp is not None else 0,
        size=tp.size if tp is not None else 1,
        to_host=mode == "partitioned_cpu",
        device=device,
    )
    blocks = []
    warned: list = []
    for name, module in check_blocks(model, which):
        block = _Block(name, module, mode, part, warned)
        module.forward = _checkpointed(block)
        blocks.append(block)
    return ActivationCheckpointing(blocks)


# -- measurement ------------------------------------------------------------------------
@dataclass(slots=True)
class SavedBytes:
    """Bytes autograd holds for backward, as seen by torch's saved-tensor pack hooks,
    each storage counted once: the checkpointed blocks' kept tensors by kind
    (``activation`` inputs kept whole, their device ``slice`` s, the ``host_slice`` s of
    Pa+cpu, ``shared`` inputs kept by reference: masks, rotary tables) and everything
    else autograd saved (``other``)."""

    by_kind: dict[str, int] = field(default_factory=dict)
    _seen: set = field(default_factory=set)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        if collectives.is_dtensor(tensor):
            tensor = collectives.dtensor_local(tensor)
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
        if key in self._seen:
            return
        self._seen.add(key)
        self.by_kind[kind] = self.by_kind.get(kind, 0) + storage.nbytes()

    def get(self, kind: str) -> int:
        return self.by_kind.get(kind, 0)


@contextlib.contextmanager
def measure_saved() -> Iterator[SavedBytes]:
    """Count what autograd saves for backward while the body runs (a forward pass):
    :class:`SavedBytes`. The pack hook returns each tensor unchanged."""
    result = SavedBytes()
    previous = _measure.kinds
    _measure.kinds = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kinds = _measure.kinds or {}
        result.add(kinds.get(id(t), "other"), t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        _measure.kinds = previous
