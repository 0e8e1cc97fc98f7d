"""Layer 5, model: meshkit's MoE transformer, built only from the layers below.

- :mod:`~meshkit.model.router`: top-k routing, node limits, the router losses, the
  protocol of a router of one's own.
- :mod:`~meshkit.model.dispatchers`: which exchange the MoE layer runs.
- :mod:`~meshkit.model.experts`: the routed experts, NNX modules stacked on ``[E, ...]``.
- :mod:`~meshkit.model.moe`: the expert-parallel MoE layer.
- :mod:`~meshkit.model.attention`: attention kernels (materialised, jax.nn's, chunked).
- :mod:`~meshkit.model.remat`: activation checkpointing of a block, by policy name.
- :mod:`~meshkit.model.transformer`: the decoder-only language model.
- :mod:`~meshkit.model.pipeline`: the GPipe and 1F1B schedules over a pipeline axis, and
  :func:`~meshkit.model.pipeline.pipeline` for a user's own stacked layers.
"""
