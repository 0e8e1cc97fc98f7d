"""Layer 4, sharding: how each axis's role shards parameters, activations and state.

- :mod:`~meshkit.sharding.rules`: :class:`~meshkit.sharding.rules.ShardingRules`, roles → specs.
- :mod:`~meshkit.sharding.params`: parameters that carry their specs, FSDP gathers.
"""
