"""FSDP (ZeRO-3) for ordinary Flax layers: gather each parameter just before use.

A model of plain ``nnx.Linear`` / ``nnx.Einsum`` / ``nnx.Embed`` layers whose weights
name an fsdp-sharded logical dimension (``"embed"`` under ``ShardingRules(fsdp=...)``)
trains under ``jax.jit`` with whatever collectives XLA picks for it: all-reduces and
all-to-alls, and no reduce-scatter. :class:`FSDP` makes the textbook pattern explicit:
wrap a layer (a decoder block, the embedding, the head) and its call runs per device
inside ``jax.shard_map`` over the batch axes, its parameters all-gathered on entry.
Autodiff turns each all-gather into a reduce-scatter of the gradient, so every sharded
weight's gradient leaves the layer already sharded like the weight.

The fsdp axes are the mesh axes that split both the batch (the logical name ``batch``)
and a parameter: the same rule :mod:`meshkit.sharding.linear` applies. Names resolve
through the logical rules in effect (``nnx.logical_axis_rules(rules.flax_rules())``,
which meshkit's trainer sets); other mesh axes (tensor, pipeline) stay automatic inside
the call.

Example::

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = meshkit.FSDP(nnx.Embed(64, 32, rngs=rngs, embedding_metadata=
                                                {"out_sharding": ("vocab", "embed")}))
            self.blocks = nnx.List([meshkit.FSDP(Block(rngs)) for _ in range(2)])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from meshkit.sharding.hints import explain
from meshkit.sharding.rules import axes_entry, entry_axes

__all__ = ["FSDP", "fsdp_axes", "resolve_names"]


def _rules_table() -> dict[str, Any]:
    return dict(flax_spmd.get_logical_axis_rules())


def resolve_names(names: Sequence[Any], mesh_axes: Sequence[str], *,
                  what: str) -> P:
    """The ``PartitionSpec`` of logical names under the logical rules in effect.

    A name that is a mesh axis stands for itself (meshkit's models write mesh axes in
    their metadata); any other name goes through ``nnx.logical_axis_rules``. Unlike
    :func:`meshkit.sharding.linear.logical_spec`, manual axes are kept: this is for
    code inside ``jax.shard_map``.

    Args:
        names: one entry per dimension: ``None``, a name, or a tuple of names.
        mesh_axes: the mesh's axis names.
        what: the caller, for the error.

    Returns:
        The spec over mesh axes.

    Raises:
        ValueError: a name that is neither a mesh axis nor in the rules in effect.

    Examples:
        >>> with nnx.logical_axis_rules((("embed", "fsdp"),)):
        ...     resolve_names(("embed", None, "tp"), ("fsdp", "tp"), what="example")
        P('fsdp', None, 'tp')
    """
    table = _rules_table()
    entries = []
    for entry in names:
        axes: list[str] = []
        for name in (entry,) if entry is None or isinstance(entry, str) else entry:
            if name is None:
                continue
            if name in mesh_axes:
                axes.append(name)
            elif name in table:
                axes.extend(entry_axes(table[name]))
            else:
                raise ValueError(
                    f"{what}: logical axis {name!r} is not in the logical rules in effect "
                    f"({', '.join(table) or 'none'}) nor a mesh axis {list(mesh_axes)}; run "
                    "under nnx.logical_axis_rules(rules.flax_rules()) with the rules "
                    f"extended: rules.extend({name}=...)")
        entries.append(axes_entry(axes))
    return P(*entries)


def fsdp_axes(mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
    """The batch axes of the logical rules in effect that are not yet manual, in order.

    Args:
        mesh: the current (abstract) mesh.

    Returns:
        The axes; ``()`` without rules for ``batch``.

    Examples:
        >>> mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
        >>> with nnx.logical_axis_rules((("batch", "fsdp"),)):
        ...     fsdp_axes(mesh)
        ('fsdp',)
    """
    manual = jax.sharding.AxisType.Manual
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual}
    batch = entry_axes(_rules_table().get("batch"))
    return tuple(a for a in batch if a in free)


def _param_specs(params: nnx.State, mesh_axes: Sequence[str], keep: Sequence[str]) -> Any:
    """Each parameter's spec restricted to the axes in ``keep`` (the manual ones), as
    ``params`` with each variable's value replaced by its spec."""

    def spec(path: tuple[Any, ...], variable: Any) -> Any:
        names = variable.get_metadata().get("out_sharding")
        if not names:
            return variable.replace(P())
        if len(names) == jax.numpy.ndim(variable.get_value()) + 1 and names[0] == "layers":
            # One layer of a stack sliced by the pipeline's loop, which keeps the
            # stack's names (nnx.scan would drop the stacked one).
            names = names[1:]
        where = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        full = resolve_names(names, mesh_axes, what=f"meshkit.FSDP: parameter {where!r}")
        return variable.replace(
            P(*(axes_entry([a for a in entry_axes(e) if a in keep]) for e in full)))

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=_is_variable)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _gather(value: jax.Array, spec: P) -> jax.Array:
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        if axes:
            value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
    return value


class FSDP(nnx.Module):
    """Run a layer with its fsdp-sharded parameters gathered just before use (ZeRO-3).

    Under a mesh and logical rules whose ``batch`` axes also shard some of the layer's
    parameters, the call runs per device inside ``jax.shard_map`` over those batch
    axes: each parameter enters as its local shard, is all-gathered, and its gradient
    comes back reduce-scattered. Without a mesh, or when no parameter is split over a
    batch axis, the layer is called as it is.

    Every array argument and output has the batch as its leading dimension; a 0-d
    array or a non-array argument is passed as it is. The wrapped layer must not update
    its own state while called (no batch-norm statistics, no caches).

    Args:
        module: the layer; its parameters name their dimensions in ``out_sharding``
            metadata (logical names or mesh axes).

    Raises:
        ValueError: at call time, a parameter's logical name that neither the rules
            in effect nor the mesh know (named with the parameter's path).

    Examples:
        >>> import jax.numpy as jnp
        >>> layer = FSDP(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        >>> layer(jnp.ones((3, 4))).shape  # no mesh: the plain layer
        (3, 2)
    """

    def __init__(self, module: nnx.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return self.module(*args, **kwargs)
        batch = fsdp_axes(mesh)
        graphdef, params, *rest = nnx.split(self.module, nnx.Param, ...)
        specs = _param_specs(params, mesh.axis_names, batch)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        if not any(entry_axes(e) for s in spec_leaves for e in s):
            return self.module(*args, **kwargs)
        # Every batch axis goes manual, not only the fsdp ones: the activations enter
        # split as they are, so nothing is resharded at the boundary.
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.ndim]
        row = P(axes_entry(batch))

        def body(params: nnx.State, *local: jax.Array) -> Any:
            values, state_def = jax.tree.flatten(params)
            gathered = jax.tree.unflatten(
                state_def, [_gather(v, s) for v, s in zip(values, spec_leaves, strict=True)])
            full = list(leaves)
            for i, x in zip(arrays, local, strict=True):
                full[i] = x
            a, k = jax.tree.unflatten(treedef, full)
            return nnx.merge(graphdef, gathered, *rest)(*a, **k)

        try:
            return jax.shard_map(body, in_specs=(specs, *[row] * len(arrays)), out_specs=row,
                                 axis_names=set(batch))(params, *[leaves[i] for i in arrays])
        except ValueError as e:
            hint = explain(e)  # the model's own mesh-axis specs: the fix, in one line
            if hint is None:
                raise
            raise ValueError(f"meshkit.FSDP({type(self.module).__name__}): {hint}") from e
