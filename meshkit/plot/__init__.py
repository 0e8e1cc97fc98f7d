"""Layer 8, plot: pictures of a strategy's groups, the exchange, its cost, and a run's metrics.

Needs the ``plot`` extra (matplotlib), imported only when a picture is drawn;
:func:`exchange_stages` and :func:`node_crossings` are plain numpy.

- :mod:`~meshkit.plot.strategy`: the rank grid coloured by an axis's groups.
- :mod:`~meshkit.plot.exchange`: the two-stage exchange's stages; what crosses nodes.
- :mod:`~meshkit.plot.cost`: the cost model's flat vs two-stage prediction.
- :mod:`~meshkit.plot.metrics`: a run's loss curves and expert load.
"""

from meshkit.plot.cost import plot_cost
from meshkit.plot.exchange import (
    EXCHANGE_PLANS,
    exchange_stages,
    node_crossings,
    plot_exchange,
    plot_node_crossings,
)
from meshkit.plot.figure import output_path
from meshkit.plot.metrics import plot_metrics
from meshkit.plot.strategy import plot_strategy

__all__ = [
    "EXCHANGE_PLANS",
    "exchange_stages",
    "node_crossings",
    "output_path",
    "plot_cost",
    "plot_exchange",
    "plot_metrics",
    "plot_node_crossings",
    "plot_strategy",
]
