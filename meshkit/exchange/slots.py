"""Slot assignment: each (token, expert) assignment's place in its expert's capacity buffer.

Examples:
    >>> import jax.numpy as jnp
    >>> slot, keep = dispatch_plan(jnp.array([[0], [1], [0]]), 2, 1)
    >>> keep[:, 0].tolist()
    [True, True, False]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dispatch_plan"]


def dispatch_plan(
    expert_index: jax.Array, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """Each assignment's position in its expert's buffer, and whether it fits.

    Assignments are ordered choice-major — all first choices (in token order), then all
    second choices — so a token's second choice never displaces another token's first.
    A stable sort by expert keeps that order inside each expert; an assignment's slot is
    its rank within its expert's run. Cost: one sort of ``N·k`` keys, no ``[N, E]`` mask.

    Args:
        expert_index: ``[N, k]`` int expert ids in ``[0, num_experts)``.
        num_experts: ``E``.
        capacity: slots per expert ``C``.

    Returns:
        ``(slot [N, k] int32, keep [N, k] bool)``: ``slot`` is the position within the
        expert counting every earlier assignment (it may be ``>= C``); ``keep`` is
        ``slot < C``. The number of dropped assignments is ``(~keep).sum()``.

    Raises:
        ValueError: ``expert_index`` not 2-d, or ``capacity`` negative.

    Examples:
        >>> slot, keep = dispatch_plan(jnp.array([[0], [0], [1], [0]]), 2, 2)
        >>> slot[:, 0].tolist(), keep[:, 0].tolist()
        ([0, 1, 0, 2], [True, True, True, False])
    """
    if expert_index.ndim != 2:
        raise ValueError(f"expert_index must be [tokens, k], got shape {expert_index.shape}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    n, k = expert_index.shape
    flat = expert_index.T.reshape(-1)  # choice-major: position j*N + n
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n * k, dtype=jnp.int32) - starts[flat[order]].astype(jnp.int32)
    slot = jnp.zeros(n * k, jnp.int32).at[order].set(rank_sorted)
    slot = slot.reshape(k, n).T
    return slot, slot < capacity


def _cumsum_plan(expert_index: jax.Array, num_experts: int) -> jax.Array:
    """GShard-style slots: cumulative count over a choice-major one-hot ``[N·k, E]``."""
    n, k = expert_index.shape
    onehot = jax.nn.one_hot(expert_index.T.reshape(-1), num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    return position.reshape(k, n).T
