"""Layer 4, sharding: how each axis's role shards parameters, activations and state.

- :mod:`~meshkit.sharding.rules`: :class:`~meshkit.sharding.rules.ShardingRules`, roles → specs.
- :mod:`~meshkit.sharding.params`: parameters that carry their specs, FSDP gathers inside
  ``shard_map``.
- :mod:`~meshkit.sharding.place`: any NNX model placed on a mesh by its logical names.
- :mod:`~meshkit.sharding.zero`: ZeRO-1, the optimizer state split over the data axes.
- :mod:`~meshkit.sharding.linear`: column- and row-parallel projections and a
  vocab-parallel embedding, tensor- and FSDP-parallel, for a user's own model.
- :mod:`~meshkit.sharding.fsdp`: :class:`~meshkit.sharding.fsdp.FSDP`, ZeRO-3 around plain
  Flax layers (each weight gathered just before use, its gradient reduce-scattered).
- :mod:`~meshkit.sharding.activations`: :func:`~meshkit.sharding.activations.constrain`,
  an activation sharded by logical names.
- :mod:`~meshkit.sharding.hints`: one line with the fix for JAX's and Flax's sharding
  errors from a user's model.
"""
