"""Where each element of a tensor lives: pure math, no ``torch.distributed``.

``partition`` splits each parameter's flat storage evenly over the ranks (sizes, padding,
shard ranges, bucket layout, range intersection for resharding); ``mesh_layout`` describes
a tensor laid out over a device mesh (tensor-parallel shards, fused sub-tensors, the
data-parallel flat range) as :class:`~zerostate.layout.mesh_layout.MeshLayout`;
``planner`` plans the reads that turn one layout into another.
"""
