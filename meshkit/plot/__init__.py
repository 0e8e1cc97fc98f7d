"""Layer 8, plot: pictures of a strategy's groups, the exchange, its cost, and a run's metrics.

Needs the ``plot`` extra (matplotlib), imported only when a picture is drawn.
"""
