"""Layer 6, plan: choose a layout before any hardware runs (numpy only, except calibrate).

- :mod:`~meshkit.plan.planner`: enumerate layouts, check them against a config's rules.
- :mod:`~meshkit.plan.model_plan`: the one step model and ranking, for any model.
- :mod:`~meshkit.plan.memory_fit`: the one memory model, fitted to XLA.
- :mod:`~meshkit.plan.config_plan`: ``meshkit plan CONFIG``, a config's model ranked.
- :mod:`~meshkit.plan.memory`: per-device and host memory of a config (the trainer's
  start-up check).
- :mod:`~meshkit.plan.flops`: model FLOPs of one training token.
- :mod:`~meshkit.plan.calibrate`: measure this machine's FLOP/s and links.
"""
