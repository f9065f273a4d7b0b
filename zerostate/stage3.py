"""Stage 3: parameters partitioned too, gathered just in time per unit.

[Note: stage-3 parameters]
Every parameter stays an ``nn.Parameter`` of its full shape inside the model, but its
storage is resized to zero bytes whenever its unit is not gathered; the rank keeps only
its owned slice (``ShardedParam.local``, working dtype) and the fp32 master/optimizer
slices. Gathering resizes the storage back and fills it from an all-gather. Autograd's
saved tensors reference the same storage, so they see the re-gathered values in backward.
Writes go through ``param.data`` (whose version counter is separate) so autograd never
sees an in-place change. Never read the module's parameters directly outside forward and
backward (use ``Engine.full_state_dict``): their storage is empty.

Units (``unit_policy``; default :func:`default_policy`: the children of every
``nn.ModuleList``, i.e. a transformer's blocks, else each module that owns parameters). A parameter
belongs to the deepest selected module that contains it; a parameter owned by several
modules (a tied weight) or by no selected module belongs to the root unit, which is
gathered for the whole forward + backward. Lifecycle per iteration:

* forward pre-hook: gather (wait for a prefetch or all-gather now), prefetch the next unit
  in the forward order recorded on the first iteration;
* forward hook: register a gradient hook on the outputs (backward pre-hook), free the
  storage. During backward (activation-checkpoint recomputation) both hooks only gather;
* output gradient hook: gather again, prefetch the unit that runs backward next;
* post-accumulate-grad hooks: once all of a unit's trainable parameters have gradients,
  pack them, drop the full gradients, reduce-scatter asynchronously into the unit's fp32
  gradient shard (summed over micro-steps, [Note: reduce precision] in ``comm.py``), free
  the storage;
* after backward: units with some gradients missing are reduced with zeros in their
  place, everything is awaited and every unit (root included) is freed.

All ranks must run the same autograd graph (as with FSDP): collectives are issued in
execution order.

Meta-device construction: a model built under ``torch.device("meta")`` is materialised
module by module (in ``named_modules`` order): the module's own parameters and meta
buffers are allocated in full, ``init_fn(module)`` (default: the model's ``_init_weights``
as Hugging Face models define it, else ``module.reset_parameters()``; what nothing
initialises is left unset, see [Note: unset state]) runs under a generator seeded from
``(init_seed, module name)``, the rank keeps its slices, and the full tensors
are dropped before the next module. At most one module's parameters are ever full. A
tied parameter is initialised by the first module that owns it. :func:`deterministic_init`
applies the same per-module initialisation to an ordinary model, giving identical values.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerostate.comm import (
    CommContext,
    InFlight,
    PendingOp,
    PooledBuffer,
    reduce_scatter_grads,
    start_all_gather,
)
from zerostate.sharded import FlatLayout, ShardedParam
from zerostate.strategies import Strategy, gather_full_masters


# -- initialisation ------------------------------------------------------------------------
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
    by_id = {id(sp.param): sp for sp in sparams}
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
            _take_shard(sp, sp.param.detach(), dtype, device)
    replaced = {}
    for sp in sparams:
        fresh = nn.Parameter(
            torch.empty(sp.shape, dtype=dtype, device=device), requires_grad=sp.trainable
        )
        fresh.untyped_storage().resize_(0)
        replaced[id(sp.param)] = fresh
        sp.param = fresh
    for module in model.modules():
        for n, p in module._parameters.items():
            if p is not None and id(p) in replaced:
                module._parameters[n] = replaced[id(p)]
    return unset


def _take_shard(sp: ShardedParam, value: torch.Tensor, dtype: torch.dtype, device) -> None:
    flat = value.reshape(-1)[sp.start : sp.stop]
    sp.local = flat.to(device=device, dtype=dtype).clone()
    if dtype == torch.float32:
        sp.master, sp.master_aliased = sp.local, True
    else:
        sp.master = flat.to(device=device, dtype=torch.float32).clone()


# -- units ---------------------------------------------------------------------------------
class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    def __init__(self, name: str, sparams: list[ShardedParam], world_size: int, rank: int):
        self.name = name
        self.params = sparams
        self.trainable = [p for p in sparams if p.trainable]
        self.gather_layout = FlatLayout(sparams, world_size, rank)
        self.grad_layout = FlatLayout(self.trainable, world_size, rank) if self.trainable else None
        self.grad_shard: torch.Tensor | None = None
        self.fresh = True  # grad_shard holds nothing since the last zero()
        self.state = UnitState.SHARDED
        self.gather: tuple[PendingOp, PooledBuffer] | None = None
        self.num_ready = 0
        self.reduced = False
        self.expects_backward = False
        self.backward_started = False
        for p in sparams:
            p.unit = self


def _owns_params(name: str, module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def default_policy(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Units are the repeated blocks: every child of an ``nn.ModuleList`` (a transformer's
    layers), so each block is gathered with one collective, as one usually wraps FSDP
    units; parameters outside the blocks join the root unit. A model without a ModuleList
    gets one unit per module that directly owns parameters."""
    blocks = {
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for child, _ in module.named_children()
    }
    if blocks:
        return lambda name, module: name in blocks
    return _owns_params


def build_units(
    model: nn.Module,
    sparams: list[ShardedParam],
    policy: Callable[[str, nn.Module], bool] | None,
    world_size: int,
    rank: int,
) -> tuple[Unit, list[tuple[nn.Module, Unit]]]:
    policy = policy or default_policy(model)
    owners: dict[int, set[str]] = {}
    selected: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
        if name and policy(name, module):
            selected.setdefault(name, module)
    members: dict[str, list[ShardedParam]] = {}
    for sp in sparams:
        names = owners[id(sp.param)]
        target = ""
        if len(names) == 1:
            (owner,) = names
            for s in selected:
                if (owner == s or owner.startswith(s + ".")) and len(s) > len(target):
                    target = s
        members.setdefault(target, []).append(sp)
    root = Unit("", members.pop("", []), world_size, rank)
    units = [(selected[n], Unit(n, m, world_size, rank)) for n, m in members.items()]
    return root, units


class Stage3Strategy(Strategy):
    """Stage 3: gathers, frees and reduces units; see [Note: stage-3 parameters]."""

    def __init__(
        self, ctx: CommContext, params: list[ShardedParam], *, bucket_numel: int, config: Any
    ) -> None:
        super().__init__(ctx, params, bucket_numel=bucket_numel)
        self.config = config
        self.prefetch = config.prefetch
        self.root: Unit | None = None
        self.units: list[Unit] = []
        self._order: list[Unit] = []
        self._order_index: dict[int, int] = {}
        self._recording = True
        self._inflight = InFlight()

    def setup(self, model: nn.Module, config: Any) -> None:
        self.unset = materialise(
            model,
            self.params,
            dtype=self.ctx.param_dtype,
            device=self.ctx.device,
            init_fn=config.init_fn,
            seed=config.init_seed,
        )
        self.root, pairs = build_units(
            model, self.params, config.unit_policy, self.ctx.world_size, self.ctx.rank
        )
        self.units = [self.root] + [u for _, u in pairs]
        for module, unit in pairs:
            module.register_forward_pre_hook(self._make_pre_forward(unit))
            module.register_forward_hook(self._make_post_forward(unit))

    # -- gathering ---------------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.state is not UnitState.SHARDED or not unit.params:
            if unit.state is UnitState.SHARDED:
                unit.state = UnitState.GATHERED
            return
        unit.gather = start_all_gather(
            self.ctx,
            unit.gather_layout,
            [p.local for p in unit.params],
            None,
            dtype=self.ctx.param_dtype,
        )
        unit.state = UnitState.GATHERING

    def _gather(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERED:
            return
        self._start_gather(unit)
        if unit.gather is None:
            return
        op, buffer = unit.gather
        unit.gather = None
        op.complete()
        targets = []
        for p in unit.params:
            data = p.param.data
            data.untyped_storage().resize_(p.numel * data.element_size())
            targets.append(data.view(-1))
        with torch.no_grad():
            unit.gather_layout.unpack(buffer.tensor, targets)
        self.ctx.pool.release(buffer)
        unit.state = UnitState.GATHERED

    def _free(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERING:
            self._gather(unit)  # a prefetch nobody used: finish it so its buffer returns
        for p in unit.params:
            p.param.data.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED

    # -- hooks -------------------------------------------------------------------------
    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(unit)
            if self._in_backward():
                return  # checkpoint recomputation: just make the parameters available
            if self._recording:
                if id(unit) not in self._order_index:
                    self._order_index[id(unit)] = len(self._order)
                    self._order.append(unit)
            elif self.prefetch:
                index = self._order_index.get(id(unit))
                if index is not None and index + 1 < len(self._order):
                    self._start_gather(self._order[index + 1])

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward():
                return  # recomputed activations are used right away by this backward
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
                        unit.expects_backward = True
            self._free(unit)

        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            if unit.backward_started:
                return
            unit.backward_started = True
            self._gather(unit)
            if self.prefetch and not self._recording:
                index = self._order_index.get(id(unit), 0)
                for prev in reversed(self._order[:index]):
                    if prev.expects_backward and not prev.backward_started:
                        self._start_gather(prev)
                        break

        return hook

    def on_grad_ready(self, sp: ShardedParam) -> None:
        unit: Unit = sp.unit
        unit.num_ready += 1
        if unit.num_ready == len(unit.trainable):
            self._reduce(unit)
            if unit is not self.root:
                self._free(unit)

    # -- gradients ---------------------------------------------------------------------
    def _shard(self, unit: Unit) -> torch.Tensor:
        if unit.grad_shard is None:
            layout = unit.grad_layout
            unit.grad_shard = torch.zeros(
                layout.seg_numel, dtype=torch.float32, device=self.ctx.device
            )
            for p, view in zip(unit.trainable, layout.shard_views(unit.grad_shard), strict=True):
                p.grad_shard = view
        return unit.grad_shard

    def _reduce(self, unit: Unit) -> None:
        unit.reduced = True
        grads = [None if p.param.grad is None else p.param.grad.reshape(-1) for p in unit.trainable]
        for p in unit.trainable:
            p.param.grad = None
        reduce_scatter_grads(
            self.ctx,
            self._inflight,
            unit.grad_layout,
            grads,
            self._shard(unit),
            accumulate=not unit.fresh,
        )
        unit.fresh = False

    # -- iteration boundaries ----------------------------------------------------------
    def pre_forward(self) -> None:
        self._gather(self.root)
        if self.prefetch and not self._recording and self._order:
            self._start_gather(self._order[0])

    def post_forward(self) -> None:
        if not torch.is_grad_enabled():
            self.release_all()

    def prepare(self, *, boundary: bool) -> None:
        for unit in self.units:
            unit.num_ready = 0
            unit.reduced = False

    def finish_backward(self) -> None:
        """After backward: reduce partial units, wait for everything, free everything."""
        for unit in self.units:
            if unit.trainable and unit.num_ready and not unit.reduced:
                self._reduce(unit)
        self._inflight.drain()
        self.release_all()
        self._recording = False

    def release_all(self) -> None:
        for unit in self.units:
            if unit.state is not UnitState.SHARDED:
                self._free(unit)
            unit.expects_backward = False
            unit.backward_started = False

    def step_grads(self) -> list[torch.Tensor]:
        for unit in self.units:
            if unit.grad_layout is not None and unit.fresh:
                self._shard(unit).zero_()
        return [p.grad_shard for p in self.trainable]

    def refresh(self, params: list[ShardedParam] | None = None) -> None:
        if params is not None:
            self.release_all()
        targets = self.trainable if params is None else params
        pairs = [(sp.local, sp.master) for sp in targets if not sp.master_aliased]
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])

    def zero(self) -> None:
        for unit in self.units:
            unit.fresh = True

    def full_masters(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        return gather_full_masters(self.ctx, params, self.bucket_numel)

    def bytes_held(self) -> dict[str, int]:
        params = sum(sp.local.numel() * sp.local.element_size() for sp in self.params)
        grads = sum(
            u.grad_shard.numel() * u.grad_shard.element_size()
            for u in self.units
            if u.grad_shard is not None
        )
        grads += sum(
            sp.param.grad.numel() * sp.param.grad.element_size()
            for sp in self.trainable
            if sp.param.grad is not None
        )
        gathered = sum(p.param.untyped_storage().nbytes() for u in self.units for p in u.params)
        return {"params": params, "grads": grads, "in_flight": gathered}
