"""Activation checkpointing (remat) of a block, by name, for meshkit's layers and a user's.

A policy decides which of a block's intermediate values the forward pass keeps for the
backward pass; whatever it does not keep, the backward pass recomputes from the block's
input (:func:`jax.checkpoint`):

* ``none``: keep everything (no recomputation; a layer may still recompute elementwise
  work of its own, as :func:`meshkit.model.experts.gated_ffn` does its gate);
* ``full``: keep nothing but the block's input, recompute the whole block;
* ``save_dots``: keep the matmul outputs (``jax.checkpoint_policies.dots_saveable``)
  and recompute the cheap elementwise work between them.

``regather`` adds FSDP's rule to any policy: a weight all-gathered for the block (and
its cast to the compute dtype) is never kept; the backward pass gathers it again. Without
it, every layer's full-size gathered weights stay live from the forward to the backward
pass, and FSDP saves no temp memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx

from meshkit.choices import REMAT_POLICIES

__all__ = ["remat", "remat_policy"]

F = TypeVar("F", bound=Callable[..., Any])

# What a weight goes through between its local shard and the matmul: the barrier that ties
# it to the layer's input (meshkit.model.transformer) and the mark that it varies over the
# input's mesh axes (both copies of the shard if kept), the FSDP gather and the cast to the
# compute dtype. Recomputing them is one collective and an elementwise op.
_REGATHERED = frozenset({"optimization_barrier", "pvary", "all_gather", "convert_element_type"})


def _not_regathered(prim: Any, *_: Any, **__: Any) -> bool:
    return prim.name not in _REGATHERED


def remat_policy(policy: str, *, regather: bool = False) -> Callable[..., bool] | None:
    """The :func:`jax.checkpoint` policy of a remat name, or ``None`` for no checkpoint.

    Args:
        policy: one of :data:`meshkit.choices.REMAT_POLICIES`.
        regather: never keep all-gathered weights (FSDP), under any policy.

    Returns:
        A policy callable, or ``None`` where the block runs unchanged (``none`` without
        ``regather``).

    Raises:
        ValueError: an unknown policy.

    Examples:
        >>> remat_policy("none") is None, remat_policy("full") is not None
        (True, True)
    """
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat: unknown policy {policy!r}; valid: {', '.join(REMAT_POLICIES)}")
    if policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if policy == "save_dots":
        # An all-gather or a cast is not a dot: dots_saveable already regathers.
        return jax.checkpoint_policies.dots_saveable
    return _not_regathered if regather else None


def remat(fn: F, policy: str = "full", *, regather: bool = False) -> F:
    """``fn`` with activation checkpointing by a policy named in the config.

    Works on plain functions of arrays and on functions that take NNX modules (a
    layer of :func:`meshkit.pipeline`'s ``apply``): it is :func:`flax.nnx.remat` with the
    policy of :func:`remat_policy`.

    Args:
        fn: the block, e.g. ``(layer, h) -> h``.
        policy: one of :data:`meshkit.choices.REMAT_POLICIES`.
        regather: never keep all-gathered weights (inside a model written per device with
            :func:`meshkit.gather_fsdp`).

    Returns:
        A function with ``fn``'s signature and results; ``fn`` itself for ``none``
        without ``regather``.

    Raises:
        ValueError: an unknown policy.

    Example::

        apply = meshkit.remat(lambda layer, h: layer(h), "full")
        h = meshkit.pipeline(model.blocks, x, microbatches=4, apply=apply)
    """
    checkpoint_policy = remat_policy(policy, regather=regather)
    if checkpoint_policy is None:
        return fn
    wrapped: F = nnx.remat(fn, policy=checkpoint_policy)
    return wrapped
