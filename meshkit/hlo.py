"""``meshkit.hlo``, kept as an entry point: the code is :mod:`meshkit.strategy.hlo`."""

from meshkit.strategy import hlo as _strategy_hlo
from meshkit.strategy.hlo import *  # noqa: F403  (the entry point re-exports it all)

__all__ = _strategy_hlo.__all__
