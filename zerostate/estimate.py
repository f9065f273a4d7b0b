"""Per-rank model-state memory for ZeRO stages 0-3 (Rajbhandari et al., section 5).

Pure arithmetic, no torch. With mixed-precision Adam every parameter costs 2 bytes of
fp16/bf16 weights, 2 bytes of gradient and K bytes of optimizer state (fp32 master
weights, exp_avg and exp_avg_sq: K = 12). Stage s partitions progressively more of
those across the N data-parallel ranks:

=====  =========================  ==========================
stage  partitioned                bytes per rank
=====  =========================  ==========================
0      nothing                    (2 + 2 + K) * Psi
1      optimizer states           4 * Psi + K * Psi / N
2      + gradients                2 * Psi + (2 + K) * Psi / N
3      + parameters               (2 + 2 + K) * Psi / N
=====  =========================  ==========================

The paper's worked example (Psi = 7.5B, N = 64, K = 12) gives 120 GB, 31.4 GB, 16.6 GB
and 1.9 GB, with GB = 1e9 bytes. Activations, temporary buffers and fragmentation are not
model states and are not counted.

With offload ([Note: offload] in zerostate.runtime.offload) the same bytes are split into
two tiers. ``offload="optimizer"`` (stages 1-3): the K * Psi / N of optimizer state lives
on the host, plus the host staging buffer of the step's fp32 gradient shards, 4 * Psi / N;
the device keeps the working parameters and the stage's gradients. ``offload="params"``
(stage 3): the 16-bit parameter shards, 2 * Psi / N, are on the host too. So stage 2 with
optimizer offload holds 2 * Psi + 2 * Psi / N on each device and (K + 4) * Psi / N on
its host.

Inside a device mesh (``--tp``, ``--dp-replicate``): tensor parallelism splits each
parameter it shards over the ``tp`` ranks, so a rank's ZeRO works on Psi / TP parameters
(plus, whole, the ones the plan leaves replicated over tp: embeddings or norms outside the
plan, ``tp_replicated``), partitioned over ``dp_shard = dp / dp_replicate`` ranks; replicas
hold the same partitions as each other, so ``dp_replicate`` divides nothing ([Note: hybrid
sharding] in zerostate.runtime.process_groups). ``dp`` is every data-parallel rank (``dp_replicate x
dp_shard``); the world is ``dp x tp``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from zerostate.errors import ConfigError

#: Bytes of optimizer state per parameter for mixed-precision Adam (fp32 master + 2 moments).
DEFAULT_K = 12

#: Host bytes per owned parameter of the fp32 gradient shards an offloaded step stages.
HOST_GRAD_BYTES = 4

#: Stages each offload mode applies to (as EngineConfig checks them).
OFFLOAD_STAGES = {"optimizer": (1, 2, 3), "params": (3,)}

STAGES = (0, 1, 2, 3)

STAGE_PARTITIONED = {
    0: "nothing",
    1: "optimizer states",
    2: "optimizer states + gradients",
    3: "optimizer states + gradients + parameters",
}

_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.I)


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """Model-state bytes one rank holds at one ZeRO stage."""

    stage: int
    partitioned: str
    params_bytes: float
    grads_bytes: float
    optim_bytes: float
    offload: str | None = None
    """``None``, ``"optimizer"`` or ``"params"``: which states live on the host."""
    host_grads_bytes: float = 0.0
    """With offload: the host staging buffer of the step's fp32 gradient shards."""

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optim_bytes + self.host_grads_bytes

    @property
    def host_bytes(self) -> float:
        if self.offload is None:
            return 0.0
        host = self.optim_bytes + self.host_grads_bytes
        return host + (self.params_bytes if self.offload == "params" else 0.0)

    @property
    def device_bytes(self) -> float:
        return self.total_bytes - self.host_bytes

    def to_json(self) -> dict:
        total = self.total_bytes
        return {
            "stage": self.stage,
            "partitioned": self.partitioned,
            "params_bytes": round(self.params_bytes),
            "grads_bytes": round(self.grads_bytes),
            "optim_bytes": round(self.optim_bytes),
            "total_bytes": round(total),
            "total_gb": total / 1e9,
            "total_gib": total / 2**30,
            "offload": self.offload,
            "host_grads_bytes": round(self.host_grads_bytes),
            "device_bytes": round(self.device_bytes),
            "host_bytes": round(self.host_bytes),
        }


def parse_count(text: str | int | float) -> int:
    """Parse a parameter count: ``7500000000``, ``7.5e9``, ``7.5B``, ``350M``, ``1.2k``."""
    if isinstance(text, bool):
        raise ConfigError(f"parameter count must be a number, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _COUNT_RE.match(text)
        if match is None:
            raise ConfigError(
                f"cannot read parameter count {text!r}: write it like 7.5e9, 7.5B, 350M or 125K"
            )
        value = float(match.group(1).replace("_", "")) * _COUNT_SUFFIXES[match.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"parameter count must be positive, got {text!r}")
    return round(value)


def estimate_stage(
    params: int, dp: int, stage: int, k: float = DEFAULT_K, *, offload: str | None = None
) -> StageEstimate:
    """Bytes of model states per rank for ``params`` parameters over ``dp`` ranks, split
    into device and host tiers by ``offload`` (see the module docstring)."""
    _check(params, dp, k)
    if stage not in STAGES:
        raise ConfigError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    _check_offload(stage, offload)
    # Stage s partitions optimizer states from 1 on, gradients from 2 on, parameters at 3.
    optim = k * params / (dp if stage >= 1 else 1)
    grads = 2 * params / (dp if stage >= 2 else 1)
    weights = 2 * params / (dp if stage >= 3 else 1)
    staging = HOST_GRAD_BYTES * params / dp if offload is not None else 0.0
    return StageEstimate(stage, STAGE_PARTITIONED[stage], weights, grads, optim, offload, staging)


def offload_stages(offload: str | None) -> tuple[int, ...]:
    """The stages ``offload`` applies to (every stage without offload)."""
    if offload is None:
        return STAGES
    if offload not in OFFLOAD_STAGES:
        raise ConfigError(
            f"offload={offload!r} is not an offload mode; use 'optimizer', 'params' or None"
        )
    return OFFLOAD_STAGES[offload]


@dataclass(frozen=True, slots=True)
class MeshShape:
    """What one rank's ZeRO partitions in a (dp_replicate, dp_shard, tp) mesh."""

    params_per_tp_rank: int
    """Parameters one tp rank holds: the tp-sharded ones / TP, plus the replicated ones."""
    dp_shard: int
    """Ranks ZeRO partitions over: dp / dp_replicate."""


def mesh_shape(params: int, dp: int, *, tp: int = 1, dp_replicate: int = 1,
               tp_replicated: int = 0) -> MeshShape:  # fmt: skip
    """``params`` over a mesh of ``dp`` data-parallel ranks (``dp_replicate`` replicas of
    ``dp / dp_replicate`` shards) and ``tp`` tensor-parallel ranks, ``tp_replicated`` of
    the parameters left whole on every tp rank (see the module docstring)."""
    _check(params, dp, 0)
    for name, value in (("tp", tp), ("dp_replicate", dp_replicate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if dp % dp_replicate:
        raise ConfigError(
            f"dp={dp} data-parallel ranks cannot form dp_replicate={dp_replicate} equal "
            "replicas; dp counts every data-parallel rank (dp_replicate x dp_shard), so "
            "make it a multiple of dp_replicate"
        )
    rep = tp_replicated
    if not isinstance(rep, int) or isinstance(rep, bool) or not 0 <= rep <= params:
        raise ConfigError(
            f"tp_replicated={rep!r} must be a parameter count between 0 and params={params}"
        )
    return MeshShape(math.ceil((params - rep) / tp) + rep, dp // dp_replicate)


def estimate(
    params: int,
    dp: int,
    *,
    stages: tuple[int, ...] | None = None,
    k: float = DEFAULT_K,
    offload: str | None = None,
    tp: int = 1,
    dp_replicate: int = 1,
    tp_replicated: int = 0,
) -> list[StageEstimate]:
    """One :class:`StageEstimate` per requested stage, in order (by default every stage
    ``offload`` applies to). ``tp``, ``dp_replicate`` and ``tp_replicated``: the device
    mesh (:func:`mesh_shape`); ``dp`` is every data-parallel rank."""
    stages = offload_stages(offload) if stages is None else stages
    shape = mesh_shape(params, dp, tp=tp, dp_replicate=dp_replicate, tp_replicated=tp_replicated)
    return [
        estimate_stage(shape.params_per_tp_rank, shape.dp_shard, s, k, offload=offload)
        for s in stages
    ]


def _check_offload(stage: int, offload: str | None) -> None:
    if stage not in offload_stages(offload):
        shown = ", ".join(str(s) for s in OFFLOAD_STAGES[offload])
        raise ConfigError(
            f"offload={offload!r} applies to stage {shown}, not stage {stage}"
            + (" (only stage 3 partitions the parameters)" if offload == "params" else "")
        )


def format_bytes(num_bytes: float) -> str:
    """Binary units (KiB, MiB, GiB, TiB), as memory is sized and reported by tools."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _check(params: int, dp: int, k: float) -> None:
    if not isinstance(params, int) or isinstance(params, bool) or params < 1:
        raise ConfigError(f"params must be a positive integer, got {params!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp (data-parallel ranks) must be a positive integer, got {dp!r}")
    if not math.isfinite(k) or k < 0:
        raise ConfigError(f"k (optimizer bytes per parameter) must be >= 0, got {k!r}")
