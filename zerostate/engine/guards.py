"""Guards on torch's module API over a model the engine trains.

The engine owns the parameters' values (fp32 masters, at stage 3 their storage too) and
reduces gradients as autograd produces them, so some of torch's module API, used on a
wrapped model as on a plain one, would go around it: ``model.load_state_dict(...)``, a
deep copy, a conversion (``.to()``, ``.half()``, ``to_empty()``), a backward the engine did
not start, unfreezing a parameter. :class:`ModuleGuards` watches those on every module with
engine parameters under it and either makes them work or refuses them, naming what works
(the notes below). The hooks it installs reach it weakly, so a model outlives its engine
as a plain torch module.
"""

from __future__ import annotations

import copy
import logging
import types
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerostate.engine.build import WRAPPED_BY, first_names
from zerostate.errors import ConfigError, EngineUsageError
from zerostate.runtime import hollow, tp
from zerostate.runtime.runtime import GroupRuntime, StageUsageError, holds_no_values
from zerostate.runtime.sharded import ShardedParam

if TYPE_CHECKING:
    from zerostate.engine.parts import StateParts
    from zerostate.runtime.activation import ActivationCheckpointing

log = logging.getLogger("zerostate.engine")


class ModuleGuards:
    """The engine's guards on its model ([Note: model.load_state_dict after wrapping],
    [Note: deep copies of a wrapped model], [Note: converting a partitioned model],
    [Note: gradients from another backward], [Note: parameters unfrozen later]).

    Built last by the engine, from the pieces the guards read: the sharded parameters, the
    group runtime, the checkpointed blocks, the engine's state parts (a load through
    ``load_state_dict`` marks names as set) and ``before_update``, the fence every writer
    of masters passes ([Note: one fence])."""

    def __init__(
        self,
        *,
        module: nn.Module,
        params: list[ShardedParam],
        trainable: list[ShardedParam],
        runtime: GroupRuntime,
        activation: ActivationCheckpointing | None,
        parts: StateParts,
        before_update: Callable[[], None],
        rank: int,
    ) -> None:
        self._module, self._params, self._trainable = module, params, trainable
        self._runtime, self._activation, self._parts = runtime, activation, parts
        self._before_update, self.rank = before_update, rank
        # Parameters frozen when the engine was built, watched for a gradient at each step
        # ([Note: parameters unfrozen later]).
        self._frozen = [(sp.name, tp.model_param(sp.param)) for sp in params if not sp.trainable]
        self._told_unfrozen: set[str] = set()
        self._copying = self._converting = False
        #: Set by :meth:`remove` (``engine.close()``): a load hook still called does nothing.
        self.closed = False
        self._load_hooks, self._guarded = self._watch()

    def remove(self) -> None:
        """Take every hook and guard off the model (``engine.close()``)."""
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []
        for module in self._guarded:
            module.__dict__.pop("__deepcopy__", None)
            module.__dict__.pop("_apply", None)
        self._guarded = []
        self.closed = True

    def refuse_stray_grad(self, index: int) -> None:
        """A gradient reached a parameter outside :meth:`backward`: drop it and raise.

        [Note: gradients from another backward]
        The engine takes each gradient as autograd accumulates it (its post-accumulate
        hook) and reduces it with its bucket, so it only knows what to do with one inside
        ``engine.backward(loss)``, which prepares the buckets and finishes them. Two habits
        reach the parameters from another backward. A DDP script's ``loss.backward()``
        (``step()`` then refused it, but the hooks had already run). And a GAN's
        generator step, ``engine_g.backward(loss_g)`` with ``loss_g`` computed through the
        discriminator's engine, the recipe of PyTorch's DCGAN example, which lets the
        generator's loss fill the discriminator's ``.grad`` and discards it with
        ``netD.zero_grad()`` before the discriminator's next step. Here that gradient
        reached buckets already reduced in the discriminator's last step and raised "arrived
        after its group was reduced ... report it with the model" (2 ranks, stages 0-3),
        which named neither the cause nor the fix; with gradient accumulation it could
        land in the discriminator's next update instead. The engine cannot set such a
        gradient aside for a later ``zero_grad()`` (at stages 2-3 it would have to hold a
        whole unreduced gradient), so the gradient is dropped from ``.grad`` (a later
        backward must not add to it) and the backward raises, naming the two fixes:
        ``engine.backward(loss)``, or freezing the parameters around a backward that must
        not train them, which equals torch's DCGAN recipe step for step."""
        sp = self._trainable[index]
        tp.model_param(sp.param).grad = None
        raise EngineUsageError(
            f"the gradient of {sp.name} arrived outside this engine's backward(): a backward "
            "the engine did not start reached its parameters (loss.backward() instead of "
            "engine.backward(loss), or another model's loss through this one, as a GAN's "
            "generator loss through the discriminator). The engine reduces gradients as "
            "they arrive and cannot keep one for a later zero_grad(); it was dropped. Call "
            "engine.backward(loss) for this engine's losses, and around a backward that must "
            "not train these parameters freeze them (model.requires_grad_(False), then "
            "requires_grad_(True)) or detach what flows into them"
        )

    @hollow.unguarded
    def tell_unfrozen(self) -> None:
        """Warn (rank 0, once per parameter) about parameters frozen at construction that
        now hold a gradient.

        [Note: parameters unfrozen later]
        The engine partitions, and keeps masters and optimizer state for, the parameters
        that require grad when it is built; a frozen one is stored once and never stepped.
        Setting ``requires_grad_(True)`` on it later (gradual unfreezing, a callback that
        unfreezes the backbone) made autograd fill its ``.grad`` while the engine went on
        ignoring it: the parameter stayed at its initial values, with no word (2 ranks,
        stages 0-3), where torch's AdamW built over ``model.parameters()`` trains it.
        Adding a parameter to the partitions mid-run would re-plan buckets, masters, the
        optimizer's groups and the checkpoint layout, so the engine says so instead, and
        names what works: build the engine with the parameter trainable and freeze it with
        ``requires_grad_(False)`` until it should train. A trainable parameter without a
        gradient is not stepped (torch skips it too), so that run equals torch's AdamW
        step for step. Freezing a trainable parameter mid-run needs nothing: it gets no
        gradient and is not stepped. The check reads ``.grad`` of the frozen parameters
        at each optimizer step (a few hundred attribute reads for a LoRA model); their
        ``.grad`` is left as autograd made it."""
        got = [
            name
            for name, param in self._frozen
            if param.grad is not None and name not in self._told_unfrozen
        ]
        if not got:
            return
        self._told_unfrozen.update(got)
        if self.rank == 0:
            log.warning(
                "zerostate: %d parameter(s) frozen (requires_grad=False) when the Engine was "
                "built now receive gradients, which the engine does not apply: %s. It trains "
                "only the parameters that were trainable at Engine(...); to unfreeze one "
                "later, build the engine with it trainable and freeze it with "
                "requires_grad_(False) until then (a parameter without a gradient is not "
                "stepped). Their .grad tensors hold memory until set to None",
                len(got),
                first_names(got),
            )

    def _watch(self) -> tuple[list[Any], list[nn.Module]]:
        """On every module with engine parameters under it: a :class:`_ModuleLoadHook`, a
        :class:`_ModuleCopyGuard` as its ``__deepcopy__`` and, where the engine partitions
        the parameters, a :class:`_ModuleConvertGuard` as its ``_apply``. Returns the hook
        handles and those modules (for :meth:`remove`)."""
        by_param = {id(tp.model_param(sp.param)): sp for sp in self._params}
        self._param_ids = set(by_param)
        copy_guard = _ModuleCopyGuard(self)
        convert_guard = _ModuleConvertGuard(self) if self._runtime.policy.shard_params else None
        handles, guarded = [], []
        for module in self._module.modules():
            tree = [
                (name, p)
                for name, p in module.named_parameters(remove_duplicate=False)
                if id(p) in by_param
            ]
            if not tree:
                continue
            owned = {
                name: by_param[id(p)]
                for name, p in module.named_parameters(recurse=False)
                if id(p) in by_param
            }
            hook = _ModuleLoadHook(self, owned, tree)
            handles.append(module.register_load_state_dict_pre_hook(hook))
            module.__dict__["__deepcopy__"] = types.MethodType(copy_guard, module)
            if convert_guard is not None:
                module.__dict__["_apply"] = types.MethodType(convert_guard, module)
            guarded.append(module)
        return handles, guarded

    def convert_module(self, module: nn.Module, fn: Callable, recurse: bool) -> nn.Module:
        """``module._apply(fn, recurse)`` of a module with partitioned parameters under it,
        checked first.

        [Note: converting a partitioned model]
        At stage 3 the engine owns the parameters' storage: each holds no values outside
        a gather, and a gather fills the storage the parameter has. ``model.double()`` and
        ``model.share_memory()`` on a wrapped stage-3 model killed the process with SIGSEGV
        (torch copies from a parameter with no storage), ``model.half()`` raised torch's
        "data is not allocated yet", and ``model.to_empty()`` put new full tensors under
        the engine (2 gloo ranks). A conversion that changes a parameter (a new tensor, or
        its storage moved) is now refused before any is converted, naming what works; one
        that changes nothing (``.to()`` the device and dtype the parameters have, as
        Lightning and the Trainer call it) goes through. Whether ``fn`` changes a tensor
        is asked of a one-element tensor of each dtype and device the parameters have: the
        conversions torch's methods make are elementwise in dtype and device. The
        outermost call checks its whole subtree; the submodules it converts are not asked
        again.
        """
        if self._converting:
            return type(module)._apply(module, fn, recurse)
        seen = set()
        for p in module.parameters():
            if id(p) not in self._param_ids or (p.dtype, p.device) in seen:
                continue
            seen.add((p.dtype, p.device))
            if hollow.converts(fn, p.dtype, p.device):
                raise StageUsageError(
                    "converting the parameters of a model a stage-3 engine trains (to "
                    "another dtype or device, to_empty(), share_memory()): the engine owns "
                    "their storage, partitioned across the ranks, and the conversion would "
                    "replace it (outside a gather it holds no values). Set the working dtype "
                    "with precision= and move the model before building the Engine, or call "
                    "engine.close() first (the model then holds its full weights)"
                )
        self._converting = True
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            self._converting = False

    def copy_module(self, module: nn.Module, memo: dict) -> nn.Module:
        """``copy.deepcopy(module)`` of a module the engine trains (or of a model holding
        one).

        [Note: deep copies of a wrapped model]
        A deep copy (an EMA or SWA model through ``AveragedModel(model)``, a frozen
        reference model for DPO, a snapshot) copied the engine along with the weights: the
        engine's forward hooks, its ``load_state_dict`` and ``state_dict`` hooks, the
        checkpointed blocks' forwards and the mark that the model is wrapped. Reproduced on
        2 gloo ranks:
        * with ``activation_checkpointing``, at every stage, the copy's forward ran the
          original's blocks: its output moved with the original's training (an EMA equal
          to the live model, a reference model that is the policy), with no error;
        * at stage 3, a copy made inside ``gathered()`` gathered the original's parameters
          at each of its calls, and called on rank 0 alone it hung in that gather;
        * ``Engine(copy)`` was refused as "already wrapped";
        * at stage 3 outside a gather the parameters hold no storage, and the copy (torch
          clones each parameter) killed the process with SIGSEGV.
        Now the copy is a plain torch module: none of the engine's hooks, the blocks' own
        forwards, no mark; its parameters are clones of the values the module holds (the
        working parameters: at stage 3 inside ``gathered()``). At stage 3 outside a gather
        the copy is refused before anything is copied, naming ``gathered()``. The original
        keeps everything. The copy is the caller's: the engine does not train or save it.
        """
        if self._copying:  # a submodule of a copy in progress: the outer call checks and strips
            return _plain_deepcopy(module, memo)
        hollow = [
            name
            for name, p in module.named_parameters()
            if id(p) in self._param_ids and holds_no_values(p)
        ]
        if hollow:
            raise StageUsageError(
                f"copy.deepcopy() at stage 3: {hollow[0]} (and every parameter outside a "
                "gather) is partitioned across the ranks and holds no values here, so the "
                "copy would have none. Copy inside `with engine.gathered():` (a full copy on "
                "each rank that runs it, a plain torch module the engine does not train), or "
                "build the copy from engine.full_state_dict()"
            )
        self._copying = True
        try:
            dup = _plain_deepcopy(module, memo)
        finally:
            self._copying = False
        hook_ids = {handle.id for handle in self._load_hooks} | self._runtime.hook_ids()
        checkpointed = (
            {id(m) for m in self._activation.modules()} if self._activation is not None else set()
        )
        for original in module.modules():
            twin = memo.get(id(original))
            if not isinstance(twin, nn.Module) or twin is original:
                continue
            state = twin.__dict__
            for name, value in list(state.items()):
                if "hooks" in name and isinstance(value, dict):
                    for key in [k for k in value if k in hook_ids]:
                        del value[key]
            if id(original) in checkpointed:
                state.pop("forward", None)  # the class's own forward
            state.pop(WRAPPED_BY, None)
            state.pop("__deepcopy__", None)
            state.pop("_apply", None)
        return dup

    def on_module_load(
        self,
        module: nn.Module,
        owned: dict[str, ShardedParam],
        tree: list[tuple[str, nn.Parameter]],
        state_dict: Mapping,
        prefix: str,
        metadata: Any,
    ) -> None:
        """Before torch copies ``state_dict`` into ``module``'s own parameters.

        [Note: model.load_state_dict after wrapping]
        ``model.load_state_dict(sd)`` after the engine is built (restoring weights the way a DDP
        script does) writes into the module's parameters, and the engine's own copies did not
        follow. At stages 0-2 with fp32 working parameters the masters are views of them and
        took the values, but in bf16 (or with the masters offloaded) the fp32 masters kept the
        old weights, and the next step wrote those back over the load: on 2 ranks every weight
        was the initial one again after one step at lr 0, with no error. At stage 3 the
        parameters hold no storage outside a gather, and torch's copy into them crashed the
        process (SIGSEGV). So before torch copies a module's parameters this hook:
        * refuses ``assign=True``, which swaps in the dict's tensors as new parameters: the
          engine's hooks and storage stay with the old ones, and the forward output stopped
          changing from step to step (stages 0 and 2, 2 ranks);
        * at stage 3 outside a gather, refuses, naming the calls that work, before anything
          is written (the called module's hook, the first to run, checks every parameter
          the call will write, so a ``gathered(modules=...)`` of a part refuses a load of
          the whole before the gathered part is written); inside
          ``gathered(rank0_only=True)`` too: rank 0 alone would write its own shards, and
          every parameter came out part loaded, part not (2 ranks);
        * passes the fence of every writer ([Note: one fence]): an async save may be reading;
        * writes this rank's fp32 master range (where it is not a view of the parameter) and
          its working-dtype shard (stage 3) from the dict's tensor itself, in full precision,
          so the load lands whether or not a ``gathered()`` block writes back;
        * counts the names as set ([Note: unset state], [Note: torn weights]).
        Tensors of another shape are left to torch, which reports them. As with DDP, every
        rank must load: each writes its own ranges from its own copy of the dict."""
        if self.closed:
            return
        if isinstance(metadata, Mapping) and metadata.get("assign_to_params_buffers"):
            raise ConfigError(
                "load_state_dict(assign=True) would put the dict's tensors in place of the "
                "parameters the engine trains, and training would go on without them; load "
                "without assign=True (the values are copied into the engine's storage)"
            )
        # The whole subtree this call writes is checked before anything is written: the
        # first hook of a load is the called module's, and it sees every key.
        coming = [
            (prefix + name, p)
            for name, p in tree
            if isinstance(src := state_dict.get(prefix + name), torch.Tensor)
            and tuple(src.shape) == tuple(p.shape)
        ]
        if not coming:
            return
        hollow = [key for key, p in coming if holds_no_values(p)]
        if hollow:
            raise ConfigError(
                f"load_state_dict() at stage 3: {hollow[0]} (and every parameter outside a "
                "gather) is partitioned across the ranks and holds no storage here, so torch "
                "cannot copy into it. Load inside `with engine.gathered():` on every rank "
                "(the values land in this rank's shards and fp32 masters), or use "
                "engine.load_pretrained(path) for a safetensors file or Hugging Face "
                "directory, or engine.load(root) for a zerostate checkpoint"
            )
        if self._runtime.gathered_rank0_only:
            raise ConfigError(
                "load_state_dict() inside gathered(rank0_only=True): each rank writes only "
                "its own shards, so the other ranks would keep the old values and every "
                "parameter would be part loaded, part not; load inside `with "
                "engine.gathered():` on every rank"
            )
        incoming = []
        for name, sp in owned.items():
            src = state_dict.get(prefix + name)
            if isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(sp.shape):
                incoming.append((name, sp, src))
        if not incoming:
            return
        self._before_update()  # [Note: one fence]
        with torch.no_grad():
            for _, sp, src in incoming:
                flat = src.detach().reshape(-1)
                shard = sp.shard
                if shard is not None and self._runtime.policy.shard_params:
                    shard.copy_(flat[sp.start : sp.stop].view(shard.shape))
                if sp.master is not None and not sp.master_aliased:
                    lo = sp.master_start
                    sp.master.copy_(flat[lo : lo + sp.master.numel()].view(sp.master.shape))
        self._parts.mark_set({sp.name for _, sp, _ in incoming})


class _ModuleLoadHook:
    """``load_state_dict`` pre-hook of one module with engine parameters in its subtree;
    reaches its guards weakly (the module outlives a closed engine) and hands the load to
    :meth:`ModuleGuards.on_module_load` ([Note: model.load_state_dict after wrapping])."""

    __slots__ = ("_guards", "_owned", "_tree")

    def __init__(
        self,
        guards: ModuleGuards,
        owned: dict[str, ShardedParam],
        tree: list[tuple[str, nn.Parameter]],
    ) -> None:
        self._guards = weakref.ref(guards)
        self._owned = owned  # the module's own parameter name -> its ShardedParam
        self._tree = tree  # every engine parameter under the module, by relative name

    def __call__(
        self, module: nn.Module, state_dict: Mapping, prefix: str, metadata: Any, *_: Any
    ) -> None:
        guards = self._guards()
        if guards is not None:
            guards.on_module_load(module, self._owned, self._tree, state_dict, prefix, metadata)

    def __deepcopy__(self, memo: dict) -> _ModuleLoadHook:
        # A deep copy of the module drops this hook ([Note: deep copies of a wrapped
        # model]); copying it first would copy the engine's shards and masters for nothing.
        return self


class _ModuleCopyGuard:
    """``__deepcopy__`` of every module with engine parameters under it, put in the
    module's ``__dict__`` bound to it (``copy.deepcopy`` looks the method up on the
    instance); reaches its guards weakly and hands the copy to :meth:`ModuleGuards.copy_module`
    ([Note: deep copies of a wrapped model])."""

    __slots__ = ("_guards",)

    def __init__(self, guards: ModuleGuards) -> None:
        self._guards = weakref.ref(guards)

    def __call__(self, module: nn.Module, memo: dict) -> nn.Module:
        guards = self._guards()
        if guards is None:  # the module outlived its engine
            return _plain_deepcopy(module, memo)
        return guards.copy_module(module, memo)


class _ModuleConvertGuard:
    """``_apply`` of every module with partitioned engine parameters under it (the method
    behind ``.to()``, ``.half()``, ``.double()``, ``.cuda()``, ``to_empty()`` and
    ``share_memory()``), put in the module's ``__dict__`` bound to it; reaches its guards
    weakly ([Note: converting a partitioned model])."""

    __slots__ = ("_guards",)

    def __init__(self, guards: ModuleGuards) -> None:
        self._guards = weakref.ref(guards)

    def __call__(self, module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
        guards = self._guards()
        if guards is None:  # the module outlived its engine
            return type(module)._apply(module, fn, recurse)
        return guards.convert_module(module, fn, recurse)


def _plain_deepcopy(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy(module, memo)`` past the module's own :class:`_ModuleCopyGuard`
    (taken out of its ``__dict__`` for the copy, then put back)."""
    own = module.__dict__.pop("__deepcopy__", None)
    try:
        return copy.deepcopy(module, memo)
    finally:
        if own is not None:
            module.__dict__["__deepcopy__"] = own
