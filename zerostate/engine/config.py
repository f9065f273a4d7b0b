"""Engine configuration: one dataclass, validated up front.

Every check raises :class:`~zerostate.errors.ConfigError` naming the field, the value and
the fix. The engine exchanges a fingerprint of :meth:`EngineConfig.summary` across ranks at
construction, so ranks configured differently fail together instead of hanging later.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerostate.errors import ConfigError

#: Working (parameter / gradient / communication) dtype for each precision setting.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
STAGES = (0, 1, 2, 3)
#: Other spellings of a precision: long names, torch's names, and the dtypes themselves.
_PRECISION_ALIASES: dict[Any, str] = {
    **{name: name for name in PRECISIONS},
    **{dtype: name for name, dtype in PRECISIONS.items()},
    **{str(dtype): name for name, dtype in PRECISIONS.items()},  # "torch.bfloat16"
    **{str(dtype).removeprefix("torch."): name for name, dtype in PRECISIONS.items()},
    "float": "fp32",
    "half": "fp16",
}

#: Settings of other trainers (DeepSpeed config keys, FSDP and Hugging Face arguments) that
#: users pass out of habit, and the EngineConfig setting that does that job here.
SETTING_ALIASES: dict[str, str] = {
    "gradient_accumulation_steps": "grad_accum_steps",
    "grad_accumulation_steps": "grad_accum_steps",
    "accumulation_steps": "grad_accum_steps",
    "gradient_clipping": "grad_clip",
    "max_grad_norm": "grad_clip",
    "clip_grad_norm": "grad_clip",
    "learning_rate": "lr",
    "zero_stage": "stage",
    "zero_optimization": "stage",
    "mixed_precision": "precision",
    "dtype": "precision",
    "param_dtype": "precision",
    "fp16": 'precision="fp16"',
    "bf16": 'precision="bf16"',
    "reduce_bucket_size": "bucket_mb",
    "allgather_bucket_size": "bucket_mb",
    "process_group": "group",
    "device_mesh": "mesh",
    "param_init_fn": "init_fn",
    "auto_wrap_policy": "unit_policy",
    "steps_per_print": "log_every",
    "logging_steps": "log_every",
    "forward_prefetch": "prefetch",
    "seed": "init_seed",
    "offload_optimizer": 'offload="optimizer"',
    "cpu_offload": 'offload="optimizer"',
    "offload_param": 'offload="params"',
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Settings of :class:`zerostate.Engine`. Pass them as keyword arguments to ``Engine``."""

    stage: int = 2
    """ZeRO stage: 0 (data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ params)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    precision: str = "fp32"
    """Working dtype of parameters, gradients and communication: fp32, bf16 or fp16 (also
    spelled ``torch.bfloat16``, ``"bfloat16"``, ``"float32"``, ...; stored as the short
    name). Master weights and optimizer states are always fp32."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to the decay group only (see ``no_decay``)."""
    bucket_mb: float = 25.0
    """Size in MiB (of working-dtype elements) of one gradient / parameter bucket."""
    grad_clip: float | None = None
    """Clip gradients to this global L2 norm (across all partitions); None disables."""
    grad_accum_steps: int = 1
    """Micro-steps (backward calls) per optimizer step."""
    group: Any = None
    """torch.distributed process group of the data-parallel ranks; None is the default group."""
    mesh: Any = None
    """A ``torch.distributed.device_mesh.DeviceMesh`` over every rank, instead of ``group``:
    ZeRO partitions over its ``"dp_shard"`` dimension; a ``("dp_replicate", "dp_shard")``
    mesh is hybrid sharding (each replica a ZeRO group over ``dp_shard``, gradients summed
    across replicas). A 1-D ``("dp_shard",)`` mesh is the same as no mesh. With a ``"tp"``
    dimension the model's DTensor parameters (torch's ``parallelize_module`` over
    ``mesh["tp"]``) are partitioned as their local shards. See docs/api.md,
    "Device mesh"."""
    tp_plan: Any = None
    """Tensor parallelism applied by the engine: ``{module pattern: style}`` as torch's
    ``parallelize_module(model, mesh["tp"], plan)`` takes it (styles are torch
    ``ParallelStyle`` objects or the names "colwise", "rowwise", ... of transformers'
    plans), or ``"auto"`` for a transformers model's own ``config.base_model_tp_plan``.
    Needs a ``mesh`` with a ``"tp"`` dimension ([Note: tp plans] in
    zerostate.runtime.tp_plan)."""
    reduce_dtype: str | None = None
    """Dtype gradients are summed across ranks in: fp32, bf16 or fp16. None (default) is
    fp32 whatever ``precision`` is, as FSDP2's and DeepSpeed's fp32 reduction. Gradient
    shards accumulate over micro-steps in fp32 either way (see docs/engine.md,
    "Precision", for the memory this costs)."""
    min_shard_numel: int | None = None
    """Accepted for compatibility and ignored (with a warning): every parameter is split
    evenly over the ranks, so collectives carry the paper's volume at any model size."""
    no_decay: Callable[[str, nn.Parameter], bool] | None = None
    """``no_decay(name, param)`` is True for parameters without weight decay. Default:
    parameters with fewer than 2 dimensions (biases, norm weights)."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: consecutive finite steps after which the loss scale doubles."""
    min_loss_scale: float = 1.0
    """fp16 only: the loss scale never drops below this."""
    init_fn: Callable[[nn.Module], None] | None = None
    """Stage 3 with a model on the ``meta`` device: ``init_fn(module)`` initialises the
    parameters (and buffers) a module directly owns. Default: the model's own
    ``_init_weights(module)`` if it defines one (Hugging Face models do), else
    ``module.reset_parameters()``; what nothing initialises stays unset until loaded."""
    init_seed: int = 0
    """Seed of the deterministic per-module initialisation of a ``meta`` model."""
    device: str | None = None
    """Device to materialise a ``meta`` model on; default CUDA's current device if
    available, else CPU. Ignored for models that already live on a real device."""
    unit_policy: Callable[[str, nn.Module], bool] | None = None
    """Stage 3: ``unit_policy(name, module)`` is True for modules whose parameters are
    gathered together. Default: every child of the outermost ``nn.ModuleList`` or
    ``nn.ModuleDict`` containers (a transformer's blocks, kept in a list or in a dict keyed
    by layer; other parameters join the always-gathered root unit), or, in a model without
    one, every module that directly owns parameters."""
    leaf_modules: tuple | list | None = None
    """Stage 3: modules gathered whole, as one group, when they are entered: module names
    (``"heads"``), class names (``"SwitchTransformersSparseMLP"``) or classes; a list or
    dict named here is gathered with its owner (at the top, with the root). Not needed for
    modules that run on some ranks only (heads chosen per sample, experts, a block skipped
    on some ranks): they are found at run time and gathered on demand (docs/engine.md,
    "Stage 3 groups"); naming their parent here gathers them whole instead, which saves the
    per-unit exchanges at the cost of memory."""
    prefetch: bool = True
    """Stage 3: start gathering the next unit while the current one computes."""
    sync_module_states: bool = True
    """Broadcast rank 0's initial parameters and buffers to every rank at construction (as
    DDP does), so ranks that initialised differently still train one model. Ignored for a
    model on the ``meta`` device, whose stage-3 initialisation is already deterministic."""
    cast_forward_inputs: bool = True
    """Cast floating-point tensors among the forward inputs (also inside lists, tuples and
    dicts) to the working dtype of ``precision`` before the module runs, as FSDP2's
    ``MixedPrecisionPolicy(cast_forward_inputs=True)`` does: a bf16 model takes fp32
    inputs. Integer tensors (token ids, masks) are never cast. False passes inputs as
    given."""
    collective_timeout_s: float = 300.0
    """Seconds a rank waits in ``save``, ``load`` and ``full_state_dict`` for every other
    rank to enter the same call. Past it, every rank that entered raises
    :class:`~zerostate.errors.CollectiveTimeoutError` naming the call and the ranks that
    did not join (a ``save`` under ``if rank == 0:``), instead of hanging until the
    process group's timeout."""
    log_every: int | None = None
    """Log one progress line (``logging`` at INFO, logger ``zerostate.engine``) every this
    many optimizer steps: step, step time, samples/s (and tokens/s when a batch's token
    count is known), loss when given to ``step(loss=...)``, memory. None (default) logs
    nothing, as DeepSpeed's ``steps_per_print``."""
    offload: str | None = None
    """ZeRO-Offload (docs/engine.md, "Offload"): ``"optimizer"`` (stages 1-3) keeps the fp32
    masters and optimizer states in host memory and runs the optimizer step on the host;
    ``"params"`` (stage 3) keeps the parameter shards there too. None keeps everything on
    the model's device."""
    activation_checkpointing: str | None = None
    """Recompute checkpointed blocks in backward instead of keeping their activations
    (docs/engine.md, "Activation checkpointing"): ``"full"`` keeps each block's inputs, as
    ``torch.utils.checkpoint``; ``"partitioned"`` (ZeRO-R Pa) keeps each block's input as a
    1/TP slice on each rank of the mesh's ``"tp"`` dimension, all-gathered before the
    recompute (without ``"tp"`` it is ``"full"``); ``"partitioned_cpu"`` (Pa+cpu) keeps that
    slice in host memory. None (default) checkpoints nothing."""
    checkpoint_modules: Any = None
    """Which modules ``activation_checkpointing`` checkpoints: a module class, a list of
    classes, or a predicate ``fn(name, module) -> bool`` (a module inside a chosen one is
    not chosen again). None: the children of the model's largest ``nn.ModuleList`` (a
    transformer's layers)."""
    offload_threads: int | None = None
    """Host threads of the offloaded optimizer step (``torch.set_num_threads`` around the
    step); None leaves torch's setting."""
    memory_dir: str | None = None
    """This node's memory-tier directory for ``save(..., tier="memory")`` (None:
    ``$ZEROSTATE_MEMORY_DIR``, else ``/dev/shm/zerostate``); ranks sharing it are one node.
    Not compared across ranks: every node has its own."""
    memory_keep_last: int = 2
    """Memory-tier steps each node keeps (host RAM: that many of its rows and replicas)."""
    memory_durable_every: int | None = 10
    """Every that many memory-tier saves, the step is copied to the durable root in the
    background; None: never."""

    def __post_init__(self) -> None:
        if not _is_int(self.memory_keep_last) or self.memory_keep_last < 1:
            raise ConfigError(f"memory_keep_last={self.memory_keep_last!r} must be an int >= 1")
        if self.memory_durable_every is not None and (
            not _is_int(self.memory_durable_every) or self.memory_durable_every < 1
        ):
            raise ConfigError(
                f"memory_durable_every={self.memory_durable_every!r} must be an int >= 1 or None"
            )
        if self.memory_dir is not None and not isinstance(self.memory_dir, str):
            raise ConfigError(f"memory_dir={self.memory_dir!r} must be a path (str) or None")
        if not _is_int(self.stage) or self.stage not in STAGES:
            raise ConfigError(f"stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        self.precision = _precision_name("precision", self.precision, allow_none=False)
        if not _is_real(self.lr) or self.lr < 0:
            raise ConfigError(f"lr={self.lr!r} must be a finite number >= 0")
        if (
            not isinstance(self.betas, (tuple, list))
            or len(self.betas) != 2
            or not all(_is_real(b) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            raise ConfigError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not _is_real(self.eps) or self.eps <= 0:
            raise ConfigError(f"eps={self.eps!r} must be a finite number > 0")
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be a number >= 0")
        if not _is_real(self.bucket_mb) or self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb={self.bucket_mb!r} must be a number > 0 (e.g. 25)")
        if self.grad_clip is not None and (not _is_real(self.grad_clip) or self.grad_clip <= 0):
            raise ConfigError(f"grad_clip={self.grad_clip!r} must be > 0, or None to disable")
        if not _is_int(self.grad_accum_steps) or self.grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps={self.grad_accum_steps!r} must be an integer >= 1")
        self.reduce_dtype = _precision_name("reduce_dtype", self.reduce_dtype, allow_none=True)
        if not _is_real(self.collective_timeout_s) or self.collective_timeout_s <= 0:
            raise ConfigError(
                f"collective_timeout_s={self.collective_timeout_s!r} must be a number of "
                "seconds > 0 (default 300)"
            )
        if self.log_every is not None and (not _is_int(self.log_every) or self.log_every < 1):
            raise ConfigError(
                f"log_every={self.log_every!r} must be an integer >= 1 (steps between "
                "progress lines), or None for no progress log"
            )
        if self.min_shard_numel is not None:
            if not _is_int(self.min_shard_numel) or self.min_shard_numel < 1:
                raise ConfigError(
                    f"min_shard_numel={self.min_shard_numel!r} must be an integer >= 1; it "
                    "has no effect any more, so simply remove it"
                )
            warnings.warn(
                "min_shard_numel has no effect: every parameter is split evenly over the "
                "ranks; remove the setting",
                stacklevel=3,
            )
        if self.leaf_modules is not None:
            if isinstance(self.leaf_modules, (str, type)) or not all(
                isinstance(e, (str, type)) for e in self.leaf_modules
            ):
                raise ConfigError(
                    f"leaf_modules={self.leaf_modules!r} must be a list of module names, class "
                    "names or classes, e.g. leaf_modules=['heads']"
                )
            self.leaf_modules = tuple(self.leaf_modules)
        for name in ("no_decay", "init_fn", "unit_policy"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name}={value!r} must be callable or None")
        if not _is_real(self.initial_loss_scale) or self.initial_loss_scale <= 0:
            raise ConfigError(
                f"initial_loss_scale={self.initial_loss_scale!r} must be a number > 0"
            )
        if not _is_int(self.loss_scale_window) or self.loss_scale_window < 1:
            raise ConfigError(
                f"loss_scale_window={self.loss_scale_window!r} must be an integer >= 1"
            )
        if not _is_real(self.min_loss_scale) or self.min_loss_scale <= 0:
            raise ConfigError(f"min_loss_scale={self.min_loss_scale!r} must be a number > 0")
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigError(
                f"cast_forward_inputs={self.cast_forward_inputs!r} must be True or False"
            )
        if not _is_int(self.init_seed):
            raise ConfigError(f"init_seed={self.init_seed!r} must be an integer")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"device={self.device!r} is not a torch device: {exc}") from None
        if self.stage != 3 and (
            self.unit_policy is not None or self.init_fn is not None or self.leaf_modules
        ):
            warnings.warn(
                "unit_policy, leaf_modules and init_fn only affect stage 3; they are ignored at "
                f"stage {self.stage}",
                stacklevel=3,
            )

        _check_offload(self)
        _check_activation(self)
        if self.mesh is not None:
            from zerostate.runtime.process_groups import check_mesh

            check_mesh(self.mesh)
            if self.group is not None:
                raise ConfigError(
                    "Engine got both mesh= and group=; the mesh names the data-parallel "
                    "groups itself ('dp_shard', 'dp_replicate'): pass only mesh="
                )
        if self.tp_plan is not None:
            from zerostate.runtime.tp_plan import check_spec

            names = None if self.mesh is None else tuple(self.mesh.mesh_dim_names or ())
            check_spec(self.tp_plan, names)

    @property
    def working_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return PRECISIONS[self.reduce_dtype or "fp32"]

    def summary(self) -> dict:
        """JSON-able settings that must agree across ranks (no callables, no group)."""
        return {
            "stage": self.stage,
            "lr": self.lr,
            "precision": self.precision,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "bucket_mb": self.bucket_mb,
            "grad_clip": self.grad_clip,
            "grad_accum_steps": self.grad_accum_steps,
            "reduce_dtype": self.reduce_dtype or "fp32",
            "initial_loss_scale": self.initial_loss_scale,
            "loss_scale_window": self.loss_scale_window,
            "min_loss_scale": self.min_loss_scale,
            "prefetch": self.prefetch,
            "leaf_modules": [
                e if isinstance(e, str) else e.__qualname__ for e in self.leaf_modules or ()
            ],  # fmt: skip
            "sync_module_states": self.sync_module_states,
            "cast_forward_inputs": self.cast_forward_inputs,
            "activation_checkpointing": self.activation_checkpointing,
        }


OFFLOAD_STAGES = {"optimizer": (1, 2, 3), "params": (3,)}


def _check_offload(config: EngineConfig) -> None:
    if config.offload is not None:
        stages = OFFLOAD_STAGES.get(config.offload)
        if stages is None:
            raise ConfigError(
                f"offload={config.offload!r} is not an offload mode; use 'optimizer' (stages "
                "1-3: masters and optimizer states on the host), 'params' (stage 3: "
                "parameter shards too) or None"
            )
        if config.stage not in stages:
            shown = "1, 2 or 3" if len(stages) > 1 else "3"
            raise ConfigError(
                f"offload={config.offload!r} needs stage {shown} (stage={config.stage}): "
                + (
                    "stage 0 keeps a full optimizer state per rank; use stage=1 or higher"
                    if config.offload == "optimizer"
                    else "only stage 3 partitions the parameters; use offload='optimizer' "
                    "at stages 1-2"
                )
            )
    threads = config.offload_threads
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise ConfigError(f"offload_threads={threads!r} must be an integer >= 1, or None")
    if threads is not None and config.offload is None:
        warnings.warn("offload_threads has no effect without offload; remove it", stacklevel=4)


def _check_activation(config: EngineConfig) -> None:
    from zerostate.runtime.activation import MODES, check_which

    mode = config.activation_checkpointing
    if mode is not None and mode not in MODES:
        raise ConfigError(
            f"activation_checkpointing={mode!r} is not a mode; use 'full' (recompute blocks, "
            "keep their inputs), 'partitioned' (keep a 1/TP slice of each input), "
            "'partitioned_cpu' (that slice in host memory) or None"
        )
    check_which(config.checkpoint_modules)
    if config.checkpoint_modules is not None and mode is None:
        warnings.warn(
            "checkpoint_modules has no effect without activation_checkpointing; set "
            "activation_checkpointing='full' (or 'partitioned') or remove it",
            stacklevel=4,
        )


def _precision_name(field: str, value: Any, *, allow_none: bool) -> str | None:
    """``fp32`` / ``bf16`` / ``fp16`` from any accepted spelling (``torch.bfloat16``,
    ``"bfloat16"``, ``"float32"``, ``"torch.float16"``)."""
    if value is None and allow_none:
        return None
    key = value.lower().strip() if isinstance(value, str) else value
    try:
        name = _PRECISION_ALIASES.get(key)
    except TypeError:  # unhashable
        name = None
    if name is None:
        extra = ", or None for fp32" if allow_none else ""
        raise ConfigError(
            f"{field}={value!r} is unknown; use one of {sorted(PRECISIONS)} (or torch.float32, "
            f"torch.bfloat16, torch.float16, 'bfloat16', ...){extra}"
        )
    return name


def field_names() -> list[str]:
    """Every EngineConfig field, in declaration order."""
    return list(EngineConfig.__dataclass_fields__)


def unknown_setting(name: str, known: list[str] | None = None) -> ConfigError:
    """The error for a keyword ``Engine`` does not take, with the closest setting (a typo)
    or the one that does the job of another trainer's setting (``gradient_accumulation_steps``)."""
    known = field_names() if known is None else known
    alias = SETTING_ALIASES.get(name)
    if alias is not None and alias.split("=")[0] in known:
        hint = f"did you mean {alias if '=' in alias else alias + '='}?"
    else:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = (
            f"did you mean {close[0]}=?"
            if close
            else "see zerostate.EngineConfig (docs/api.md) for every setting"
        )
    return ConfigError(f"Engine got an unknown setting {name}=; {hint}")


def check_setting_names(kwargs: dict[str, Any]) -> None:
    """Raise :func:`unknown_setting` for the first keyword that is no EngineConfig field."""
    known = field_names()
    for name in kwargs:
        if name not in known:
            raise unknown_setting(name, known)


def field_docs() -> dict[str, tuple[str, str, str]]:
    """``{field: (type, default, docstring)}`` of every EngineConfig field, read from the
    source (the docstring under each field), for the API reference (docs/api.md)."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    out = {}
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        out[f.name] = (str(f.type), repr(default), docs.get(f.name, ""))
    return out
