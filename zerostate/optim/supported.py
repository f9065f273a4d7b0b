"""Which torch optimizers the engine runs on master shards, how it builds their state up
front, and the user's optimizer(s) resolved against the model ([Note: element-wise
optimizers] in zerostate.optim); :class:`CombinedOptimizer` puts several behind one."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerostate.errors import ConfigError
from zerostate.optim.linked import is_linked
from zerostate.optim.muon import PartitionedMuon

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
