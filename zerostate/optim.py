"""Any supported ``torch.optim`` optimizer, run on the fp32 master shards a rank owns.

The user builds a normal torch optimizer over the model's parameters, with any param
groups. :func:`resolve_user_optimizers` maps its groups to parameter names (by identity)
and :class:`ShardedOptimizer` builds an *inner* instance of the same class, with the same
group hyperparameters, over this rank's master shards. That inner instance is what
``engine.optimizer`` returns, so its ``param_groups`` are live: LR schedulers and direct
edits take effect at the next step.

[Note: element-wise optimizers]
An element-wise optimizer (every update element depends only on the same element of the
parameter, gradient and state) gives, element for element, the same result on any
partition of the elements as on the whole tensor. So the torch class itself runs on the
shards; its per-parameter state tensors have the shard's shape and are partitioned like
the parameter (checkpoint name ``optim/<state key>/<param name>``), its scalar state
(``step``, NAdam's ``mu_product``) is identical on every rank and goes to JSON metadata.
Optimizers that need whole matrices get their own class (:mod:`zerostate.muon`); anything
else is refused, because running it on shards would silently compute a different update.

[Note: uniform stepping]
torch skips a parameter whose ``.grad`` is None. The engine decides per parameter, the
same way on every rank, whether it is stepped (it received a gradient on some rank), and
then every rank steps it, including ranks that own zero elements of it (an empty shard
with an empty gradient). So every rank holds the same state keys for every parameter,
and checkpoint metadata written by any rank describes all of them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from zerostate import jsonstate
from zerostate.errors import CheckpointError, ConfigError
from zerostate.muon import PartitionedMuon
from zerostate.sharded import ShardedParam
from zerostate.store.state_doc import OPTIMIZER_STATE_VERSION

#: Param-group keys that choose a kernel, not the arithmetic: not saved, not restored, so a
#: checkpoint does not depend on where the step ran (offload picks the fused host kernel).
_KERNEL_KEYS = ("foreach", "fused")
_STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps step counters in float64 only when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


class _KnownZero:
    """The optimizer-state tensors known to hold all-zero bits because the engine made them
    so and nothing has written them since: a load may read a checkpoint straight into them
    and, if the load fails, zero them again ([Note: known zero moments]).

    [Note: known zero moments]
    A load that fails while reading must leave the optimizer state as it was ([Note:
    nothing lands before every rank has read] in zerostate.checkpoint.load), so a state
    tensor the step holds is read into a fresh tensor, unless the old one is all zero:
    then it is read in place and the undo zeroes it. The engine creates its moments zero at
    construction, so every resume is that case. It used to be found by scanning every
    moment (a ``uint8`` ``any()`` per tensor) before the read. In a process that had not
    run that reduction before (every resume), with the page cache dropped, the scan cost
    20-30 ms of a 0.19 s load (GPT-2 'io', 3 ranks on 2 cores): its kernel's code pages were
    read from disk, a major fault each, five or six per rank; the bytes scanned took 3 ms.
    Now the engine remembers the tensors it zeroed, each with its ``_version``, and
    forgets them all at a step, at a torch ``load_state_dict`` and at a load that reads
    into them. A tensor counts as zero only while it is the same object at the same
    version, so an in-place edit through torch (which bumps ``_version``) makes it an
    ordinary tensor, read into fresh memory. Writes that bypass the version counter
    outside a step (``.data``, numpy views of the tensor, a fused kernel called by hand)
    are not seen: after such a write and a load that fails, the undo would zero the
    tensor."""

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[Any, int]] = {}

    def add(self, t: torch.Tensor) -> None:
        import weakref

        self._tensors[id(t)] = (weakref.ref(t), t._version)

    def take(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is known zero; it is forgotten either way (about to be written)."""
        entry = self._tensors.pop(id(t), None)
        return entry is not None and entry[0]() is t and entry[1] == t._version

    def clear(self) -> None:
        self._tensors.clear()


def _adam_state(group: dict, p: torch.Tensor) -> dict:
    state = {"step": torch.tensor(0.0, dtype=_scalar_dtype()), "exp_avg": _zeros(p)}
    state["exp_avg_sq"] = _zeros(p)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = _zeros(p)
    return state


def _nadam_state(group: dict, p: torch.Tensor) -> dict:
    return {
        "step": torch.tensor(0.0, dtype=_scalar_dtype()),
        "mu_product": torch.tensor(1.0, dtype=_scalar_dtype()),
        "exp_avg": _zeros(p),
        "exp_avg_sq": _zeros(p),
    }


def _radam_state(group: dict, p: torch.Tensor) -> dict:
    return {"step": torch.tensor(0.0, dtype=_scalar_dtype()), "exp_avg": _zeros(p),
            "exp_avg_sq": _zeros(p)}  # fmt: skip


def _adamax_state(group: dict, p: torch.Tensor) -> dict:
    return {"step": torch.tensor(0.0, dtype=_scalar_dtype()), "exp_avg": _zeros(p),
            "exp_inf": _zeros(p)}  # fmt: skip


def _rmsprop_state(group: dict, p: torch.Tensor) -> dict:
    state = {"step": torch.zeros((), dtype=_scalar_dtype()), "square_avg": _zeros(p)}
    if group.get("momentum", 0) > 0:
        state["momentum_buffer"] = _zeros(p)
    if group.get("centered"):
        state["grad_avg"] = _zeros(p)
    return state


def _adadelta_state(group: dict, p: torch.Tensor) -> dict:
    return {"step": torch.zeros((), dtype=_scalar_dtype()), "square_avg": _zeros(p),
            "acc_delta": _zeros(p)}  # fmt: skip


def _muon_state(group: dict, p: torch.Tensor) -> dict:
    return {"momentum_buffer": _zeros(p)}


# Supported classes and the state torch would create at their first step, created here at
# construction instead (same values), so memory is allocated up front as the ZeRO
# accounting expects. Every per-element tensor they make must be zero: the engine
# registers it as such ([Note: known zero moments]). None: torch's own lazy initialisation
# is kept (SGD's momentum buffer starts as a copy of the first gradient; Adagrad
# initialises in its constructor).
_INITIAL_STATE: dict[type, Callable[[dict, torch.Tensor], dict] | None] = {
    torch.optim.AdamW: _adam_state,
    torch.optim.Adam: _adam_state,
    torch.optim.NAdam: _nadam_state,
    torch.optim.RAdam: _radam_state,
    torch.optim.Adamax: _adamax_state,
    torch.optim.RMSprop: _rmsprop_state,
    torch.optim.Adadelta: _adadelta_state,
    torch.optim.SGD: None,
    torch.optim.Adagrad: None,
}
_WHOLE_MATRIX: dict[type, type] = {}
if hasattr(torch.optim, "Muon"):
    _WHOLE_MATRIX[torch.optim.Muon] = PartitionedMuon
_REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure and keeps whole-model history "
    "vectors; use a first-order optimizer such as AdamW",
    "SparseAdam": "it needs sparse gradients, which the engine's dense gradient shards "
    "never are; use Adam or AdamW",
    "Adafactor": "its factored second moment needs whole rows and columns of each matrix, "
    "which partitioned shards do not hold",
}


def whole_matrix_names(optimizer: Any) -> list[str]:
    """Class names of the user optimizers (one or a list) that need whole matrices."""
    opts = optimizer if isinstance(optimizer, list) else [optimizer]
    return [type(o).__name__ for o in opts if type(o) in _WHOLE_MATRIX]


def supported_names() -> list[str]:
    return sorted(c.__name__ for c in [*_INITIAL_STATE, *_WHOLE_MATRIX])


def _check_class(opt: Any) -> None:
    if is_linked(opt):
        raise ConfigError(
            f"this {type(opt).__name__} already drives a zerostate Engine (its param_groups "
            "are that engine's); build a fresh optimizer over the new model's parameters"
        )
    if not isinstance(opt, Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer (or a list of them), got "
            f"{type(opt).__name__}"
        )
    cls = type(opt)
    if cls in _INITIAL_STATE or cls in _WHOLE_MATRIX:
        return
    why = _REFUSED.get(cls.__name__)
    if why is not None:
        raise ConfigError(f"optimizer {cls.__name__} cannot run on partitioned shards: {why}")
    # Unknown classes (subclasses of supported ones included) are refused: the engine can
    # only vouch for an update it knows to be element-wise (see [Note: element-wise
    # optimizers]); running anything else on shards could be silently wrong.
    raise ConfigError(
        f"optimizer {cls.__module__}.{cls.__qualname__} is not supported: the engine runs "
        "the optimizer on partitions of each parameter and only knows these to be exact "
        f"there: {', '.join(supported_names())}. Use one of them"
    )


def _has_stepped(opt: Optimizer) -> bool:
    # Adagrad creates its state (step 0) in the constructor; any other state, or a step
    # count above zero, comes from a step.
    for st in opt.state.values():
        step = st.get("step")
        if (step is None and len(st)) or (step is not None and float(step) > 0):
            return True
    return False


def resolve_user_optimizers(
    optimizer: Optimizer | Sequence[Optimizer], named: list[tuple[str, torch.nn.Parameter]]
) -> list[tuple[Optimizer, list[list[str]]]]:
    """Validate the user's optimizer(s); per optimizer, its groups as parameter names
    (``named`` is the model's ``named_parameters()``).

    Frozen parameters in a group are dropped (they never receive a gradient, so torch
    would never step them either).
    """
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not opts:
        raise ConfigError("optimizer=[] is empty; pass a torch optimizer, or omit it for AdamW")
    by_id = {id(p): (n, p) for n, p in named}
    owner: dict[str, int] = {}
    out = []
    for k, opt in enumerate(opts):
        _check_class(opt)
        if _has_stepped(opt):
            raise ConfigError(
                f"optimizer {type(opt).__name__} already holds state (it has been stepped); "
                "pass a fresh optimizer to Engine and restore state with engine.load()"
            )
        groups = []
        for g in opt.param_groups:
            members = []
            for p in g["params"]:
                entry = by_id.get(id(p))
                if entry is None:
                    raise ConfigError(
                        f"optimizer {type(opt).__name__} holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter of the model; build it "
                        "over model.parameters() (or groups of them)"
                    )
                name, param = entry
                if name in owner:
                    raise ConfigError(
                        f"parameter {name} is in more than one optimizer group; put each "
                        "parameter in exactly one"
                    )
                owner[name] = k
                if param.requires_grad:
                    members.append(name)
            groups.append(members)
        out.append((opt, groups))
    missing = [n for n, p in named if p.requires_grad and n not in owner]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"{len(missing)} trainable parameter(s) are in no optimizer group: {shown}. Add "
            "them to a group, or set requires_grad=False on those you mean to freeze"
        )
    return out


def describe(optimizer: Any) -> Any:
    """What must agree across ranks about the user's optimizer(s) (for the engine check)."""
    if optimizer is None:
        return None
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return [
        (type(o).__name__, [repr({k: v for k, v in g.items() if k != "params"})
                            for g in getattr(o, "param_groups", [])])
        for o in opts
    ]  # fmt: skip


class CombinedOptimizer(Optimizer):
    """Several inner optimizers behind one ``torch.optim.Optimizer`` (Muon for matrices,
    AdamW for the rest, say). ``param_groups`` are the inner optimizers' own group dicts,
    in order, so a scheduler on this object drives every group."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = optimizers
        defaults: dict = {}
        for opt in optimizers:
            defaults.update(opt.defaults)
        # Optimizer.__init__ keeps the very dicts it is given, so the groups stay shared; no
        # defaults there, or it would add one class's keys to the other's groups.
        super().__init__([g for opt in optimizers for g in opt.param_groups], {})
        self.defaults = defaults  # what schedulers inspect (OneCycleLR: betas or momentum)
        # torch's load_state_dict gives an optimizer new group dicts; point at them again
        # (in place: a scheduler reads the list each time), or a scheduler on this object
        # would go on setting dicts no optimizer steps with.
        for opt in optimizers:
            opt.register_load_state_dict_post_hook(self._regroup)

    def _regroup(self, _optimizer: Optimizer) -> None:
        self.param_groups[:] = [g for opt in self.optimizers for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("the engine's optimizer step takes no closure")
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict:
        """The inner optimizers' state dicts as one, in torch's layout: their groups in
        order, the parameters numbered across all of them, as one torch optimizer over the
        same groups numbers them. The state lives in the inner optimizers; torch's own
        ``state_dict`` would read this object's ``state``, which stays empty, and return no
        state at all. At stages 1-3 it is this rank's shards, as for a single optimizer
        (``engine.save`` writes every rank's)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state: dict[int, Any] = {}
        groups: list[dict] = []
        base = 0
        for opt in self.optimizers:
            inner = opt.state_dict()
            ids = [i for g in inner["param_groups"] for i in g["params"]]
            number = {i: base + k for k, i in enumerate(ids)}
            state.update({number[i]: v for i, v in inner["state"].items()})
            groups.extend(
                {**g, "params": [number[i] for i in g["params"]]} for g in inner["param_groups"]
            )
            base += len(ids)
        out = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hooked = post_hook(self, out)
            out = out if hooked is None else hooked
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s layout back into the inner optimizers, each its own
        groups. Every group is checked against its optimizer's before any is loaded, so a
        dict that does not fit changes nothing. torch's hooks on this object run as torch
        runs them."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hooked = pre_hook(self, state_dict)
            state_dict = state_dict if hooked is None else hooked
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        state = state_dict.get("state", {}) if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise ValueError("an optimizer state dict holds 'state' and 'param_groups'")
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups; the engine's "
                f"optimizers have {len(self.param_groups)}"
            )
        for k, (saved, own) in enumerate(zip(groups, self.param_groups, strict=True)):
            if not isinstance(saved, dict) or len(saved.get("params", ())) != len(own["params"]):
                raise ValueError(
                    f"loaded state dict's parameter group {k} does not match the size of the "
                    f"optimizer's group ({len(own['params'])} parameters)"
                )
        at = 0
        for opt in self.optimizers:
            mine = groups[at : at + len(opt.param_groups)]
            at += len(opt.param_groups)
            ids = [i for g in mine for i in g["params"]]
            opt.load_state_dict(
                {"state": {i: state[i] for i in ids if i in state}, "param_groups": mine}
            )
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


@dataclass(frozen=True, slots=True)
class OptimizerLoad:
    """A checked, decoded optimizer part of a load (:meth:`ShardedOptimizer.plan_state`,
    :meth:`ShardedOptimizer.plan_groups`); :meth:`ShardedOptimizer.apply_load` installs it."""

    #: Per trainable parameter, the state tensor keys it holds after the load (the reader
    #: fills them); None: unknown to the checkpoint, its state stays as it is.
    keys: dict[str, tuple[str, ...] | None]
    #: Per parameter, its decoded scalar state (``step``, ...).
    scalars: dict[str, dict[str, Any]]
    #: Per engine group, the hyperparameters to apply; None keeps the group's own.
    hyper: tuple[dict | None, ...]
    #: Groups that kept their own settings: their members were saved in several groups.
    mixed: tuple[str, ...]


def _groups_listing(groups: list[list[str]]) -> str:
    """Param groups by name, each cut to its first three members."""
    shown = [m[:3] + ["..."] if len(m) > 3 else m for m in groups]
    return ", ".join("[" + ", ".join(m) + "]" for m in shown)


class ShardedOptimizer:
    """The optimizer state of one rank: inner torch optimizer(s) over the master shards.

    ``trainable`` is the engine's trainable-parameter list; ``step`` takes gradient shards
    index-aligned with it. ``gather`` all-gathers full flat tensors from shards (for
    optimizers that need whole matrices, see :mod:`zerostate.muon`).
    """

    def __init__(
        self,
        trainable: list[ShardedParam],
        resolved: list[tuple[Optimizer, list[list[str]]]] | None,
        *,
        adamw: dict,
        gather: Callable[[list[ShardedParam], list[torch.Tensor]], list[torch.Tensor]],
        host_step: bool = False,
    ) -> None:
        self.trainable = trainable
        self._by_name = {sp.name: sp for sp in trainable}
        self.step_count = 0
        if resolved is None:
            # The engine's own AdamW: decay / no-decay groups from EngineConfig. foreach=True
            # keeps the numbers of earlier releases, which followed that implementation.
            decay = [sp for sp in trainable if not sp.no_decay]
            no_decay = [sp for sp in trainable if sp.no_decay]
            resolved = [(None, [[sp.name for sp in decay], [sp.name for sp in no_decay]])]
        self.inner: list[Optimizer] = []
        #: [Note: known zero moments]
        self._known_zero = _KnownZero()
        self.group_members: list[list[ShardedParam]] = []
        for user, names in resolved:
            groups = [[self._by_name[n] for n in members] for members in names]
            specs = []
            for k, members in enumerate(groups):
                hyper = (
                    {"weight_decay": adamw["weight_decay"] if k == 0 else 0.0}
                    if user is None
                    else {key: v for key, v in user.param_groups[k].items() if key != "params"}
                )
                specs.append({**hyper, "params": [sp.master for sp in members]})
                self.group_members.append(members)
            if user is None:
                # On the host (offload) torch's fused CPU kernel is the fastest AdamW
                # (benchmarks/offload.py); it agrees with foreach to rounding.
                kernel = {"fused": True} if host_step and _fused_cpu_adamw() else {"foreach": True}
                opt = torch.optim.AdamW(
                    specs, lr=adamw["lr"], betas=adamw["betas"], eps=adamw["eps"], **kernel
                )
            elif type(user) in _WHOLE_MATRIX:
                opt = _WHOLE_MATRIX[type(user)](
                    specs, user.defaults, members=[sp for m in groups for sp in m], gather=gather
                )
            else:
                opt = type(user)(specs, **_constructor_defaults(user))
            self.inner.append(opt)
        self.optimizer: Optimizer = (
            self.inner[0] if len(self.inner) == 1 else CombinedOptimizer(self.inner)
        )
        for opt in self.inner:
            init = _INITIAL_STATE.get(type(opt))
            if isinstance(opt, PartitionedMuon):
                init = _muon_state
            if init is None:
                continue
            for group in opt.param_groups:
                on_device = any(p.device.type != "cpu" for p in group["params"])
                if group.get("capturable") or (group.get("fused") and on_device):
                    continue  # device-resident counters: leave it to torch's own init
                for shard in group["params"]:
                    if not opt.state.get(shard):
                        opt.state[shard] = init(group, shard)
                        for value in opt.state[shard].values():
                            if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                                self._known_zero.add(value)

    def fence_loads(self, fence: Callable[[], None]) -> None:
        """Call ``fence`` before any ``load_state_dict`` of these torch optimizers writes
        optimizer state: the engine's ``optimizer`` and the inner ones a user's linked
        optimizer delegates to ([Note: one fence] in zerostate.engine). The state it
        installs is no longer the zero state the engine made ([Note: known zero moments])."""

        def before(optimizer: Optimizer, state_dict: dict) -> None:
            self._known_zero.clear()
            fence()

        for opt in {id(o): o for o in (self.optimizer, *self.inner)}.values():
            opt.register_load_state_dict_pre_hook(before)

    def guard_state_dicts(self, owner: tuple[int, int] | None) -> None:
        """Tag every ``state_dict()`` of these torch optimizers with whose state it is, and
        refuse a ``load_state_dict`` of another rank's.

        [Note: whose optimizer state dict]
        ``state_dict()`` of the engine's optimizer (or of a user's linked one) is this
        rank's state: at stages 1-3, or under tensor parallelism, the shards this rank
        owns. The DDP habit (rank 0 saves ``optimizer.state_dict()``, every rank loads that
        file) then gives every other rank rank 0's moments for its own shards, and torch
        checks no shapes: on 2 ranks at stage 2 rank 1's moments became rank 0's without a
        word. So each dict carries the rank and world size that wrote it (``owner``; None
        when every rank holds the same state: stage 0 without tensor parallelism) and the
        flat range of every parameter its state covers, and a load checks them before
        anything changes: another rank's dict, or ranges or state shapes that are not this
        rank's (another stage, world size or model), are refused, naming ``engine.save`` /
        ``engine.load``. A dict without the tag (a plain torch optimizer's) is checked by
        its state tensors' shapes alone; where this rank's master is a whole parameter
        (stage 0, or one rank), a plain dict's state in the parameter's shape is taken,
        flattened as the master is."""
        by_master = {id(sp.master): sp for sp in self.trainable}

        def members(optimizer: Optimizer) -> list[ShardedParam]:
            return [by_master[id(p)] for g in optimizer.param_groups for p in g["params"]]

        def ranges(sp: ShardedParam) -> list[int]:
            return [sp.master_start, sp.master.numel(), sp.numel]

        def tag(optimizer: Optimizer, state_dict: dict) -> None:
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            state_dict[_STATE_TAG] = {
                "rank": None if owner is None else owner[0],
                "world_size": None if owner is None else owner[1],
                "ranges": {i: ranges(sp) for i, sp in zip(ids, members(optimizer), strict=True)},
            }

        def refuse(why: str) -> None:
            raise ConfigError(
                f"optimizer.load_state_dict: {why}. optimizer.state_dict() holds only this "
                "rank's part of the optimizer state, so one rank's dict cannot resume another "
                "rank, another world size or another stage; save with engine.save(root) and "
                "resume with engine.load(root) (any world size)"
            )

        def check(optimizer: Optimizer, state_dict: Any) -> dict | None:
            try:
                groups, state = state_dict["param_groups"], state_dict.get("state", {})
                ids = [i for g in groups for i in g["params"]]
            except (TypeError, KeyError, AttributeError):
                return None  # torch's own checks name what is malformed
            own = members(optimizer)
            if len(ids) != len(own) or not isinstance(state, dict):
                return None
            saved = state_dict.get(_STATE_TAG)
            if isinstance(saved, dict):
                who = (saved.get("rank"), saved.get("world_size"))
                if owner is not None and who != owner:
                    whose = (
                        "every rank's (replicated)"
                        if who == (None, None)
                        else f"rank {who[0]} of {who[1]}'s"
                    )
                    refuse(
                        f"the dict holds {whose} optimizer state; this is rank {owner[0]} of "
                        f"{owner[1]}, which holds its own shards"
                    )
                spans = saved.get("ranges")
                for i, sp in zip(ids, own, strict=True):
                    got = spans.get(i) if isinstance(spans, dict) else None
                    if got is not None and list(got) != ranges(sp):
                        a, n, full = ranges(sp)
                        refuse(
                            f"{sp.name}: the dict's state covers elements {got[0]}-"
                            f"{got[0] + got[1]} of {got[2]}; this rank's covers {a}-{a + n} "
                            f"of {full}"
                        )
            flat: dict = {}
            for i, sp in zip(ids, own, strict=True):
                live = self._state_of(sp)
                for key, value in (state.get(i) or {}).items():
                    have = live.get(key)
                    if (
                        not isinstance(value, torch.Tensor)
                        or not isinstance(have, torch.Tensor)
                        or not value.dim()
                        or value.shape == have.shape
                    ):
                        continue
                    if value.numel() == have.numel() == sp.numel and ranges(sp)[0] == 0:
                        # A whole parameter's state in its own shape (a plain torch
                        # optimizer's) for a master that is the whole parameter, flat.
                        flat.setdefault(i, dict(state[i]))[key] = value.reshape(have.shape)
                        continue
                    refuse(
                        f"{sp.name}: the dict's {key!r} has shape {list(value.shape)}; "
                        f"this rank's is {list(have.shape)}"
                    )
            if flat:
                return {**state_dict, "state": {**state, **flat}}
            return None

        for opt in {id(o): o for o in (self.optimizer, *self.inner)}.values():
            opt.register_state_dict_post_hook(tag)
            opt.register_load_state_dict_pre_hook(check, prepend=True)

    def _state_of(self, sp: ShardedParam) -> dict:
        for opt in self.inner:
            if sp.master in opt.state:
                return opt.state[sp.master]
        return {}

    # ------------------------------------------------------------------ stepping
    def step(self, grads: list[torch.Tensor], stepped: list[bool]) -> None:
        """One optimizer step. ``grads[i]`` is the fp32 gradient shard of trainable
        parameter ``i``; parameters with ``stepped[i]`` False are skipped as torch skips a
        parameter without a gradient (``stepped`` must agree across ranks)."""
        self._known_zero.clear()  # a step writes the state, fused kernels unseen
        for sp, grad, on in zip(self.trainable, grads, stepped, strict=True):
            sp.master.grad = grad if on else None
        try:
            self.optimizer.step()
        finally:
            for sp in self.trainable:
                sp.master.grad = None
        self.step_count += 1

    # -------------------------------------------------------------------- state
    def state_tensors(self, sp: ShardedParam) -> list[tuple[str, torch.Tensor]]:
        """Per-element state of ``sp``: tensors shaped like its master shard."""
        return [
            (key, value)
            for key, value in self._state_of(sp).items()
            if isinstance(value, torch.Tensor) and value.shape == sp.master.shape
        ]

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for sp in self.trainable for _, t in self.state_tensors(sp)
        )

    def metadata(self) -> dict:
        """JSON description of the state that is not in the partitioned tensors."""
        state = {}
        for sp in self.trainable:
            st = self._state_of(sp)
            if not st:
                continue
            tensors = [key for key, _ in self.state_tensors(sp)]
            scalars = {
                key: jsonstate.encode(v, f"optimizer state {key} of {sp.name}")
                for key, v in st.items()
                if key not in tensors
            }
            state[sp.name] = {"tensors": tensors, "scalars": scalars}
        return {
            "version": OPTIMIZER_STATE_VERSION,
            "classes": [type(opt).__name__ for opt in self.inner],
            "group_params": [[sp.name for sp in m] for m in self.group_members],
            "param_groups": [
                jsonstate.encode(
                    {k: v for k, v in g.items() if k != "params" and k not in _KERNEL_KEYS},
                    "param group",
                )
                for g in self.optimizer.param_groups
            ],
            "state": state,
        }

    def plan_state(
        self, meta: dict, *, strict: bool = True
    ) -> tuple[dict[str, tuple[str, ...] | None], dict[str, dict[str, Any]]]:
        """Check a checkpoint's optimizer metadata (version, classes, state entries)
        against this optimizer and decode it: the ``keys`` and ``scalars`` of an
        :class:`OptimizerLoad`; nothing here changes (see [Note: planned load] in
        zerostate.checkpoint.load_plan). :meth:`plan_groups` gives the rest."""
        self._check_meta(meta)
        saved = meta["state"]
        for name in saved:
            if name not in self._by_name and strict:
                raise CheckpointError(
                    f"the checkpoint has optimizer state for {name!r}, which is not a "
                    "trainable parameter of this model (strict=False skips it)"
                )
        known = {n for members in meta["group_params"] for n in members}
        keys: dict[str, tuple[str, ...] | None] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for sp in self.trainable:
            entry = saved.get(sp.name)
            if entry is None:
                # Saved before it was stepped: no state. Unknown to the checkpoint: kept
                # as it is (the tensor check reports its state missing under strict).
                keys[sp.name] = () if sp.name in known else None
                continue
            if not isinstance(entry, dict):
                raise CheckpointError(f"optimizer state of {sp.name} is malformed: {entry!r}")
            names = entry.get("tensors")
            if not isinstance(names, list) or not all(
                isinstance(k, str) and _STATE_KEY.match(k) for k in names
            ):
                raise CheckpointError(f"optimizer state keys of {sp.name} are malformed: {names!r}")
            keys[sp.name] = tuple(names)
            scalars[sp.name] = self._decoded_scalars(sp.name, entry.get("scalars", {}))
        return keys, scalars

    @staticmethod
    def _decoded_scalars(name: str, encoded: Any) -> dict[str, Any]:
        if not isinstance(encoded, dict):
            raise CheckpointError(f"optimizer scalar state of {name} is malformed")
        out = {}
        for key, enc in encoded.items():
            if not (isinstance(key, str) and _STATE_KEY.match(key)):
                raise CheckpointError(f"optimizer state key {key!r} of {name} is malformed")
            out[key] = jsonstate.decode(enc, f"optimizer state {key} of {name}")
        return out

    def plan_groups(
        self, meta: dict, *, strict: bool = True
    ) -> tuple[list[dict | None], list[str]]:
        """Per engine group, the saved hyperparameters it takes (None: it keeps its own),
        and a description of each group kept because its members were saved in several.

        [Note: groups by membership]
        A saved group's settings belong to its parameters, not to its position: with
        ``strict=False`` each engine group takes the settings of the one saved group its
        known members were in. A group of only new parameters keeps its own settings; one
        whose members come from several saved groups has no single right answer, keeps
        its own and is named in a warning on rank 0. ``strict=True`` refuses any other
        grouping, naming both."""
        decoded = []
        for enc in meta["param_groups"]:
            hyper = jsonstate.decode(enc, "param group")
            if not isinstance(hyper, dict):
                raise CheckpointError("a saved param group is not a dict")
            hyper.pop("params", None)
            for key in _KERNEL_KEYS:  # this engine's kernel choice, not the saved one's
                hyper.pop(key, None)
            decoded.append(hyper)
        theirs = meta["group_params"]
        mine = [[sp.name for sp in m] for m in self.group_members]
        if theirs == mine:
            return list(decoded), []
        if strict:
            raise CheckpointError(
                "the checkpoint's optimizer param groups hold other parameters than this "
                f"engine's (checkpoint: {_groups_listing(theirs)}; engine: "
                f"{_groups_listing(mine)}); build the optimizer with the same groups (same "
                "parameters, in the same order) as the run that saved it, or pass "
                "strict=False to match groups by their parameters"
            )
        where = {n: i for i, members in enumerate(theirs) for n in members}
        hyper: list[dict | None] = []
        mixed = []
        for i, members in enumerate(mine):
            found = sorted({where[n] for n in members if n in where})
            hyper.append(dict(decoded[found[0]]) if len(found) == 1 else None)
            if len(found) > 1:
                mixed.append(f"group {i} ({_groups_listing([members])}) from saved groups {found}")
        return hyper, mixed

    def apply_load(
        self, plan: OptimizerLoad, step: int, read: Collection[str] = ()
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        """Install a checked plan: state keys, scalar state, group hyperparameters and the
        step count. A key of host memory whose tensor the step holds
        (``optim/<key>/<name>`` in ``read``) gets a tensor the reader fills in place: its
        own while it is known zero (as the engine made it at construction; the undo zeroes
        it again; [Note: known zero moments]), else a fresh one. The others keep a tensor
        of the right shape, else fresh zeros (a device tensor is written only after every
        rank has read, from host staging). Returns what puts the previous state, groups and count
        back exactly, and the tensors for the reader ([Note: nothing lands before every
        rank has read] in zerostate.checkpoint.load)."""
        previous = [(opt, dict(opt.state)) for opt in self.inner]
        groups = [dict(g) for g in self.optimizer.param_groups]
        count = self.step_count
        fresh: list[torch.Tensor] = []
        zeroed: list[torch.Tensor] = []  # read in place: the undo zeroes them again
        for sp in self.trainable:
            keys = plan.keys[sp.name]
            if keys is None:
                continue
            opt = self._inner_of(sp)
            old = opt.state.get(sp.master, {})
            state = {}
            for key in keys:
                value = old.get(key)
                ok = isinstance(value, torch.Tensor) and value.shape == sp.master.shape
                if f"optim/{key}/{sp.name}" in read and sp.master.device.type == "cpu":
                    if ok and self._known_zero.take(value):
                        # As the engine made it ([Note: known zero moments]): no second copy.
                        state[key] = value
                        zeroed.append(value)
                    else:
                        state[key] = torch.empty_like(
                            sp.master, memory_format=torch.preserve_format
                        )
                    fresh.append(state[key])
                    continue
                state[key] = value if ok else _zeros(sp.master)
            state.update(plan.scalars.get(sp.name, {}))
            if state:
                opt.state[sp.master] = state
            else:
                opt.state.pop(sp.master, None)
        for g, hyper in zip(self.optimizer.param_groups, plan.hyper, strict=True):
            if hyper is not None:
                g.update(hyper)
        self.step_count = step

        def undo() -> None:
            with torch.no_grad():
                for t in zeroed:
                    t.zero_()
                    self._known_zero.add(t)
            for opt, state in previous:
                opt.state.clear()
                opt.state.update(state)
            for g, saved in zip(self.optimizer.param_groups, groups, strict=True):
                g.clear()
                g.update(saved)
            self.step_count = count

        return undo, fresh

    def _inner_of(self, sp: ShardedParam) -> Optimizer:
        for opt in self.inner:
            for g in opt.param_groups:
                if any(p is sp.master for p in g["params"]):
                    return opt
        raise AssertionError(f"{sp.name} is in no inner optimizer")

    def _check_meta(self, meta: Any) -> None:
        version = meta.get("version") if isinstance(meta, dict) else None
        if version != OPTIMIZER_STATE_VERSION:
            raise CheckpointError(
                f"optimizer state version {version!r} is not {OPTIMIZER_STATE_VERSION}; it "
                "was written by an incompatible zerostate (or the metadata is missing)"
            )
        mine = [type(opt).__name__ for opt in self.inner]
        if meta.get("classes") != mine:
            raise CheckpointError(
                f"the checkpoint was trained with optimizer(s) {meta.get('classes')} but this "
                f"engine runs {mine}; build the engine with the same optimizer classes"
            )
        groups = meta.get("group_params")
        if (
            not isinstance(groups, list)
            or not all(isinstance(m, list) and all(isinstance(n, str) for n in m) for m in groups)
            or not isinstance(meta.get("param_groups"), list)
            or len(meta["param_groups"]) != len(groups)
            or not isinstance(meta.get("state"), dict)
        ):
            raise CheckpointError("optimizer metadata is malformed")


def legacy_adamw_metadata(names: list[list[str]], step: int, groups: list[dict]) -> dict:
    """Metadata equivalent to a checkpoint of the engine's built-in AdamW written before
    optimizer metadata existed (every trainable parameter has exp_avg and exp_avg_sq)."""
    step_enc = jsonstate.encode(torch.tensor(float(step), dtype=_scalar_dtype()))
    return {
        "version": OPTIMIZER_STATE_VERSION,
        "classes": ["AdamW"],
        "group_params": names,
        "param_groups": [
            jsonstate.encode({k: v for k, v in g.items() if k != "params"}) for g in groups
        ],
        "state": {
            n: {"tensors": ["exp_avg", "exp_avg_sq"], "scalars": {"step": step_enc}}
            for members in names
            for n in members
        },
    }


def _fused_cpu_adamw() -> bool:
    try:
        probe = torch.zeros(1)
        opt = torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError):
        return False
    del opt
    return True


def _constructor_defaults(opt: Optimizer) -> dict:
    """Keyword arguments that rebuild ``opt``'s class with its defaults; the groups carry
    every per-group value anyway, so only keys the constructor accepts are passed."""
    accepted = inspect.signature(type(opt).__init__).parameters
    return {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared elements of all ``tensors`` as a 1-element fp32 tensor."""
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(nonempty)
    return torch.stack(norms).float().square().sum().reshape(1)


# [Note: live user optimizer]
# Users of DeepSpeed and FSDP build a scheduler on the optimizer they created and call
# ``opt.step()``. The engine steps an inner optimizer over the master shards, so the user's
# object would otherwise be a detached copy whose lr changes nothing. After construction
# its class is swapped for a subclass (isinstance and the class name stay) whose
# ``param_groups`` and ``state`` are the inner optimizer's (the same dicts, so a
# ``LambdaLR(opt, ...)`` drives the engine, and a load updates them in place) and whose
# ``step()`` is ``engine.step()``. ``_opt_called`` reports the engine's steps, so torch's
# scheduler sees the optimizer stepped even when the user calls ``engine.step()``.
_LINKED: dict[type, type] = {}
_ENGINE_REF = "_zerostate_engine_ref"
_INNER = "_zerostate_inner"
#: The key of an optimizer state dict that says whose state it holds ([Note: whose
#: optimizer state dict]).
_STATE_TAG = "zerostate_shards"


def _engine_of(opt: Any) -> Any:
    engine = getattr(opt, _ENGINE_REF)()
    if engine is None:
        raise ConfigError(
            f"this {type(opt).__name__} drove a zerostate Engine that no longer exists; "
            "build a new optimizer for a new Engine"
        )
    return engine


class _LinkedOptimizer:
    """Mixed into the user's optimizer class; see [Note: live user optimizer]."""

    @property
    def param_groups(self) -> list[dict]:
        return getattr(self, _INNER).param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        getattr(self, _INNER).param_groups = value

    @property
    def state(self) -> Any:
        return getattr(self, _INNER).state

    @state.setter
    def state(self, value: Any) -> None:
        getattr(self, _INNER).state = value

    @property
    def _opt_called(self) -> bool:
        engine = getattr(self, _ENGINE_REF)()
        return engine is not None and engine.optimizer_steps > 0

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        pass  # derived from the engine's step count

    #: torch.amp.GradScaler.step(opt) then hands this step the scale (``grad_scale``,
    #: ``found_inf``) instead of asserting "No inf checks were recorded for this optimizer"
    #: ([Note: a GradScaler around the engine]).
    _step_supports_amp_scaling = True

    def step(self, closure: Callable | None = None) -> Any:
        """``engine.step()``: the engine owns the update of the partitioned state.

        [Note: a GradScaler around the engine]
        A DDP fp16 script keeps ``torch.amp.GradScaler``: ``scaler.scale(loss)``, then
        ``scaler.step(opt)`` and ``scaler.update()``. Around the engine the scaler's
        ``unscale_`` looked for gradients in ``opt.param_groups`` (the engine's fp32
        masters, whose gradients exist only inside ``engine.step()``), found none and
        raised torch's "No inf checks were recorded for this optimizer", which names
        neither the cause nor the fix (2 ranks, stages 0-3). The scaler cannot be served:
        its ``update()`` needs inf checks recorded in its own state. So the linked
        optimizer declares that it handles scaling, which makes the scaler hand the step
        its scale, and the step refuses with the fix: the engine scales fp16 losses itself
        (``precision="fp16"``), and bf16 needs no scaling. Nothing is stepped; the scaled
        gradients stay accumulated, so a script that catches this must build a new engine.
        """
        if closure is not None:
            raise ConfigError(
                "this optimizer is driven by a zerostate Engine, whose step takes no closure; "
                "call engine.backward(loss) and then engine.step() (or opt.step())"
            )
        if "found_inf" in vars(self):  # set by torch.amp.GradScaler.step(self)
            raise ConfigError(
                "torch.amp.GradScaler around a zerostate Engine: the engine keeps fp32 master "
                "weights and scales fp16 losses itself (Engine(precision='fp16'), dynamic loss "
                "scaling; bf16 needs none). Drop the GradScaler: engine.backward(loss) instead "
                "of scaler.scale(loss).backward(), and engine.step() (or opt.step()) instead of "
                "scaler.step(opt) and scaler.update(). Nothing was stepped; this step's "
                "gradients were scaled by the GradScaler, so start the run again"
            )
        return _engine_of(self).step()

    # torch's LR schedulers wrap an optimizer's step to learn that it was called; this step
    # reports that through _opt_called already, so a scheduler built later leaves it alone.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: ``engine.step()`` zeroes the gradients it consumed."""

    def state_dict(self) -> dict:
        return getattr(self, _INNER).state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        getattr(self, _INNER).load_state_dict(state_dict)


def _linked_class(cls: type) -> type:
    linked = _LINKED.get(cls)
    if linked is None:
        linked = type(cls.__name__, (_LinkedOptimizer, cls), {"__module__": cls.__module__})
        linked.__qualname__ = cls.__qualname__
        _LINKED[cls] = linked
    return linked


def is_linked(opt: Any) -> bool:
    """Whether ``opt`` already drives an engine (see [Note: live user optimizer])."""
    return isinstance(opt, _LinkedOptimizer)


def link_user_optimizers(optimizer: Any, sharded: ShardedOptimizer, engine: Any) -> None:
    """Make the user's optimizer(s) views of the engine's inner ones, in order."""
    import weakref

    if optimizer is None:
        return
    users = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for user, inner in zip(users, sharded.inner, strict=True):
        vars(user).pop("param_groups", None)
        vars(user).pop("state", None)
        vars(user).pop("_opt_called", None)
        vars(user).pop("step", None)  # a scheduler's wrapper of the original step
        object.__setattr__(user, _INNER, inner)
        object.__setattr__(user, _ENGINE_REF, weakref.ref(engine))
        user.__class__ = _linked_class(type(user))
