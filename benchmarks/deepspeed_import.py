"""``import deepspeed`` the way every DeepSpeed contender and the forked ranks' zygote do.

A module of its own: the zygote of forked ranks (:mod:`benchmarks.forked`) preloads DeepSpeed
through it, and :mod:`benchmarks.common` starts forked ranks through the zygote, so in
``common`` it would tie the two modules into an import cycle.
"""

from __future__ import annotations

from typing import Any


def import_deepspeed() -> Any:
    """``import deepspeed`` for a contender, without DeepSpeed's CPU shared-memory
    all-reduce op: DeepSpeed compiles it with a C++ compiler the first time a process group
    starts in an environment (about 2 minutes on a 2-core machine) and uses it only for
    ``inference_all_reduce``. Training steps, ZeRO's collectives and checkpoints go through
    torch.distributed either way, so no row measures anything it would have used (on a GPU
    the op is not built at all)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed
