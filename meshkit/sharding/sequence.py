"""Megatron sequence parallelism, per device: the tokens between blocks split over the
tensor axes.

Without it every tensor rank holds the whole ``[b, T, d]`` residual stream, and the
norms and residual adds run ``t`` times over. With it (``parallel.sequence_parallel``)
tensor rank ``r`` holds positions ``[r·T/t, (r+1)·T/t)`` of every sequence: a
column-parallel block starts with :func:`gather` (all-gather over the tensor axes) and a
row-parallel block ends with :func:`scatter` (reduce-scatter) where it would all-reduce.
An all-reduce is a reduce-scatter and an all-gather, so the bytes moved are the same;
what is kept for the backward pass between blocks is ``1/t`` of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = ["gather", "reduce", "scatter"]


def gather(x: jax.Array, tensor: Sequence[str], *, split: bool, axis: int = 1) -> jax.Array:
    """The whole sequence from each tensor rank's part (inside ``jax.shard_map``).

    Args:
        x: this rank's ``[b, T/t, ...]`` (``axis`` the sequence).
        tensor: the tensor axes.
        split: whether the sequence is split (``parallel.sequence_parallel``); if not,
            ``x`` is returned as it is.
        axis: the sequence dimension (any token dimension for a block that treats
            tokens alike, as an MLP does).

    Returns:
        ``[b, T, ...]``, the same on every tensor rank.

    Examples:
        >>> import jax.numpy as jnp
        >>> gather(jnp.ones((2, 3, 4)), (), split=True).shape
        (2, 3, 4)
    """
    if not (split and tensor):
        return x
    return jax.lax.all_gather(x, tuple(tensor), axis=axis, tiled=True)


def scatter(y: jax.Array, tensor: Sequence[str], *, axis: int = 1) -> jax.Array:
    """Sum the tensor ranks' partial ``y`` and keep this rank's part of the sequence.

    Args:
        y: ``[b, T, ...]`` partial sums, one per tensor rank.
        tensor: the tensor axes.
        axis: the sequence dimension.

    Returns:
        ``[b, T/t, ...]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> scatter(jnp.ones((2, 3, 4)), ()).shape
        (2, 3, 4)
    """
    if not tensor:
        return y
    return jax.lax.psum_scatter(y, tuple(tensor), scatter_dimension=axis, tiled=True)


def reduce(y: jax.Array, tensor: Sequence[str], *, split: bool, axis: int = 1) -> jax.Array:
    """The end of a row-parallel block: :func:`scatter` under sequence parallelism, an
    all-reduce over the tensor axes otherwise.

    Args:
        y: partial sums, one per tensor rank.
        tensor: the tensor axes (none: ``y`` is whole already).
        split: whether the sequence is split.
        axis: the sequence dimension.

    Returns:
        The sums: this rank's part of the sequence when ``split``, else all of it.

    Examples:
        >>> import jax.numpy as jnp
        >>> reduce(jnp.ones((2, 3)), (), split=False).shape
        (2, 3)
    """
    if not tensor:
        return y
    if split:
        return scatter(y, tensor, axis=axis)
    return jax.lax.psum(y, tuple(tensor))
