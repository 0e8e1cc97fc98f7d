"""The planner's charge for context attention: one layer's K/V traffic beyond the
attention's own FLOPs, and the bytes it holds, per device and microbatch (plain Python).

The time is the config's cost model (:func:`meshkit.config.context_method.predict`, the
one ``parallel.context_method: auto`` chooses with) less the attention's compute that
model counts: the planner charges that compute with the rest of the model's FLOPs (its
``compute`` term), so this is the communication a method adds, a ring's credited with
the overlap the cost model gives it (each step's sends hidden behind its block's
attention where they are shorter).

The bytes (:func:`context_bytes`) are what a method holds at once beside the layer's own
activations, with ``kv`` the bytes of the device's own keys and values and ``q`` those
of its queries: ``all_gather`` the whole sequence's K/V of one layer, and its gradient
before the reduce-scatter (``2·c·kv``); ``ring`` at most two K/V blocks in flight, and two
of their gradients in the backward pass (``4·kv``); ``ulysses`` the all-to-all's outputs,
the whole sequence for its share of the heads (``2q + kv``); ``hierarchical`` both.

Examples:
    >>> from meshkit.exchange.cost import Link
    >>> slow = Link(4e-6, 50e9)
    >>> shape = dict(seq_len=131072, batch=1, heads=16, kv_heads=1, head_dim=128,
    ...              dtype_bytes=2, sizes=(16,), links=(slow,))
    >>> exposed = context_seconds("ring", flops_per_s=4e14, **shape)
    >>> 0 <= exposed < context_seconds("ring", flops_per_s=None, **shape)
    True
"""

from __future__ import annotations

import functools

from meshkit.config.context_method import predict
from meshkit.exchange import cost

__all__ = ["context_bytes", "context_seconds"]

# The backward's attention FLOPs over the forward's, as the cost model counts them.
_BACKWARD_FLOPS = 2.5


@functools.lru_cache(maxsize=65536)
def context_seconds(method: str, *, seq_len: int, batch: int, heads: int, kv_heads: int,
                    head_dim: int, dtype_bytes: int, sizes: tuple[int, ...],
                    links: tuple[cost.Link, ...], flops_per_s: float | None) -> float:
    """Seconds one attention layer's forward and backward spend on ``method``'s
    communication, per device, beyond the attention's FLOPs.

    Args:
        method: ``all_gather``, ``ring``, ``ulysses`` or ``hierarchical``.
        seq_len: tokens per sequence (the whole sequence, not the device's share).
        batch: sequences in the microbatch.
        heads, kv_heads: query and key/value heads a tensor rank holds.
        head_dim: features per head.
        dtype_bytes: bytes of one value at the compute dtype.
        sizes: the context axes' sizes, outer first (two for ``hierarchical``).
        links: the link each axis's groups use.
        flops_per_s: the device's FLOP/s (``None``: no overlap credited).

    Returns:
        Seconds (cached: the planner asks for the same few shapes many times).

    Raises:
        ValueError: as :func:`meshkit.config.context_method.predict`.
    """
    total = predict(method, seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim, dtype_bytes=dtype_bytes, context_sizes=sizes,
                    links=links, flops_per_s=flops_per_s)
    if not flops_per_s:
        return total
    c = 1
    for size in sizes:
        c *= size
    # The causal attention's forward FLOPs on this device, as the cost model counts them.
    forward = 2 * batch * seq_len**2 * heads * head_dim / c / flops_per_s
    return max(total - (1 + _BACKWARD_FLOPS) * forward, 0.0)


def context_bytes(method: str, *, kv: float, q: float, ways: int) -> float:
    """Bytes one layer's context attention holds at once beyond the device's own
    queries, keys and values (see the module docstring).

    Args:
        method: ``none`` (no context ways), ``all_gather``, ``ring``, ``ulysses`` or
            ``hierarchical``.
        kv: bytes of the device's keys and values together.
        q: bytes of its queries.
        ways: the context ways.

    Returns:
        Bytes.

    Raises:
        ValueError: an unknown method.

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
