"""``meshkit.hlo``: kept as an entry point; the code lives in :mod:`meshkit.strategy.hlo`."""

from meshkit.strategy.hlo import Collective, collectives, groups_as_ranks

__all__ = ["Collective", "collectives", "groups_as_ranks"]
