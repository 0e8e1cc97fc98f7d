"""Expert capacity: the one home of ``C = ceil(capacity_factor × N·k / E)``.

Every exchange that pads to a capacity, the planner and the memory estimate use
:func:`capacity`. Plain Python, so the planner can use it without JAX; the slot assignment
that fills these capacities is :mod:`meshkit.exchange.slots`.

Example:
    >>> capacity(num_tokens=8, num_experts=4, top_k=2, capacity_factor=1.25)
    5
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["capacity"]


def capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor × num_tokens × top_k / num_experts)``.

    The product is taken exactly on the decimal value of ``capacity_factor`` (so 1.1 × 10
    / 11 is 1, not the 2 that float rounding would give). ``capacity_factor = 0`` means
    dropless: ``num_tokens`` slots, the worst case (a token's ``k`` experts are
    distinct, so one expert gets each token at most once), whatever the routing.

    Args:
        num_tokens: tokens routed together (in :class:`MoE`, one device's tokens).
        num_experts: number of experts ``E``.
        top_k: experts per token.
        capacity_factor: slack over a perfectly balanced load, > 0; or 0 for dropless.

    Returns:
        The capacity ``C`` (>= 1 for positive inputs).

    Raises:
        ValueError: a non-positive size, or a negative ``capacity_factor``.

    Example:
        >>> capacity(8, num_experts=4, top_k=2, capacity_factor=1.25)
        5
        >>> capacity(8, num_experts=4, top_k=2, capacity_factor=0)
        8
    """
    for name, value in (
        ("num_tokens", num_tokens),
        ("num_experts", num_experts),
        ("top_k", top_k),
    ):
        if not value > 0:
            raise ValueError(f"capacity: {name} must be positive, got {value!r}")
    if not capacity_factor >= 0:
        raise ValueError(f"capacity: capacity_factor must be >= 0, got {capacity_factor!r}")
    if capacity_factor == 0:
        return num_tokens
    exact = Fraction(str(capacity_factor)) * num_tokens * top_k / num_experts
    return math.ceil(exact)
