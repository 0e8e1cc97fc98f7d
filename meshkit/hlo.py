"""``meshkit.hlo`` is :func:`meshkit.collectives` since 0.2; this shim warns, and goes in 0.3.
"""

import warnings

from meshkit.strategy import hlo as _strategy_hlo
from meshkit.strategy.hlo import *  # noqa: F403  (the old path re-exports it all)

__all__ = _strategy_hlo.__all__

warnings.warn("meshkit.hlo moved: use meshkit.collectives (and meshkit.strategy.hlo for the "
              "rest); the old path goes in meshkit 0.3", DeprecationWarning, stacklevel=2)
