"""ZeRO on the local shards of torch tensor parallelism (DTensor parameters).

[Note: tensor parallelism]
The user applies torch's ``parallelize_module(model, mesh["tp"], plan)`` before building
the engine and passes the whole mesh (``("dp_shard", "tp")``, ``("tp",)``, ...). The
engine never re-implements tensor parallelism: DTensor's forward and backward do every
``tp`` collective of the computation. What the engine changes:

* Each DTensor parameter enters the engine as its *local* shard (:class:`LocalParam`):
  layouts, buckets, masters, gradient buffers and optimizer states are those of the local
  tensor, partitioned over ``dp_shard`` exactly as a plain parameter of that shape would
  be. Ranks at the same ``tp`` coordinate form the ZeRO group; ranks at the same
  ``dp_shard`` coordinate see the same batch (the divisor of the step counts data-parallel
  ranks only, never ``tp``).
* Plain parameters of a tensor-parallel model (norms, embeddings outside the plan) are
  replicated over ``tp``: DTensor's input hooks already sum their gradients over ``tp``
  in backward (a ``Replicate`` input's gradient is made ``Replicate``), so every ``tp``
  rank holds the same gradient and takes the same step. A DTensor gradient whose
  placement differs from its parameter's (``Partial``) is redistributed to the
  parameter's placement as it arrives (:meth:`LocalParam.settle_grad`), so the engine
  never steps on a partial sum.
* The gradient norm sums the squares of ``tp``-sharded parameters over ``tp`` and counts
  ``tp``-replicated ones on ``tp`` rank 0 only; the folded norm-and-flags vector is
  all-reduced over ``tp`` after ``dp_shard`` (and ``dp_replicate``), so the norm, the
  clipping coefficient and the fp16 overflow verdict are one value on the whole mesh.
* Stage 3 partitions the local shards as any parameter's ([Note: partitioned
  parameters] in zerostate.runtime.group): the model's DTensor parameters are replaced by
  new ones (same mesh, placements, global shape) whose local tensor has zero bytes of
  storage (:func:`empty_like_param`); a unit's gather resizes and fills that local storage
  over ``dp_shard`` and its release frees it, so the module always holds DTensors and
  DTensor's forward and backward do the ``tp`` collectives on the gathered values.
  Offload moves masters, optimizer states (and at stage 3 the shards) of the local shards
  to the host, as for any parameter.
* Stage 0's gradient-as-view of the flat buffer is off for a group holding a DTensor
  parameter (a DTensor's ``.grad`` must be a DTensor); its gradient is copied into the
  buffer as it arrives, as at stage 1.
* ``full_state_dict()`` rebuilds each gathered local tensor into a DTensor and returns
  its ``full_tensor()`` (collective over ``tp``): global tensors under the model's names.
* ``save``/``load`` write and read global tensors in tp x dp pieces ([Note: tensor-parallel
  checkpoints] in zerostate.runtime.tp_checkpoint).
* Not supported yet, refused before any collective: ``load_pretrained``, a DTensor on
  another mesh than ``mesh["tp"]``, placements other than ``Shard(0)``, ``Shard(1)`` and
  ``Replicate()``, DTensor parameters on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerostate.dist import collectives
from zerostate.dist.collectives import CommStats
from zerostate.errors import ConfigError

SUPPORTED_PLACEMENTS = ("shard(0)", "shard(1)", "replicate")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallel:
    """The ``tp`` dimension of the engine's mesh."""

    mesh: Any
    """``mesh["tp"]``: every DTensor parameter must live on it."""
    group: Any
    rank: int
    size: int
    stats: CommStats = field(default_factory=CommStats)
    """The collectives the engine itself issues over ``tp`` (see :func:`all_reduce` and
    :meth:`LocalParam.settle_grad`); DTensor's own forward/backward traffic is not here."""


class LocalParam:
    """A DTensor parameter seen by the engine as its local shard: ``.data``, ``.grad``,
    ``shape`` and ``numel()`` are those of the local tensor ([Note: tensor parallelism]).
    Hooks are registered on the DTensor parameter itself, which autograd accumulates."""

    __slots__ = ("dparam", "sharded")

    def __init__(self, dparam: torch.nn.Parameter) -> None:
        self.dparam = dparam
        #: Whether the parameter is split over tp (else every tp rank holds all of it).
        self.sharded = collectives.dtensor_placements(dparam) != ("replicate",)

    # -- the local tensor --------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        return collectives.dtensor_local(self.dparam)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value is self.data:
            return
        # ``dparam.data = dtensor`` would change the DTensor's dtype but keep its old local
        # tensor (a bf16 / fp16 working copy would never reach the forward), so the
        # parameter object takes the new DTensor's contents in place: the same object,
        # which the model and the user's optimizer hold.
        new = torch.nn.Parameter(
            collectives.dtensor_like(value, self.dparam), self.dparam.requires_grad
        )
        torch.utils.swap_tensors(self.dparam, new)

    @property
    def grad(self) -> torch.Tensor | None:
        grad = self.dparam.grad
        if grad is None:
            return None
        # settle_grad ran in the gradient hook: a partial sum never reaches the engine.
        assert grad.placements == self.dparam.placements, (grad.placements, self.dparam)
        return collectives.dtensor_local(grad)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if value is not None:  # internal: gradient views are off for DTensor parameters
            raise TypeError("a DTensor parameter's .grad is set by autograd only")
        self.dparam.grad = None

    def settle_grad(self, stats: CommStats | None = None) -> None:
        """Bring an arrived gradient to the parameter's placement (a ``Partial`` one is
        summed over ``tp`` here; collective over ``tp``, in hook order, which is the same
        on every ``tp`` rank since they run the same graph). Counted in ``stats`` as the
        all-reduce of the local gradient it is ([Note: comm accounting])."""
        grad = self.dparam.grad
        if grad is not None and grad.placements != self.dparam.placements:
            self.dparam.grad = collectives.dtensor_redistribute_like(grad, self.dparam)
            if stats is not None:
                local = collectives.dtensor_local(grad)
                stats.record("all_reduce", 2 * local.numel(), local.element_size())

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor whose local shard is ``local`` (collective over ``tp``)."""
        return collectives.dtensor_full(local.view(self.shape), self.dparam)

    # -- what the engine reads of a parameter --------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def numel(self) -> int:
        return self.data.numel()

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def requires_grad(self) -> bool:
        return self.dparam.requires_grad

    @property
    def is_meta(self) -> bool:
        return self.dparam.is_meta

    def untyped_storage(self) -> Any:
        return self.data.untyped_storage()

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        return self.dparam.register_post_accumulate_grad_hook(hook)


def local_view(param: torch.nn.Parameter) -> Any:
    """What the engine keeps of ``param``: a :class:`LocalParam` for a DTensor."""
    return LocalParam(param) if collectives.is_dtensor(param) else param


def model_param(param: Any) -> torch.nn.Parameter:
    """The parameter object the model holds for what the engine keeps (``param`` itself,
    or a :class:`LocalParam`'s DTensor)."""
    return param.dparam if isinstance(param, LocalParam) else param


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param``'s storage-holding tensor: a DTensor's local shard, else ``param``."""
    return collectives.dtensor_local(param) if collectives.is_dtensor(param) else param


def empty_like_param(
    param: Any, dtype: torch.dtype, device: torch.device, requires_grad: bool
) -> Any:
    """A parameter of ``param``'s (local) shape with zero bytes of storage, for stage 3
    ([Note: partitioned parameters] in zerostate.runtime.group): a plain ``nn.Parameter``,
    or for a :class:`LocalParam` a new one whose DTensor (same mesh, placements, global
    shape) has such a local tensor. The module is handed the DTensor, so torch's DTensor
    forward and backward run the tp collectives on the gathered local storage."""
    local = torch.empty(param.shape, dtype=dtype, device=device)
    local.untyped_storage().resize_(0)
    if not isinstance(param, LocalParam):
        return torch.nn.Parameter(local, requires_grad=requires_grad)
    fresh = torch.nn.Parameter(collectives.dtensor_like(local, param.dparam), requires_grad)
    # The DTensor's local tensor aliases ``local``: resizing its storage gathers/releases.
    assert collectives.dtensor_local(fresh).untyped_storage().data_ptr() == (
        local.untyped_storage().data_ptr()
    )
    return LocalParam(fresh)


def check_model(
    named: list[tuple[str, torch.nn.Parameter]],
    tp: TensorParallel | None,
) -> None:
    """Refuse DTensor parameters the engine cannot train yet ([Note: tensor
    parallelism]); local, before any collective."""
    distributed = [(n, p) for n, p in named if collectives.is_dtensor(p)]
    if not distributed:
        if tp is not None:
            raise ConfigError(
                "the mesh has a 'tp' dimension but no parameter is a DTensor: apply "
                "torch's parallelize_module(model, mesh['tp'], plan) before building the "
                "Engine, or drop 'tp' from the mesh"
            )
        return
    shown = ", ".join(n for n, _ in distributed[:3])
    if tp is None:
        raise ConfigError(
            f"{len(distributed)} parameter(s) ({shown}) are DTensors, sharded by tensor "
            "parallelism (parallelize_module), but the engine has no 'tp' mesh dimension; "
            "pass the mesh you parallelized over, e.g. mesh=init_device_mesh(..., "
            "mesh_dim_names=('dp_shard', 'tp')) after parallelize_module(model, "
            "mesh['tp'], plan)"
        )
    meta = [n for n, p in distributed if p.is_meta]
    if meta:
        raise ConfigError(
            f"parameter {meta[0]} is a DTensor on the meta device; tensor-parallel models "
            "must be built with real weights before the Engine (materialise the model, "
            "e.g. model.to_empty(device=...) and initialise it, then parallelize_module)"
        )
    for name, p in distributed:
        if p.device_mesh != tp.mesh:
            raise ConfigError(
                f"parameter {name} is a DTensor on mesh {p.device_mesh} "
                f"(dimensions {p.device_mesh.mesh_dim_names}), not on the engine's "
                f"mesh['tp'] {tp.mesh}; parallelize the model with "
                "parallelize_module(model, mesh['tp'], plan) using the mesh passed as mesh="
            )
        placements = collectives.dtensor_placements(p)
        if len(placements) != 1 or placements[0] not in SUPPORTED_PLACEMENTS:
            raise ConfigError(
                f"parameter {name} has placement(s) {placements} on mesh['tp']; the engine "
                f"supports {SUPPORTED_PLACEMENTS} (ColwiseParallel / RowwiseParallel of a "
                "Linear or Embedding); parallelize that module with one of those styles "
                "or leave it out of the plan"
            )


def check_optimizer(names: list[str], tp: TensorParallel | None) -> None:
    """Refuse an optimizer that needs whole matrices (``names``, from
    :func:`zerostate.optim.whole_matrix_names`) with tensor parallelism: it would see only
    the local tp shard of each matrix. Local, before any collective."""
    if tp is not None and names:
        raise ConfigError(
            f"optimizer {', '.join(names)} needs whole matrices, and with tensor "
            "parallelism each rank holds only its tp shard of them (not supported yet); "
            "use an elementwise optimizer such as AdamW or SGD with a 'tp' mesh"
        )


def sum_of_squares(
    grads: list[torch.Tensor], params: list[Any], tp: TensorParallel, total: Any
) -> torch.Tensor:
    """This rank's share of the squared global norm: every element of a ``tp``-sharded
    parameter's local gradient, and a ``tp``-replicated one's on ``tp`` rank 0 only (so
    the sum over ``tp`` counts it once). ``total`` is the engine's sum-of-squares."""
    sharded = [g for g, p in zip(grads, params, strict=True) if _tp_sharded(p)]
    replicated = [g for g, p in zip(grads, params, strict=True) if not _tp_sharded(p)]
    squares = total(sharded)
    if tp.rank == 0:
        squares = squares + total(replicated).to(squares.device)
    return squares


def _tp_sharded(sp: Any) -> bool:
    return isinstance(sp.param, LocalParam) and sp.param.sharded


def all_reduce(folded: torch.Tensor, tp: TensorParallel) -> None:
    """Sum the norm-and-flags vector over ``tp`` too: one verdict on the whole mesh."""
    collectives.all_reduce(folded, group=tp.group, stats=tp.stats)


def refuse(what: str) -> ConfigError:
    return ConfigError(
        f"{what} with tensor parallelism (a 'tp' mesh dimension) is not supported yet: "
        "checkpoints hold each parameter under its global name, and this engine holds "
        "tp shards of it. Use engine.full_state_dict() (global tensors under the model's "
        "names; torch.save it on rank 0) and load weights into the model before "
        "parallelize_module"
    )
