"""Activations by logical names: :func:`constrain` puts an array where the rules say.

A model names what an activation's dimensions *are* (``"batch"``, ``"sequence"``,
``"embed"``), as its parameters do, and the rules in effect map the names to mesh axes:
the same model then runs under any layout without naming a mesh axis.
"""

from __future__ import annotations

from typing import Any

import jax
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from meshkit.sharding.rules import ShardingRules, axes_entry, entry_axes

__all__ = ["constrain"]


def constrain(x: jax.Array, *names: str | None, rules: ShardingRules | None = None) -> jax.Array:
    """Shard an activation by the logical names of its dimensions (inside ``jax.jit``).

    Each name resolves through ``rules`` if given, else through the logical rules in
    effect (``nnx.logical_axis_rules(rules.flax_rules())``, which meshkit's trainer
    sets); a name that is a mesh axis stands for itself. A mesh axis an earlier
    dimension took is left out of a later one, as Flax's logical rules do: under fsdp,
    ``("batch", "sequence", "embed")`` splits the batch and keeps the width whole, where
    a weight's ``embed`` is split. Mesh axes already manual
    (inside a ``jax.shard_map``, e.g. :class:`meshkit.FSDP`'s) are left out. On a mesh
    of ``Explicit`` axes the array is resharded (``jax.sharding.reshard``); on ``Auto``
    axes it is a ``jax.lax.with_sharding_constraint``. Without a mesh, ``x`` is returned
    as it is (the model runs on one device).

    Args:
        x: the activation.
        *names: one logical name (or ``None``: replicated) per dimension of ``x``.
        rules: the rules to resolve the names with (default: those in effect).

    Returns:
        ``x``, sharded as the names say.

    Raises:
        ValueError: as many names as dimensions missing, or a name that neither the
            rules nor the mesh know (named, with the fix).

    Examples:
        >>> import jax.numpy as jnp, meshkit
        >>> rules = meshkit.ShardingRules(data="dp", tensor="tp")  # sequence: no context axes
        >>> mesh = meshkit.Strategy.from_axes({"dp": 2, "tp": 4}).mesh()
        >>> with jax.set_mesh(mesh):
        ...     y = jax.jit(lambda x: constrain(x, "batch", "sequence", "heads",
        ...                                     rules=rules))(jnp.ones((4, 2, 8)))
        >>> y.sharding.spec
        P('dp', None, 'tp')
    """
    if len(names) != x.ndim:
        raise ValueError(f"meshkit.constrain: {len(names)} names {names} for an array of "
                         f"{x.ndim} dimensions {tuple(x.shape)}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    table: dict[str, Any] = (dict(rules.flax_rules()) if rules is not None
                             else dict(flax_spmd.get_logical_axis_rules()))
    entries: list[Any] = []
    used: set[str] = set()
    for name in names:
        if name is None:
            entries.append(None)
            continue
        if name in table:
            axes = entry_axes(table[name])
        elif name in mesh.axis_names:
            axes = (name,)
        else:
            raise ValueError(
                f"meshkit.constrain: logical axis {name!r} is not in the rules "
                f"({', '.join(table) or 'none in effect'}) nor a mesh axis "
                f"{list(mesh.axis_names)}; extend the rules (rules.extend({name}=...)) and "
                "run under nnx.logical_axis_rules(rules.flax_rules())")
        kept = [a for a in axes if a not in used and types[a] != jax.sharding.AxisType.Manual]
        used.update(kept)
        entries.append(axes_entry(kept))
    spec = P(*entries)
    if any(types[a] == jax.sharding.AxisType.Explicit for e in spec for a in entry_axes(e)):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)
