"""Parameter helpers shared by :mod:`meshkit.moe` and :mod:`meshkit.model` (private).

Not part of the public API: the names here carry no leading underscore only because the
module itself is private.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["normal", "param"]


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Fan-in scaled normal init (a plain normal: few ops, cheap to run eagerly).

    Args:
        rngs: the module's ``nnx.Rngs``; one key is drawn from its ``params`` stream.
        shape: the parameter's shape.
        fan_in: inputs feeding each output; the standard deviation is ``fan_in**-0.5``.

    Returns:
        A float32 array of ``shape``.

    Example:
        >>> normal(nnx.Rngs(0), (4, 2), fan_in=4).shape
        (4, 2)
    """
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5


def param(value: jax.Array, spec: tuple[Any, ...]) -> nnx.Param:
    """Wrap ``value`` as an ``nnx.Param`` whose ``out_sharding`` metadata is ``spec``.

    Flax shards a Variable with ``out_sharding`` at creation, which needs a mesh; without
    one (a model built before the mesh exists) the metadata is kept and the parameter is
    sharded later (:func:`meshkit.moe.shard_model`).

    Args:
        value: the initial value.
        spec: one mesh axis name, tuple of names or ``None`` per dimension of ``value``.

    Returns:
        The parameter, sharded now only if eager sharding is on and a mesh is set.

    Example:
        >>> p = param(jnp.ones((2, 3)), (None, None))
        >>> p.shape, p.out_sharding
        ((2, 3), (None, None))
    """
    eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=spec, eager_sharding=eager)
