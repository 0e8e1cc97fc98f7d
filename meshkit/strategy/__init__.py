"""Layer 1, strategy: rank ids with named axes and roles → groups → ``jax.sharding.Mesh`` → HLO.

- :mod:`~meshkit.strategy.ranks`: :class:`Strategy`, the N-d array of rank ids, and its groups.
- :mod:`~meshkit.strategy.axes`: axis names, one or several (a fused axis), in one spelling.
- :mod:`~meshkit.strategy.mesh`: a strategy as a JAX mesh, with process-boundary checks.
- :mod:`~meshkit.strategy.hlo`: the collectives a compiled program runs, and over which groups.

Only :class:`Strategy` is imported here (it needs numpy, not JAX).
"""

from meshkit.strategy.ranks import Strategy

__all__ = ["Strategy"]
