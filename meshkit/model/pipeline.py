"""GPipe schedule over a pipeline mesh axis, inside ``jax.shard_map``.

Stage ``s`` of ``S`` holds consecutive layers; the local batch is cut into ``M``
microbatches. At tick ``i`` (``0 ≤ i < M + S − 1``) stage ``s`` works on microbatch
``i − s``: stage 0 takes it from the input, every other stage from what its predecessor
sent at the previous tick through ``jax.lax.ppermute`` along the pipeline axis (the pairs
``(s, s + 1)``, a subset of :meth:`meshkit.strategy.ranks.Strategy.neighbors`). In SPMD every
stage computes at every tick; the ``S − 1`` ticks outside ``[s, s + M)`` are the bubble,
and whatever a stage computes there is masked out. The backward pass is autodiff: the
transposed permutes carry gradients back from stage ``s + 1`` to ``s``.

The loop is unrolled (``M + S − 1`` copies of a stage in the program), which keeps each
tick's values free to differ in how they vary over mesh axes; compile time grows with
``M``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["bubble_fraction", "gpipe"]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The GPipe bubble: the share of ticks a stage idles, ``(S − 1)/(M + S − 1)``.

    Args:
        stages: pipeline stages ``S`` (>= 1).
        microbatches: microbatches per step ``M`` (>= 1).

    Returns:
        The fraction, 0 for one stage.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.

    Example:
        >>> bubble_fraction(2, 4)
        0.2
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def gpipe(
    stage: Callable[[jax.Array], tuple[jax.Array, Any]],
    microbatches: jax.Array,
    axis: str | None,
) -> tuple[jax.Array, Any]:
    """Run ``stage`` over microbatches in a GPipe schedule (call inside shard_map).

    Args:
        stage: this device's stage: ``activations -> (activations, stats)``, the same
            shape in and out; ``stats`` is a pytree of arrays to be summed over
            microbatches.
        microbatches: ``[M, ...]`` inputs of the first stage (other stages ignore them).
        axis: the pipeline mesh axis, or ``None`` for one stage.

    Returns:
        ``(outputs [M, ...], stats)``: the last stage's outputs per microbatch (other
        stages hold intermediate values), and this stage's ``stats`` summed over the
        microbatches it really processed (bubble ticks contribute 0).

    Example::

        # inside jax.shard_map over a mesh with a "pp" axis of 2:
        out, stats = gpipe(lambda h: (h * 2, {}), x.reshape(4, -1, d), "pp")
    """
    m = microbatches.shape[0]
    if axis is None:
        index, stages = jnp.int32(0), 1
    else:
        index, stages = jax.lax.axis_index(axis), jax.lax.axis_size(axis)
    pairs = [(s, s + 1) for s in range(stages - 1)]
    received = jnp.zeros_like(microbatches[0])
    outputs: list[jax.Array] = []
    total: Any = None
    for tick in range(m + stages - 1):
        inp = jnp.where(index == 0, microbatches[min(tick, m - 1)], received)
        out, stats = stage(inp)
        valid = (tick - index >= 0) & (tick - index < m)
        stats = jax.tree.map(lambda v, valid=valid: jnp.where(valid, v, jnp.zeros_like(v)),
                             stats)
        total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        if tick >= stages - 1:
            outputs.append(out)
        if pairs:
            received = jax.lax.ppermute(out, axis, pairs)
    return jnp.stack(outputs), total
