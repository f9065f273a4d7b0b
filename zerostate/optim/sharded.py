"""The optimizer state of one rank: :class:`ShardedOptimizer`, inner torch optimizer(s) over
the fp32 master shards it owns, with its step, state dicts and planned loads
([Note: uniform stepping] in zerostate.optim)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from zerostate import jsonstate
from zerostate.errors import CheckpointError, ConfigError
from zerostate.optim.muon import PartitionedMuon
from zerostate.optim.supported import (
    _INITIAL_STATE,
    _KERNEL_KEYS,
    _STATE_KEY,
    _WHOLE_MATRIX,
    CombinedOptimizer,
    _KnownZero,
    _muon_state,
    _scalar_dtype,
    _zeros,
)
from zerostate.runtime.sharded import ShardedParam
from zerostate.store.state_doc import OPTIMIZER_STATE_VERSION

#: The key of an optimizer state dict that says whose state it holds ([Note: whose
#: optimizer state dict]).
_STATE_TAG = "zerostate_shards"


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
    optimizers that need whole matrices, see :mod:`zerostate.optim.muon`).
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
            # The engine's own AdamW: decay / no-decay groups from EngineConfig.
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
                # Wherever the step runs on the host (offload, or a CPU run) torch's fused
                # CPU kernel is the fastest AdamW: one pass over each tensor, where foreach
                # on CPU loops over per-tensor kernels that allocate intermediates and is
                # slower than even the for-loop torch's AdamW defaults to there (8.4M fp32
                # elements, one thread: 7.6 ms fused, 37 ms for-loop, 67 ms foreach;
                # benchmarks/offload.py for the host step). It agrees with foreach to
                # rounding. On an accelerator foreach keeps the numbers of earlier releases.
                on_host = host_step or all(sp.master.device.type == "cpu" for sp in trainable)
                kernel = {"fused": True} if on_host and _fused_cpu_adamw() else {"foreach": True}
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
