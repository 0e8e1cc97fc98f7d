"""``meshkit.cost`` moved to :mod:`meshkit.exchange.cost` in 0.2; this shim warns, and goes in 0.3.
"""

import warnings

from meshkit.exchange import cost as _cost
from meshkit.exchange.cost import *  # noqa: F403  (the old path re-exports it all)

__all__ = _cost.__all__

warnings.warn("meshkit.cost moved to meshkit.exchange.cost; the old path goes in meshkit 0.3",
              DeprecationWarning, stacklevel=2)
