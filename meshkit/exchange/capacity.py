"""Expert capacity: the one home of ``C = min(ceil(capacity_factor × N·k / E), N)``.

Every exchange that pads to a capacity, the planner and the memory estimate use
:func:`capacity`. Plain Python, so the planner can use it without JAX; the slot assignment
that fills these capacities is :mod:`meshkit.exchange.slots`.

Examples:
    >>> capacity(num_tokens=8, num_experts=4, top_k=2, capacity_factor=1.25)
    5
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["capacity", "dedup_nodes_per_token"]


def capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor × num_tokens × top_k / num_experts)``, at
    most ``num_tokens``.

    The product is taken exactly on the decimal value of ``capacity_factor`` (so 1.1 × 10
    / 11 is 1, not the 2 that float rounding would give). A token's ``k`` experts are
    distinct, so one expert gets each token at most once: ``num_tokens`` slots are the
    worst case whatever the routing, and no capacity is larger (slots past it could never
    be filled, only sent). ``capacity_factor = 0`` means dropless: that worst case.

    Args:
        num_tokens: tokens routed together (in :class:`MoE`, one device's tokens).
        num_experts: number of experts ``E``.
        top_k: experts per token.
        capacity_factor: slack over a perfectly balanced load, > 0; or 0 for dropless.

    Returns:
        The capacity ``C`` (>= 1 for positive inputs).

    Raises:
        ValueError: a non-positive size, or a negative ``capacity_factor``.

    Examples:
        >>> capacity(8, num_experts=4, top_k=2, capacity_factor=1.25)
        5
        >>> capacity(8, num_experts=4, top_k=2, capacity_factor=0)
        8
        >>> capacity(8, num_experts=2, top_k=2, capacity_factor=1.25)  # not 10
        8
        >>> capacity(8, num_experts=4, top_k=2, capacity_factor=1e300)  # dropless's
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
    return min(math.ceil(exact), num_tokens)


def dedup_nodes_per_token(
    num_tokens: int, *, num_experts: int, nodes: int, top_k: int, max_nodes: int | None,
    capacity_factor: float,
) -> float:
    """The deduplicated exchange's distinct nodes per token, as its buffers carry them.

    :mod:`meshkit.exchange.cost` prices the deduplicated exchange as the flat buffer's
    bytes across nodes times ``nodes_per_token / k``. What the deduplicated exchange
    sends to a node is its node capacity (:class:`meshkit.exchange.dedup.DedupDispatcher`:
    ``capacity`` of the tokens over the ``N`` nodes at ``kn = min(k, max_nodes, N)``),
    so this is ``k`` times those rows over the flat buffer's rows for the same node:
    ``kn`` while neither capacity is capped, less once a node's rows reach the tokens
    (each token crosses to a node at most once). Dropless (``capacity_factor = 0``):
    ``kn``, the bound.

    Args:
        num_tokens: tokens routed together on one device.
        num_experts: experts ``E``.
        nodes: nodes ``N`` of the exchange.
        top_k: experts per token ``k``.
        max_nodes: at most this many nodes per token (node-limited routing), or ``None``.
        capacity_factor: as :func:`capacity`.

    Returns:
        ``nodes_per_token`` for :func:`meshkit.exchange.cost.predict`, in ``[1, k]``.

    Raises:
        ValueError: as :func:`capacity`.

    Examples:
        >>> dedup_nodes_per_token(256, num_experts=16, nodes=2, top_k=4, max_nodes=None,
        ...                       capacity_factor=1.25)  # 256 rows a node, not 320
        1.6
        >>> dedup_nodes_per_token(256, num_experts=16, nodes=2, top_k=4, max_nodes=1,
        ...                       capacity_factor=1.25)
        1.0
    """
    bound = min(top_k, max_nodes or nodes, nodes)
    if capacity_factor == 0:
        return float(bound)
    node_rows = capacity(num_tokens, num_experts=nodes, top_k=bound,
                         capacity_factor=capacity_factor)
    flat_rows = capacity(num_tokens, num_experts=num_experts, top_k=top_k,
                         capacity_factor=capacity_factor) * num_experts / nodes
    return min(float(bound), max(1.0, top_k * node_rows / flat_rows))
