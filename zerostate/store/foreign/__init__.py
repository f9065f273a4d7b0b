"""Readers of the checkpoints other trainers write: DeepSpeed ZeRO (``deepspeed``) and
torch.distributed.checkpoint (``dcp``). Each presents a peer's checkpoint through the same
step-reader protocol as zerostate's own formats (``zerostate.store.protocol``), under
zerostate's tensor names (``model/<param>``, ``optim/<state>/<param>``, ``buffers/<name>``),
so ``inspect``, ``verify``, ``consolidate``, ``reshard`` and ``engine.load`` read them as
they read ours. Nothing is unpickled except through ``zerostate.store.safe_unpickle``.
"""
