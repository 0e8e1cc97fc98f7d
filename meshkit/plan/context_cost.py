"""The planner's cost of context attention: time and bytes of one layer's K/V traffic
under each context method, for one microbatch on one device (plain Python).

The planner charges the four methods of ``parallel.context_method`` as meshkit's context
attention runs them (:mod:`meshkit.model.context`), per layer, forward and backward,
with ``c`` context ways placed on a link (``inter`` as soon as the group spans two
nodes; latency ``α``, bandwidth ``β`` per device), ``kv`` the bytes of the device's own
keys and values and ``q`` those of its queries (as many as its attention outputs)::

    all_gather   = 2·(c−1)·(α + kv/β)           K/V all-gathered, dK/dV reduce-scattered
    ring         = (c−1)·(2α + 3·kv/β)          K/V round the ring; backward K/V and dK/dV
    ulysses      = 4·(c−1)·α + 2·(c−1)/c·(2q + kv)/β     q,k,v → heads and o back; and
                                                          their transposes
    hierarchical = ulysses over the inner ways + ring over the outer ones

After Ulysses' all-to-all over the inner ways a device holds ``c_inner`` times the
tokens of ``1/c_inner`` of the heads: the ring's blocks are ``kv`` bytes still.

What each method holds at once beside the layer's own activations (``context_bytes``):
``all_gather`` the whole sequence's K/V of one layer, and its gradient before the
reduce-scatter (``2·c·kv``); ``ring`` at most two K/V blocks in flight, and two of
their gradients in the backward pass (``4·kv``); ``ulysses`` the all-to-all's outputs,
the whole sequence for its share of the heads (``2q + kv``).

Overlap: none, as in the rest of the step model: a ring's sends overlap the block's
attention on a GPU, so the ring is overcharged against ``all_gather`` there.

This module is the planner's own copy of the formulas; the config's ``auto`` chooses
with :mod:`meshkit.config.context_method` (``predict``), which the planner can call in
its place once both count the same terms.

Examples:
    >>> from meshkit.exchange.cost import preset
    >>> t = preset("h100-8x400g", 2)
    >>> ring = context_time("ring", kv=2**20, q=2**22, group=(16, 2), inner=(1, 1), topology=t)
    >>> gather = context_time("all_gather", kv=2**20, q=2**22, group=(16, 2), inner=(1, 1),
    ...                       topology=t)
    >>> gather < ring
    True
"""

from __future__ import annotations

from meshkit.exchange import cost

__all__ = ["context_bytes", "context_time"]


def _link(group: tuple[int, int], t: cost.Topology) -> cost.Link:
    return t.inter if group[1] > 1 else t.intra


def _ring(c: int, kv: float, link: cost.Link) -> float:
    return (c - 1) * (2 * link.latency_s + 3 * kv / link.bandwidth_Bps) if c > 1 else 0.0


def _ulysses(c: int, kv: float, q: float, link: cost.Link) -> float:
    if c == 1:
        return 0.0
    return 4 * (c - 1) * link.latency_s + 2 * (c - 1) / c * (2 * q + kv) / link.bandwidth_Bps


def context_time(method: str, *, kv: float, q: float, group: tuple[int, int],
                 inner: tuple[int, int], topology: cost.Topology) -> float:
    """Seconds of one layer's context communication, forward and backward, for one
    microbatch on one device (the module docstring's formulas).

    Args:
        method: ``none``, ``all_gather``, ``ring``, ``ulysses`` or ``hierarchical``.
        kv: bytes of the device's keys and values (its tokens, its kv heads).
        q: bytes of its queries (its tokens, its query heads).
        group: ``(size, nodes)`` of the whole context group as placed.
        inner: ``(size, nodes)`` of ``hierarchical``'s Ulysses ways (else unread); the
            ring runs over ``size / inner size`` ways across nodes.
        topology: the links.

    Returns:
        Seconds.

    Raises:
        ValueError: an unknown method.
    """
    c = group[0]
    if method == "none" or c == 1:
        return 0.0
    link = _link(group, topology)
    if method == "all_gather":
        return 2 * (c - 1) * (link.latency_s + kv / link.bandwidth_Bps)
    if method == "ring":
        return _ring(c, kv, link)
    if method == "ulysses":
        return _ulysses(c, kv, q, link)
    if method == "hierarchical":
        ci = inner[0]
        return (_ulysses(ci, kv, q, _link(inner, topology))
                + _ring(c // ci, kv, _link((c // ci, group[1]), topology)))
    raise ValueError(f"context_method: unknown method {method!r}")


def context_bytes(method: str, *, kv: float, q: float, ways: int, inner: int = 1) -> float:
    """Bytes one layer's context attention holds at once beyond the device's own
    queries, keys and values (see the module docstring).

    Args:
        method: as :func:`context_time`.
        kv, q: as :func:`context_time`.
        ways: the context ways.
        inner: ``hierarchical``'s Ulysses ways.

    Returns:
        Bytes.

    Examples:
        >>> context_bytes("all_gather", kv=10, q=40, ways=4), context_bytes("ring", kv=10,
        ...                                                                  q=40, ways=4)
        (80, 40)
    """
    if method == "none" or ways == 1:
        return 0
    if method == "all_gather":
        return 2 * ways * kv
    if method == "ring":
        return 4 * kv
    if method == "ulysses":
        return 2 * q + kv
    if method == "hierarchical":
        return 2 * q + kv + 4 * kv
    raise ValueError(f"context_method: unknown method {method!r}")
