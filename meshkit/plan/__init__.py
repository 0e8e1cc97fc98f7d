"""Layer 6, plan: choose a layout before any hardware runs (numpy only, except calibrate).

- :mod:`~meshkit.plan.planner`: enumerate layouts, predict a step, rank them.
- :mod:`~meshkit.plan.memory`: per-device and host memory of a config.
- :mod:`~meshkit.plan.flops`: model FLOPs of one training token.
- :mod:`~meshkit.plan.calibrate`: measure this machine's FLOP/s and links.
"""
