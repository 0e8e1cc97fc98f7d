"""Per-device building blocks for models written inside ``jax.shard_map``: parameters
with sharding metadata, the FSDP gather, and running a module per device.

meshkit's MoE, experts and transformer are written this way, and so can a user's model be:
:func:`gather_fsdp` all-gathers a local weight shard for compute (its gradient is a
reduce-scatter) and :func:`shard_call` runs a module's per-device body. A model written
in ``jax.jit`` style uses :mod:`meshkit.sharding.linear` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from meshkit.sharding.fsdp import resolve_names
from meshkit.sharding.rules import entry_axes
from meshkit.sharding.zero import attach_sinks, gradient_sinks

__all__ = ["gather_fsdp", "gather_fsdp_params", "normal", "param", "shard_call"]


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Fan-in scaled normal init (a plain normal: few ops, cheap to run eagerly).

    Args:
        rngs: the module's ``nnx.Rngs``; one key is drawn from its ``params`` stream.
        shape: the parameter's shape.
        fan_in: inputs feeding each output; the standard deviation is ``fan_in**-0.5``.

    Returns:
        A float32 array of ``shape``.

    Examples:
        >>> normal(nnx.Rngs(0), (4, 2), fan_in=4).shape
        (4, 2)
    """
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5


def param(value: jax.Array, spec: P | tuple[Any, ...]) -> nnx.Param:
    """Wrap ``value`` as an ``nnx.Param`` whose ``out_sharding`` metadata is ``spec``.

    Flax shards a Variable with ``out_sharding`` at creation, which needs a mesh; without
    one (a model built before the mesh exists) the metadata is kept and the parameter is
    sharded later (:func:`meshkit.sharding.place.shard_model`).

    Args:
        value: the initial value.
        spec: one mesh axis name, tuple of names or ``None`` per dimension of ``value``.

    Returns:
        The parameter, sharded now only if eager sharding is on and a mesh is set.

    Examples:
        >>> p = param(jnp.ones((2, 3)), (None, None))
        >>> p.shape, p.out_sharding
        ((2, 3), (None, None))
    """
    eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=spec, eager_sharding=eager)


def gather_fsdp(value: jax.Array, spec: Sequence[Any],
                fsdp_axes: Sequence[str] | None = None) -> jax.Array:
    """All-gather the dimensions of a local parameter shard that FSDP split (in shard_map).

    Autodiff turns each all-gather into a reduce-scatter of the gradient, so gradients
    come back sharded like the parameter (ZeRO-3).

    Args:
        value: this device's shard.
        spec: one entry per dimension of ``value``: mesh axes, or logical names that
            resolve through the logical rules in effect
            (``nnx.logical_axis_rules(rules.flax_rules())``; a name that is a mesh axis
            stands for itself); extra leading entries are ignored (a stacked parameter
            sliced to one layer).
        fsdp_axes: the fsdp mesh axes; other axes in ``spec`` stay split. Default: the
            axes of the logical name ``batch`` in the rules in effect (the axes that
            split both the batch and a parameter are the fsdp ones).

    Returns:
        ``value`` with every fsdp-split dimension whole again.

    Raises:
        ValueError: ``fsdp_axes`` not given and no rule for ``batch`` in effect, or a
            logical name that neither the rules in effect nor the mesh know.

    Examples:
        >>> gather_fsdp(jnp.ones((2, 3)), (None, "tp"), ("fsdp",)).shape  # nothing to do
        (2, 3)
        >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> rules = (("batch", "fsdp"), ("embed", "fsdp"))
        >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        ...     whole = jax.shard_map(lambda w: gather_fsdp(w, ("embed", None)),
        ...                           in_specs=P("fsdp"), out_specs=P("fsdp"))(jnp.ones((16, 2)))
        >>> whole.shape  # each device's (16, 2), whole again, stacked 8 times
        (128, 2)
    """
    table = dict(flax_spmd.get_logical_axis_rules())
    if fsdp_axes is None:
        if "batch" not in table:
            raise ValueError("gather_fsdp: no fsdp_axes given and no logical rule for "
                             "'batch' in effect; pass fsdp_axes or run under "
                             "nnx.logical_axis_rules(rules.flax_rules())")
        fsdp_axes = entry_axes(table["batch"])
    mesh = jax.sharding.get_abstract_mesh()
    spec = tuple(spec)[len(spec) - value.ndim :]
    if not mesh.empty and any(name in table for entry in spec
                              for name in entry_axes(entry) if name not in mesh.axis_names):
        spec = tuple(resolve_names(spec, mesh.axis_names, what="gather_fsdp"))
    for dim, entry in enumerate(spec):
        axes = tuple(a for a in entry_axes(entry) if a in fsdp_axes)
        if axes:
            value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
    return value


M = TypeVar("M", bound=nnx.Module)


def gather_fsdp_params(module: M, fsdp_axes: Sequence[str]) -> M:
    """:func:`gather_fsdp` on every ``nnx.Param`` of a module (inside shard_map).

    Each parameter is gathered by its own ``out_sharding`` metadata, so one call fits any
    module built with :func:`param` (a parameter without the metadata is left as is).

    Args:
        module: a module whose parameters are this device's shards.
        fsdp_axes: the fsdp mesh axes.

    Returns:
        A new module of the same structure whose parameters are whole on every
        fsdp-split dimension; ``module`` itself when there are no fsdp axes.

    Examples:
        >>> class Dense(nnx.Module):
        ...     def __init__(self):
        ...         self.w = param(jnp.ones((2, 3)), (None, "tp"))
        >>> gather_fsdp_params(Dense(), ("fsdp",)).w.shape  # nothing to do
        (2, 3)
    """
    if not fsdp_axes:
        return module
    graphdef, params, *rest = nnx.split(module, nnx.Param, ...)

    def gather(variable: nnx.Variable[Any]) -> nnx.Variable[Any]:
        spec = variable.get_metadata().get("out_sharding")
        if spec is None:
            return variable
        return variable.replace(gather_fsdp(variable[...], spec, fsdp_axes))

    params = jax.tree.map(gather, params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(graphdef, params, *rest)


def shard_call(
    module: nnx.Module,
    fn: Callable[..., Any],
    *args: jax.Array,
    arg_specs: Sequence[Any],
    out_specs: Any,
) -> Any:
    """Run ``fn(local_module, *local_args)`` once per device inside ``jax.shard_map``.

    The module's state enters with the partition specs of its ``out_sharding`` metadata,
    so inside ``fn`` every parameter holds this device's shard. Autodiff through the
    call gives each parameter's gradient its own sharding, reduced over the axes the
    parameter is replicated on (``check_vma``); under
    :func:`meshkit.sharding.zero.reduce_scatter_gradients` (a ZeRO-1 train step) a
    parameter's gradient is instead reduce-scattered over the data axes, to its ZeRO-1
    slice.

    Args:
        module: an NNX module whose variables carry ``out_sharding`` metadata.
        fn: the per-device body, called with the module rebuilt from local shards.
        *args: further arrays.
        arg_specs: one ``PartitionSpec`` per array in ``args``.
        out_specs: the specs of ``fn``'s outputs (a pytree prefix).

    Returns:
        ``fn``'s outputs as global arrays. Call under ``jax.set_mesh(mesh)``.

    Example::

        y = shard_call(model, lambda m, x: m.local(x), x, arg_specs=[P("dp")],
                       out_specs=P("dp"))
    """
    graphdef, state = nnx.split(module)
    specs = nnx.get_partition_spec(state)
    leaves, treedef = jax.tree.flatten(state)
    where = gradient_sinks(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
    if not where:
        def body(state: Any, *local_args: jax.Array) -> Any:
            return fn(nnx.merge(graphdef, state), *local_args)

        return jax.shard_map(body, in_specs=(specs, *arg_specs),
                             out_specs=out_specs)(state, *args)

    # ZeRO-1: the values enter with their gradients stopped, and each one's sink (its
    # ZeRO-1 slice) takes the gradient, reduce-scattered over the data axes.
    sunk = {i for i, *_ in where}
    leaves = [jax.lax.stop_gradient(x) if i in sunk else x for i, x in enumerate(leaves)]

    def sunk_body(state: Any, sinks: list[jax.Array], *local_args: jax.Array) -> Any:
        local = attach_sinks(jax.tree.leaves(state), sinks, where)
        return fn(nnx.merge(graphdef, jax.tree.unflatten(treedef, local)), *local_args)

    return jax.shard_map(sunk_body, in_specs=(specs, [w[2] for w in where], *arg_specs),
                         out_specs=out_specs)(jax.tree.unflatten(treedef, leaves),
                                              [w[1] for w in where], *args)


S = TypeVar("S")


def field_specs(cls: type[S], **specs: P) -> S:
    """The ``out_specs`` of a dataclass output: a ``cls`` holding one spec per field.

    Args:
        cls: a dataclass registered as a pytree (e.g. :class:`meshkit.model.moe.MoEStats`).
        **specs: the spec of each named field; every other field gets ``P()``.

    Returns:
        A ``cls`` whose fields are ``PartitionSpec`` values, to pass as ``out_specs``.

    Raises:
        TypeError: a name that is not a field of ``cls``.

    Examples:
        >>> from meshkit.model.moe import MoEStats
        >>> field_specs(MoEStats, expert_load=P("pp")).expert_load
        P('pp',)
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # any dataclass
    unknown = sorted(set(specs) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {unknown}")
    # Any-typed on purpose: the fields are declared as arrays, these are their specs.
    values: dict[str, Any] = {name: specs.get(name, P()) for name in names}
    return cls(**values)
