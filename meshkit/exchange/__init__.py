"""Layer 2, exchange: moving tokens to experts and back, and what each way costs.

- :mod:`~meshkit.exchange.dispatch`: the ``dispatch``/``combine`` interface every MoE
  exchange implements, and the flat and two-stage capacity dispatchers.
- :mod:`~meshkit.exchange.two_stage`: flat and two-stage all-to-all inside ``jax.shard_map``.
- :mod:`~meshkit.exchange.dedup`: each token crosses to a node once.
- :mod:`~meshkit.exchange.ragged`: dropless, only the real rows.
- :mod:`~meshkit.exchange.capacity`, :mod:`~meshkit.exchange.slots`: expert capacity and
  each assignment's slot.
- :mod:`~meshkit.exchange.cost`: the latency–bandwidth model that picks the plan.
"""
