"""The parameter-group runtime: sequences every stage's groups through a training step.

The engine calls, whatever the stage: ``pre_forward()`` / ``post_forward()`` around the
module's forward; per micro-step ``prepare(boundary=...)``, ``on_grad_ready(i)`` from each
trainable parameter's post-accumulate-grad hook, ``finish_backward()``; at the step
``step_grads()``, ``reduce_norm_and_flags()``, ``refresh()``, ``zero()``.

[Note: reduce order]
Gradient collectives are launched in one static order, the same on every rank: buckets in
reverse parameter order (the order backward usually produces gradients); module units in
reverse module order, the root last. A group is launched once its gradients are complete
on this rank *and* every group before it in that order has been launched. A group that did
not run on a rank (an idle expert, a skipped block) is complete only at the end of
backward, where every group left is launched with zeros for the missing gradients. So what
each rank computed never changes which collectives it issues or in which order. Once units
have run on some ranks only, they are launched in the rounds of [Note: conditional units].

[Note: structural lifecycle]
With partitioned parameters a unit is gathered when its module is entered (forward
pre-hook) and released when its forward returns; for backward it is gathered again when
the first gradient reaches one of its outputs, and released when autograd is done with the
module: when the gradients of its inputs have been computed (an autograd function applied
to the inputs at forward time), or at the end of backward when no input needed a
gradient. Frozen parameters inside a trainable module therefore stay gathered as long as
autograd needs them (LoRA), and a frozen module on a trainable path is gathered again for
backward.

[Note: agreed gather order] and [Note: conditional units] are in
zerostate.runtime.schedule: which unit each rank gathers next.

[Note: no hollow state dict]
Outside a gather a partitioned parameter has its full shape and zero bytes of storage
([Note: partitioned parameters] in zerostate.runtime.group). A ``state_dict()`` of such a
module would hand out tensors whose shapes look right and whose storage is empty: saved
with ``torch.save``, they give a file ``torch.load`` cannot read. Gathering inside
``state_dict()`` would make it collective, and a script that calls it on rank 0 only would
hang, so every module that owns a partitioned parameter gets a state-dict pre-hook that
raises naming the calls that work: ``engine.full_state_dict()`` and ``engine.gathered()``.
At the end of training ``engine.close()`` gathers every group for good and removes the
runtime's hooks (:meth:`GroupRuntime.detach`), so the module is a plain torch module with
its full trained weights: ``model.state_dict()``, ``torch.save`` and ``save_pretrained``
work as without zerostate, at the cost of the full working parameters once per rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from zerostate.dist import collectives
from zerostate.dist.comm import CommContext, InFlight, all_gather_groups
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import StageUsageError
from zerostate.runtime.grad_stand_in import where_grads_are
from zerostate.runtime.group import GroupPolicy, GroupState, ParamGroup
from zerostate.runtime.grouping import assign_units, select_units, split_into_buckets
from zerostate.runtime.init import materialise
from zerostate.runtime.schedule import GatherSchedule, GroupMismatchError
from zerostate.runtime.sharded import FlatLayout, ShardedParam
from zerostate.runtime.tp import local_tensor, model_param

__all__ = ["GroupMismatchError", "GroupRuntime", "holds_no_values"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward marks the unit done
    ([Note: structural lifecycle])."""

    @staticmethod
    def forward(ctx: Any, runtime: GroupRuntime, group: ParamGroup, *inputs: torch.Tensor):
        ctx.runtime, ctx.group = runtime, group
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        ctx.runtime._post_backward(ctx.group)
        return (None, None, *grads)


class GroupRuntime:
    """Every parameter group of one engine and the order they run in."""

    def __init__(
        self,
        ctx: CommContext,
        params: list[ShardedParam],
        *,
        stage: int,
        bucket_numel: int,
        coordinator: Coordinator,
    ) -> None:
        self.ctx = ctx
        #: The engine's control collectives over ``ctx.group`` ([Note: one coordinator] in
        #: zerostate.coordinator): the forward-order checks of stage 3 go through it.
        self.coordinator = coordinator
        self.params = params
        self.trainable = [sp for sp in params if sp.trainable]
        self.stage = stage
        self.bucket_numel = bucket_numel
        self.policy: GroupPolicy = GroupPolicy.for_stage(stage)
        self.groups: list[ParamGroup] = []
        self.root: ParamGroup | None = None
        self._reduce_order: list[ParamGroup] = []
        self._slot: list[tuple[ParamGroup, int]] = []  # per trainable: (group, index in it)
        self._inflight = InFlight()
        self._next = 0
        self._communicate = False
        self._boundary = False
        #: Called with each group once its reduced gradients of an accumulation boundary
        #: are final, while backward continues ([Note: completion hooks] in zerostate.comm).
        self.on_reduced: Callable[[ParamGroup], None] | None = None
        self._indices: dict[int, list[int]] = {}  # per group: its trainables' positions
        #: Names of tensors no initialiser wrote ([Note: unset state] in runtime.init).
        self.unset: list[str] = []
        # Partitioned parameters only:
        self.schedule = GatherSchedule(self)  # [Note: agreed gather order]
        self._backward_phase = False
        self._in_forward = False
        self._gathered_depth = 0
        #: Units a backward with create_graph=True went through, kept gathered until the
        #: end of the next backward ([Note: backward with create_graph]).
        self._held: set[int] = set()
        #: Inside gathered(rank0_only=True): only rank 0 holds the full parameters.
        self.gathered_rank0_only = False
        self._hooks: list[RemovableHandle] = []  # on the model; removed by detach()
        #: Every group gathered for good, the hooks gone ([Note: no hollow state dict]).
        self.detached = False

    # -- construction ----------------------------------------------------------------
    def setup(self, model: nn.Module, config: Any) -> None:
        self.policy = GroupPolicy.for_stage(
            self.stage, prefetch=config.prefetch, offload=config.offload
        )
        if self.policy.shard_params:
            self.unset = materialise(
                model,
                self.params,
                dtype=self.ctx.param_dtype,
                device=self.ctx.device,
                init_fn=config.init_fn,
                seed=config.init_seed,
            )
            units = select_units(model, config.unit_policy, config.leaf_modules)
            root, members = assign_units(model, self.params, units)
            self.root = self._group("", root)
            pairs = [(module, self._group(name, m)) for name, module, m in members]
            self._reduce_order = [g for _, g in reversed(pairs)] + [self.root]
            for module, group in pairs:
                self._hooks += [
                    module.register_forward_pre_hook(
                        self._make_pre_forward(group), with_kwargs=True
                    ),
                    module.register_forward_hook(self._make_post_forward(group)),
                ]
            self._hooks.append(model.register_forward_pre_hook(self._guard_outside_call))
            self._guard_state_dicts(model)
        else:
            frozen = [sp for sp in self.params if not sp.trainable]
            for members in split_into_buckets(list(reversed(self.trainable)), self.bucket_numel):
                self._reduce_order.append(self._group(f"bucket{len(self.groups)}", members))
            for members in split_into_buckets(frozen, self.bucket_numel):
                self._group(f"frozen{len(self.groups)}", members)
            for group in self.groups:
                group.place(self.ctx.param_dtype)
        self._reduce_order = [g for g in self._reduce_order if g.trainable]
        where = {id(sp): (g, i) for g in self.groups for i, sp in enumerate(g.trainable)}
        self._slot = [where[id(sp)] for sp in self.trainable]
        for group in self.groups:
            self._indices[group.index] = [0] * len(group.trainable)
        for position, (group, i) in enumerate(self._slot):
            self._indices[group.index][i] = position

    def reduced_groups(self) -> list[tuple[ParamGroup, list[int]]]:
        """Every group with trainable parameters and, index-aligned with
        ``group.trainable``, their positions in :attr:`trainable`."""
        return [(g, self._indices[g.index]) for g in self._reduce_order]

    def positions(self, group: ParamGroup) -> list[int]:
        """Where ``group.trainable[i]`` is in :attr:`trainable`, for every ``i``."""
        return self._indices[group.index]

    def _group(self, name: str, members: list[ShardedParam]) -> ParamGroup:
        group = ParamGroup(len(self.groups), name, members, self.policy, self.ctx)
        self.groups.append(group)
        return group

    # -- forward -----------------------------------------------------------------------
    def pre_forward(self) -> None:
        self._in_forward = True
        if self._gathered_depth:
            return
        if self.root is not None:
            self.schedule.start_forward()
            self.gather_now(self.root)
            self.schedule.prefetch_first()

    def post_forward(self) -> None:
        self._in_forward = False
        if self.root is None or self._gathered_depth:
            return
        self.schedule.end_forward()
        if not torch.is_grad_enabled():
            self.release_all()

    def _guard_outside_call(self, module: nn.Module, args: Any) -> None:
        if not (self._in_forward or self._gathered_depth or _in_backward()):
            raise StageUsageError(
                "at stage 3 the model's parameters are partitioned, so calling the wrapped "
                "module outside the engine (model(...), model.generate(...)) would compute "
                "with empty weights; call engine(...) to train, or run evaluation, "
                "generate() and save_pretrained() inside `with engine.gathered():`"
            )

    def _guard_state_dicts(self, model: nn.Module) -> None:
        """[Note: no hollow state dict]: a pre-hook on every module owning a partitioned
        parameter, so ``state_dict()`` of the model or of any submodule is covered."""
        partitioned = {id(model_param(sp.param)) for sp in self.params}
        for module in model.modules():
            owned = [p for p in module._parameters.values() if p is not None]
            if any(id(p) in partitioned for p in owned):
                self._hooks.append(module.register_state_dict_pre_hook(_refuse_hollow))

    def _make_pre_forward(self, group: ParamGroup):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if self._gathered_depth:
                return None
            if _in_backward():  # activation-checkpoint recomputation
                if self.schedule.conditional:
                    self.schedule.demand(group)
                else:
                    self.gather_now(group)
                return None
            self.schedule.enter(group)
            if torch.is_grad_enabled():
                return self._wrap_inputs(group, args, kwargs)
            return None

        return hook

    def _wrap_inputs(self, group: ParamGroup, args: tuple, kwargs: dict):
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not positions:
            return None
        group.num_backward_calls += 1
        outs = _PostBackward.apply(self, group, *[flat[i] for i in positions])
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        for i, t in zip(positions, outs, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _make_post_forward(self, group: ParamGroup):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._gathered_depth or _in_backward():
                return
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(group))
                        group.needs_backward = True
            if group.index not in self._held:
                group.release()

        return hook

    @staticmethod
    def label(group: ParamGroup) -> str:
        return repr(group.name) if group.name else "the root parameters"

    # -- gathering -----------------------------------------------------------------------
    def gather_now(self, group: ParamGroup) -> None:
        if group.state is GroupState.GATHERED:
            return
        group.start_gather()
        if group.state is GroupState.GATHERED:
            return
        tags = group.wait_gather()
        if any(t != tags[0] for t in tags) or tags[0] != group.index + 1:
            group.drop_gather()
            self.schedule.raise_mismatch(tags)
        group.unpack_gather()

    # -- backward ------------------------------------------------------------------------
    def _make_pre_backward(self, group: ParamGroup):
        def hook(grad: torch.Tensor) -> None:
            if torch.is_grad_enabled():  # create_graph=True
                self._held.add(group.index)
            if group.state is GroupState.GATHERED:
                return
            if self.schedule.conditional:
                self.schedule.demand(group)  # [Note: conditional units]
                return
            self.gather_now(group)
            if self.policy.prefetch:
                order = self.schedule.order
                index = next((i for i, g in enumerate(order) if g is group), 0)
                for prev in reversed(order[:index]):
                    if prev.needs_backward and prev.num_backward_done < prev.num_backward_calls:
                        prev.start_gather()
                        break

        return hook

    def _post_backward(self, group: ParamGroup) -> None:
        """The unit's inputs have their gradients: release it and let its gradients be
        reduced, unless a backward with ``create_graph=True`` went through it.

        [Note: backward with create_graph]
        A gradient penalty (WGAN-GP, R1) takes ``torch.autograd.grad(D(x).sum(), x,
        create_graph=True)`` and adds a function of it to the loss. The graph that call
        builds holds the unit's parameters as saved tensors outside any module's forward,
        so the unit's hooks cannot gather them when the loss's backward reaches those
        nodes; released, they had zero bytes and the backward raised torch's "setStorage:
        ... out of bounds for storage of size 0" (2 ranks, stage 3; stages 0-2 equal
        torch). Autograd runs such a backward with grad mode on, which the unit's hooks
        see: from then until the end of the next backward the unit stays gathered (its
        forward and backward hooks leave it so), and its gradients are reduced when that
        backward ends (:meth:`finish_backward`), once every node that adds to them has
        run. Ranks run the same graph, so they hold the same units and issue the same
        collectives. The cost is the held units' full parameters for that step."""
        group.num_backward_done += 1
        if torch.is_grad_enabled():
            self._held.add(group.index)
        if group.index in self._held or group.num_backward_done < group.num_backward_calls:
            return
        group.release()
        group.ready = True
        self._launch_ready()

    def prepare(self, *, boundary: bool) -> None:
        self.uncover_grads()  # a backward without a step in between (after a load, say)
        self._communicate = boundary or self.policy.shard_grads
        self._boundary = boundary
        self._next = 0
        self._backward_phase = True
        for group in self.groups:
            group.prepare(communicate=self._communicate)
        if self.schedule.conditional:
            # [Note: conditional units]: a unit this rank did not enter has nothing to
            # wait for; its gradients are zeros.
            ran = self.schedule.ran
            for group in self.groups:
                if group is not self.root and group.index not in ran:
                    group.ready = True

    def on_grad_ready(self, index: int) -> None:
        group, i = self._slot[index]
        if group.launched and self._communicate:
            raise StageUsageError(
                f"the gradient of {self.trainable[index].name} arrived after its group "
                f"{self.label(group)} was reduced; this autograd graph reaches the "
                "parameter after its module's inputs (report it with the model)"
            )
        complete = group.on_grad(i)
        if complete and not self.policy.shard_params:
            group.ready = True
        if self._communicate:
            self._launch_ready()

    def _launch_ready(self) -> None:
        if not self._communicate or self.schedule.conditional:
            return  # conditional units: launched in rounds (launch_agreed)
        order = self._reduce_order
        while self._next < len(order) and order[self._next].ready:
            self._launch(order[self._next])
            self._next += 1

    def ready_upto(self) -> int:
        """How many groups of the reduce order, from the next to launch, are ready here."""
        order, upto = self._reduce_order, self._next
        if self._backward_phase and self._communicate:
            while upto < len(order) and order[upto].ready:
                upto += 1
        return upto

    def launch_agreed(self, upto: int) -> None:
        """Launch the reduce order up to ``upto``, the smallest :meth:`ready_upto` of the
        ranks in a round ([Note: conditional units])."""
        while self._next < upto:
            self._launch(self._reduce_order[self._next])
            self._next += 1

    def _launch(self, group: ParamGroup) -> None:
        hooks: list[Callable[[], None]] = []
        if self._boundary:
            # Replicas first: offload copies the gradients that every replica agrees on
            # ([Note: hybrid sharding] in zerostate.runtime.mesh).
            if self.ctx.replicas is not None:
                hooks.append(group.reduce_replicas)
            if self.on_reduced is not None:
                hooks.append(functools.partial(self.on_reduced, group))
        group.launch(self._inflight, _chain(hooks))

    def finish_backward(self) -> None:
        """After backward: launch what is left (zeros for gradients that never came), wait
        for all communication, release every gathered unit."""
        if self.schedule.conditional:
            self.schedule.finish_phase()  # [Note: conditional units]
        self.schedule.ran.clear()
        self._backward_phase = False
        if self._communicate:
            for group in self._reduce_order[self._next :]:
                if not group.launched:
                    self._launch(group)
            self._next = len(self._reduce_order)
        self._inflight.drain()
        self.release_all()
        if self._boundary:  # the step's gradient is complete, and not in .grad
            reason = where_grads_are(self.stage)
            for group in self.groups:
                group.cover_grads(reason)

    def uncover_grads(self) -> None:
        """Give every ``.grad`` back its value of before the stand-ins ([Note: gradient
        stand-ins] in zerostate.runtime.grad_stand_in)."""
        for group in self.groups:
            group.uncover_grads()

    def release_all(self) -> None:
        if self._gathered_depth or self.detached:
            return
        self._held.clear()
        for group in self.groups:
            group.release()
            group.needs_backward = False
            group.num_backward_calls = 0
            group.num_backward_done = 0

    # -- the step ------------------------------------------------------------------------
    def step_grads(self) -> list[torch.Tensor]:
        per_group = {g.index: g.step_grads() for g in self.groups if g.trainable}
        return [per_group[g.index][i] for g, i in self._slot]

    def reduce_norm_and_flags(self, folded: torch.Tensor) -> None:
        """``folded`` is ``[this rank's sum of squared gradient elements, one flag per
        trainable parameter]``; sum both over the ranks, in place, in one all-reduce."""
        replicas = self.ctx.replicas
        if not self.policy.shard_optimizer and self.ctx.rank != 0:
            # Replicated gradients are the full sum on every rank: count one copy.
            folded[:1].zero_()
        if replicas is not None and replicas.rank != 0:
            folded[:1].zero_()  # every replica holds the same shards: count one replica's
        collectives.all_reduce(folded, group=self.ctx.group, stats=self.ctx.stats)
        if replicas is not None and replicas.size > 1:
            # The flags sum over the whole mesh; so does the norm, from one replica.
            collectives.all_reduce(folded, group=replicas.group, stats=replicas.stats)

    def refresh(self, params: list[ShardedParam] | None = None) -> None:
        """Working values from the masters: of the trainable parameters after a step
        (``None``; counted as step traffic), or of ``params`` after a load."""
        targets = self.trainable if params is None else params
        if self.policy.shard_params:
            if params is not None:
                self.release_all()
            _copy([(sp.shard, sp.master) for sp in targets if not sp.master_aliased])
        elif not self.policy.shard_optimizer:
            _copy([(sp.param.data.view(-1), sp.master) for sp in targets if not sp.master_aliased])
        else:
            groups = (
                [g.trainable for g in self._reduce_order]
                if params is None
                else split_into_buckets(params, self.bucket_numel)
            )
            sources = [[p.master for p in g] for g in groups]
            if self.policy.offload_optimizer:
                # Host masters go host -> device into the owned slice of each working
                # parameter, which then feeds the gather ([Note: offload]); the cast to the
                # working dtype happens in that copy instead of in the gather's pack.
                _copy([(sp.shard, sp.master) for sp in targets if not sp.master_aliased])
                sources = [[p.shard for p in g] for g in groups]
            all_gather_groups(
                self.ctx,
                [FlatLayout(g, self.ctx.world_size, self.ctx.rank) for g in groups],
                sources,
                [[p.param.data.view(-1) for p in g] for g in groups],
                dtype=self.ctx.param_dtype,
                counted=params is None,
            )

    def whole_replicas(self, params: list[ShardedParam]) -> dict[str, torch.Tensor]:
        """``{name: the whole flat working tensor}`` of each of ``params`` that a load can
        read whole, on every rank, instead of reading its owned range and gathering the
        rest ([Note: whole replicas at load] in zerostate.checkpoint): replicated working
        parameters (stages 1-2) in host memory whose fp32 master is a view of them. The
        answer is the same on every rank (it depends on the stage, dtype and device only),
        so every rank leaves the same parameters out of the gather."""
        if not self.policy.shard_optimizer or self.policy.shard_params:
            return {}
        return {
            sp.name: sp.param.data.view(-1)
            for sp in params
            if sp.master_aliased and sp.param.data.device.type == "cpu"
        }

    def zero(self) -> None:
        for group in self.groups:
            group.zero()

    # -- whole tensors ---------------------------------------------------------------------
    def full_masters(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        """Full flat fp32 values of ``params`` (collective)."""
        if not self.policy.shard_optimizer:
            return [sp.master.clone() for sp in params]
        return self.gather_full(params, [sp.master for sp in params], counted=False)

    def gather_full(
        self, params: list[ShardedParam], shards: list[torch.Tensor], *, counted: bool = True
    ) -> list[torch.Tensor]:
        """Full flat fp32 tensors from every rank's owned slice ``shards[i]`` of
        ``params[i]`` (an optimizer's update matrices for Muon; masters for export)."""
        if not self.policy.shard_optimizer:
            return [t.reshape(-1) for t in shards]  # masters (and so the shards) are whole
        ctx = self.ctx
        full = [torch.empty(sp.numel, dtype=torch.float32, device=ctx.device) for sp in params]
        index = {id(sp): i for i, sp in enumerate(params)}
        groups = split_into_buckets(params, self.bucket_numel)
        all_gather_groups(
            ctx,
            [FlatLayout(g, ctx.world_size, ctx.rank) for g in groups],
            [[shards[index[id(p)]].reshape(-1) for p in g] for g in groups],
            [[full[index[id(p)]] for p in g] for g in groups],
            dtype=torch.float32,
            counted=counted,
        )
        return full

    @contextlib.contextmanager
    def gathered(
        self,
        modules: Sequence[nn.Module] | None = None,
        *,
        rank0_only: bool = False,
        writeback: bool = False,
        before_write: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Full working parameters for code outside the training step; collective.
        ``before_write`` runs before ``writeback`` changes the masters (the engine's fence
        for an async save's snapshot)."""
        if rank0_only and writeback:
            raise StageUsageError(
                "gathered(rank0_only=True, writeback=True): the other ranks would keep their "
                "old shards; write back from every rank (rank0_only=False)"
            )
        if self._in_forward or self._gathered_depth:
            raise StageUsageError(
                "gathered() cannot be entered inside a forward or inside another gathered()"
            )
        wanted = None
        if modules is not None:
            wanted = {id(p) for m in modules for p in m.parameters()}
        groups = [
            g
            for g in self.groups
            if wanted is None or any(id(model_param(sp.param)) in wanted for sp in g.params)
        ]
        partitioned = self.policy.shard_params and not self.detached
        if partitioned:
            self._inflight.drain()
            self.release_all()
            for group in groups:
                self.gather_now(group)
                if rank0_only and self.ctx.rank != 0:
                    group.release()
        self._gathered_depth += 1
        self.gathered_rank0_only = rank0_only and partitioned
        try:
            yield
        finally:
            self._gathered_depth -= 1
            self.gathered_rank0_only = False
            if writeback:
                if before_write is not None:
                    before_write()
                for group in groups:
                    if group.state is GroupState.GATHERED:
                        group.write_back()
            if partitioned:
                for group in groups:
                    group.release()

    def hook_ids(self) -> set[int]:
        """The ids of the hooks the runtime has on the model's modules (the keys of their
        hook dicts), so a deep copy of a module can be told from the engine's hooks."""
        return {handle.id for handle in self._hooks}

    def detach(self) -> None:
        """End of training: gather every group for good and remove the runtime's hooks
        from the model, which keeps its full working parameters ([Note: no hollow state
        dict]). Collective when the parameters are partitioned; idempotent."""
        if self.detached:
            return
        self.uncover_grads()
        if self.policy.shard_params:
            self._inflight.drain()
            self.release_all()
            for group in self.groups:  # the same order on every rank
                self.gather_now(group)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.detached = True

    # -- accounting ------------------------------------------------------------------------
    def bytes_held(self) -> dict[str, int]:
        return {
            "params": sum(g.param_bytes() for g in self.groups),
            "grads": sum(g.grad_bytes() for g in self.groups),
            "gathered_params": sum(g.gathered_bytes() for g in self.groups),
        }


def _chain(hooks: list[Callable[[], None]]) -> Callable[[], None] | None:
    if len(hooks) < 2:
        return hooks[0] if hooks else None

    def run() -> None:
        for hook in hooks:
            hook()

    return run


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # non_blocking: host -> device copies of offloaded masters from pinned memory overlap
    # with what follows on the device's stream (ordered before any later use there).
    if pairs:
        torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs], non_blocking=True)


def holds_no_values(param: torch.Tensor) -> bool:
    """Whether ``param`` is a partitioned parameter outside a gather: its full shape and
    no storage ([Note: partitioned parameters] in zerostate.runtime.group)."""
    return bool(param.numel()) and not local_tensor(param).untyped_storage().nbytes()


def _refuse_hollow(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """State-dict pre-hook of a module owning partitioned parameters ([Note: no hollow
    state dict])."""
    hollow = [
        prefix + name
        for name, p in module._parameters.items()
        if p is not None and holds_no_values(p)
    ]
    if hollow:
        raise StageUsageError(
            f"state_dict() at stage 3: {hollow[0]} (and every parameter outside a gather) "
            "is partitioned across the ranks and holds no values here, so the state dict "
            "would be empty tensors of the right shapes. Use engine.full_state_dict() "
            "(collective: call it on every rank; full fp32 values), or call state_dict() / "
            "save_pretrained() inside `with engine.gathered():` on every rank; after "
            "training, engine.close() leaves the full weights in the model"
        )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
