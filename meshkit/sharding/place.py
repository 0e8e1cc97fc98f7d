"""Place any NNX model on a mesh by the logical names its parameters carry.

A parameter declares what its dimensions *are* through ``out_sharding`` metadata, the
way ``nnx.with_partitioning`` (or ``nnx.Linear(kernel_metadata=...)``) sets it:
``("embed", "mlp")``. :class:`meshkit.sharding.rules.ShardingRules` says where each name
goes on the mesh. These functions join the two for a whole model:

* :func:`partition_specs`: the ``PartitionSpec`` of every variable;
* :func:`logical_shardings`: the ``NamedSharding`` s, for ``jax.jit``'s
  ``out_shardings`` so each device creates only its share of a new model;
* :func:`shard_model`: move an existing model's variables onto the mesh, in place.

Names that are not logical names are taken as mesh axes, as Flax's own logical rules
take them, so meshkit's models (whose metadata already names mesh axes) go through the
same functions. A variable without metadata is replicated.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.errors import UsageError
from meshkit.sharding.rules import ShardingRules, entry_axes

__all__ = ["ShardingError", "logical_shardings", "partition_specs", "shard_model"]

M = TypeVar("M", bound=nnx.Module)


class ShardingError(ValueError):
    """A parameter's sharding metadata that the rules or the mesh cannot place: a name
    neither logical nor a mesh axis, a mesh axis on two dimensions, a dimension the mesh
    does not divide, or as many names as dimensions missing. The message names the
    parameter's path."""


def _path(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def partition_specs(tree: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                    rules: ShardingRules | None = None) -> Any:
    """The ``PartitionSpec`` of every variable of a model or state, over ``mesh``'s axes.

    Args:
        tree: an NNX module (concrete or from ``nnx.eval_shape``) or its ``nnx.State``.
        mesh: the mesh (concrete or abstract) whose axis names the specs use.
        rules: the logical names' mesh axes (``None``: the metadata names mesh axes
            only, as meshkit's own models write it).

    Returns:
        ``nnx.state(tree)`` (or ``tree``) with each variable's value replaced by its
        spec.

    Raises:
        ShardingError: a name neither logical nor a mesh axis, a mesh axis on two
            dimensions, or a dimension the mesh axes do not divide; each names the
            parameter's path (a ``ValueError``).
        UsageError: a logical name of ``rules`` that maps to no axis of ``mesh``
            (:meth:`ShardingRules.check_logical`).

    Examples:
        >>> mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))
        >>> with nnx.use_eager_sharding(False):  # logical names: placed later, not at creation
        ...     layer = nnx.eval_shape(lambda: nnx.Linear(
        ...         8, 16, kernel_metadata={"out_sharding": ("embed", "mlp")}, rngs=nnx.Rngs(0)))
        >>> specs = partition_specs(layer, mesh, ShardingRules(tensor="tp").extend(mlp="tensor"))
        >>> specs["kernel"].get_value(), specs["bias"].get_value()
        (P(None, 'tp'), P())
    """
    if rules is not None:
        rules.check_logical(mesh.axis_names)  # once, not for each parameter
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))

    def spec_of(path: tuple[Any, ...], variable: Any) -> Any:
        if not _is_variable(variable):
            return P()
        names = variable.get_metadata().get("out_sharding")
        if not names:
            return variable.replace(P())
        where = _path(path)
        shape = getattr(variable, "shape", ())
        if len(names) != len(shape):
            raise ShardingError(f"parameter {where!r}: sharding {tuple(names)} has "
                             f"{len(names)} entries for a shape {tuple(shape)}")
        try:
            spec = (_mesh_axes_only(names, mesh.axis_names) if rules is None
                    else rules.mesh_spec(names, mesh.axis_names))
        except ValueError as e:
            raise ShardingError(f"parameter {where!r}: {e}") from None
        for dim, (size, entry) in enumerate(zip(shape, spec, strict=True)):
            axes = entry_axes(entry)
            ways = math.prod(sizes[a] for a in axes)
            if size % ways:
                raise ShardingError(
                    f"parameter {where!r}: dimension {dim} ({names[dim]!r}) of size {size} "
                    f"is not divisible by the {ways} devices of mesh axes {tuple(axes)}"
                )
        return variable.replace(spec)

    return jax.tree_util.tree_map_with_path(spec_of, state, is_leaf=_is_variable)


def _mesh_axes_only(names: Any, mesh_axes: tuple[str, ...]) -> P:
    for entry in names:
        for name in (entry,) if entry is None or isinstance(entry, str) else entry:
            if name is not None and name not in mesh_axes:
                raise ValueError(f"{name!r} is not a mesh axis {list(mesh_axes)}; for "
                                 "logical names pass the ShardingRules that map them")
    return P(*names)


def logical_shardings(tree: Any, mesh: jax.sharding.Mesh,
                      rules: ShardingRules | None = None) -> Any:
    """The ``NamedSharding`` of every variable, for ``jax.jit``'s ``out_shardings``.

    Args:
        tree: an NNX module (an abstract one from ``nnx.eval_shape`` costs nothing) or
            its state.
        mesh: the concrete mesh.
        rules: as in :func:`partition_specs`.

    Returns:
        ``nnx.state(tree)`` with each variable's value replaced by its sharding.

    Raises:
        ShardingError: as :func:`partition_specs`.

    Example::

        make = lambda: MyModel(rngs=nnx.Rngs(0))
        shardings = logical_shardings(nnx.eval_shape(make), mesh, rules)
        state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
        model = nnx.merge(nnx.graphdef(nnx.eval_shape(make)), state)  # created sharded
    """
    specs = partition_specs(tree, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def shard_model(model: M, mesh: jax.sharding.Mesh, rules: ShardingRules | None = None) -> M:
    """Place every variable of ``model`` on ``mesh`` by its logical names, in place.

    For a model built without a mesh (or on one device): one whose parameters carry
    sharding names is built under ``with nnx.use_eager_sharding(False):``, else Flax
    refuses to create them outside a mesh. Building it inside ``jax.jit``
    with :func:`logical_shardings` as ``out_shardings`` instead never holds the whole
    model on one device.

    Args:
        model: an NNX module whose parameters carry ``out_sharding`` metadata
            (logical names or mesh axes).
        mesh: the concrete mesh.
        rules: as in :func:`partition_specs`.

    Returns:
        ``model``, its variables now ``jax.Array`` s sharded over ``mesh``.

    Raises:
        ShardingError: as :func:`partition_specs`.
        UsageError: ``model`` is not an ``nnx.Module`` (a dict or a state has no
            variables to place in place: :func:`logical_shardings` gives their
            shardings for ``jax.device_put``), or a logical name that maps to no mesh
            axis (:meth:`ShardingRules.check_logical`).

    Examples:
        >>> mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> with nnx.use_eager_sharding(False):
        ...     layer = nnx.Linear(8, 16, kernel_metadata={"out_sharding": ("embed", "mlp")},
        ...                        rngs=nnx.Rngs(0))
        >>> rules = ShardingRules(tensor="tp").extend(mlp="tensor")
        >>> shard_model(layer, mesh, rules).kernel[...].addressable_shards[0].data.shape
        (8, 2)
    """
    if not isinstance(model, nnx.Module):
        raise UsageError(
            f"shard_model: expected an nnx.Module, got {type(model).__name__}; for a state "
            "or another pytree, jax.device_put(tree, logical_shardings(tree, mesh, rules))")
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, logical_shardings(state, mesh, rules)))
    return model
