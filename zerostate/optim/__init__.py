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
Optimizers that need whole matrices get their own class (:mod:`zerostate.optim.muon`); anything
else is refused, because running it on shards would silently compute a different update.

[Note: uniform stepping]
torch skips a parameter whose ``.grad`` is None. The engine decides per parameter, the
same way on every rank, whether it is stepped (it received a gradient on some rank), and
then every rank steps it, including ranks that own zero elements of it (an empty shard
with an empty gradient). So every rank holds the same state keys for every parameter,
and checkpoint metadata written by any rank describes all of them.

The package: ``supported`` (the classes and their state), ``sharded`` (one rank's optimizer
state, its step and loads), ``linked`` (the user's optimizer kept live), ``muon`` (Muon on
whole matrices), ``precision`` (fp16 loss scaling).
"""

from zerostate.optim.linked import is_linked, link_user_optimizers
from zerostate.optim.sharded import (
    OptimizerLoad,
    ShardedOptimizer,
    legacy_adamw_metadata,
    sum_of_squares,
)
from zerostate.optim.supported import (
    CombinedOptimizer,
    describe,
    resolve_user_optimizers,
    supported_names,
    whole_matrix_names,
)

__all__ = [
    "CombinedOptimizer",
    "OptimizerLoad",
    "ShardedOptimizer",
    "describe",
    "is_linked",
    "legacy_adamw_metadata",
    "link_user_optimizers",
    "resolve_user_optimizers",
    "sum_of_squares",
    "supported_names",
    "whole_matrix_names",
]
