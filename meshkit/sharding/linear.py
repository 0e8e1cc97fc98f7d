"""Tensor- and FSDP-parallel building blocks for a user's own NNX model.

Megatron's two projections, for any model written in ordinary ``jax.jit`` style:

* :class:`ColumnParallelLinear`: ``x [..., d] → [..., *out]``, the output features split
  over the tensor axes; the input is whole on every tensor rank;
* :class:`RowParallelLinear`: ``x [..., *in] → [..., d]``, the input features split over
  the tensor axes; each rank's partial product is all-reduced (one all-reduce per block
  in the forward pass, as in Megatron);
* :class:`ParallelEmbed`: a vocab-parallel lookup (local rows, one all-reduce).

Each runs its matmul per device inside ``jax.shard_map`` over the mesh axes that are
not already manual, so the program has exactly the collectives above and no resharding
the partitioner invents (a fused QKV projection declares its output as ``(3, heads,
head_dim)`` and the heads split cleanly). Parameters carry logical names
(:mod:`meshkit.sharding.place`); a dimension whose mesh axes also split the batch (the
fsdp role's, e.g. ``embed``) is all-gathered for the matmul, and autodiff turns that
gather into a reduce-scatter of the gradient (ZeRO-3).

The names resolve through the logical rules in effect when the model runs:
``with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):``
(:meth:`meshkit.sharding.rules.ShardingRules.flax_rules`); the batch is the leading
dimension of every input, split over the axes of the logical name ``batch``. Without a
mesh, the blocks are plain dense layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from meshkit.sharding.rules import axes_entry, entry_axes

__all__ = ["ColumnParallelLinear", "ParallelEmbed", "RowParallelLinear", "logical_spec"]

Names = tuple[str | None, ...]
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def _mesh() -> jax.sharding.AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _free_axes(mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
    """The mesh axes not yet manual (inside a pipeline's shard_map, the pipeline axis is)."""
    manual = jax.sharding.AxisType.Manual
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual)


def logical_spec(names: Sequence[str | None], *, what: str = "logical_spec") -> P:
    """The ``PartitionSpec`` of logical names under the current mesh and logical rules.

    Names resolve through ``flax.nnx.logical_axis_rules`` (meshkit's
    :meth:`~meshkit.sharding.rules.ShardingRules.flax_rules`); a name with no rule that
    is a mesh axis stands for itself. Axes already manual (inside a ``shard_map``) are
    left out.

    Args:
        names: one logical name (or ``None``) per dimension.
        what: the caller, for errors.

    Returns:
        The spec over the current mesh's free axes.

    Raises:
        ValueError: no mesh set, or a name that neither the rules nor the mesh know.

    Examples:
        >>> from meshkit.sharding.rules import ShardingRules
        >>> rules = ShardingRules(data="dp", tensor="tp").extend(mlp="tensor")
        >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        ...     logical_spec(("batch", None, "mlp"))
        P('dp', None, 'tp')
    """
    mesh = _mesh()
    if mesh is None:
        raise ValueError(f"{what} must run under `with jax.set_mesh(mesh):`")
    table = dict(flax_spmd.get_logical_axis_rules())
    free = _free_axes(mesh)
    entries: list[Any] = []
    for name in names:
        if name is None:
            entries.append(None)
            continue
        if name in table:
            target = table[name]
            axes = () if target is None else (target,) if isinstance(target, str) else target
        elif name in mesh.axis_names:
            axes = (name,)
        else:
            raise ValueError(
                f"{what}: logical axis {name!r} is not in the logical rules in effect "
                f"({', '.join(table) or 'none'}) nor a mesh axis {list(mesh.axis_names)}; "
                "run under nnx.logical_axis_rules(rules.flax_rules())"
            )
        entries.append(axes_entry([a for a in axes if a in free]))
    return P(*entries)


def _without(spec: P, batch: tuple[str, ...]) -> P:
    """``spec`` less the batch (fsdp) axes: how the matmul sees a gathered weight."""
    return P(*(axes_entry([a for a in entry_axes(entry) if a not in batch]) for entry in spec))


def _gather(value: jax.Array, spec: P, batch: tuple[str, ...]) -> jax.Array:
    """All-gather the dimensions of a local shard that batch (fsdp) axes split."""
    for dim, entry in enumerate(spec):
        gathered = tuple(a for a in entry_axes(entry) if a in batch)
        if gathered:
            value = jax.lax.all_gather(value, gathered, axis=dim, tiled=True)
    return value


def _tuple(features: int | Sequence[int]) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


def _names(names: str | Sequence[str | None] | None, size: int, what: str) -> Names:
    out: Names = (names,) if names is None or isinstance(names, str) else tuple(names)
    if len(out) != size:
        raise ValueError(f"{what} has {len(out)} names for {size} dimensions")
    return out


class _Projection(nnx.Module):
    """``y = x · W + b`` over named feature dimensions, per device in shard_map."""

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        in_axes: str | Sequence[str | None] | None,
        out_axes: str | Sequence[str | None] | None,
        use_bias: bool,
        dtype: Any,
        kernel_init: Initializer,
        rngs: nnx.Rngs,
    ) -> None:
        self.in_shape, self.out_shape = _tuple(in_features), _tuple(out_features)
        name = type(self).__name__
        self.in_axes = _names(in_axes, len(self.in_shape), f"{name}: in_axes")
        self.out_axes = _names(out_axes, len(self.out_shape), f"{name}: out_axes")
        fan_in = math.prod(self.in_shape)
        shape = (*self.in_shape, *self.out_shape)
        # Draw as [fan_in, fan_out] so the scale is that of an ordinary dense layer.
        flat = kernel_init(rngs.params(), (fan_in, math.prod(self.out_shape)), jnp.float32)
        self.kernel = nnx.Param(flat.reshape(shape), out_sharding=(*self.in_axes, *self.out_axes),
                                eager_sharding=False)
        self.bias = (nnx.Param(jnp.zeros(self.out_shape, jnp.float32),
                               out_sharding=self.out_axes, eager_sharding=False)
                     if use_bias else None)
        self.dtype = None if dtype is None else jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the projection.

        Args:
            x: ``[batch, ..., *in_features]``.

        Returns:
            ``[batch, ..., *out_features]`` in the compute dtype (``x``'s by default).

        Raises:
            ValueError: ``x``'s trailing shape is not ``in_features``, the batch does
                not split over its devices, or a logical name is unknown.
        """
        n_in = len(self.in_shape)
        if x.shape[x.ndim - n_in:] != self.in_shape or x.ndim <= n_in:
            raise ValueError(f"{type(self).__name__}: x must be [batch, ..., "
                             f"{', '.join(map(str, self.in_shape))}], got {x.shape}")
        dtype = self.dtype or x.dtype
        kernel = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        mesh = _mesh()
        if mesh is None:
            return self._local(x, kernel, bias, dtype=dtype, reduce=(), batch=())
        what = type(self).__name__
        batch_spec = logical_spec(("batch",), what=what)
        batch = entry_axes(batch_spec[0])
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        ways = math.prod(sizes[a] for a in batch)
        if x.shape[0] % ways:
            raise ValueError(f"{what}: batch dimension {x.shape[0]} is not divisible by the "
                             f"{ways} devices of its mesh axes {batch}")
        kernel_spec = logical_spec((*self.in_axes, *self.out_axes), what=what)
        # Activations are split like the weights on their feature dimensions, less the
        # batch (fsdp) axes: those split the batch instead.
        compute_spec = _without(kernel_spec, batch)
        lead = (None,) * (x.ndim - n_in - 1)
        x_spec = P(batch_spec[0], *lead, *compute_spec[:n_in])
        y_spec = P(batch_spec[0], *lead, *compute_spec[n_in:])
        # The input features' tensor axes: each rank holds a partial sum (row parallel).
        reduce = tuple(a for entry in compute_spec[:n_in] for a in entry_axes(entry))
        bias_spec = None if bias is None else logical_spec(self.out_axes, what=what)
        if not any(entry_axes(e) for e in (*kernel_spec, *(bias_spec or ()))):
            # Replicated weights: the partitioner's data parallelism is this layer's too,
            # and staying out of shard_map lets the layer run inside a pipeline stage.
            return self._local(x, kernel, bias, dtype=dtype, reduce=(), batch=())

        def body(x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
            kernel = _gather(kernel, kernel_spec, batch)
            if bias is not None:
                bias = _gather(bias, bias_spec or P(), batch)
            return self._local(x, kernel, bias, dtype=dtype, reduce=reduce, batch=batch)

        return jax.shard_map(body, in_specs=(x_spec, kernel_spec, bias_spec), out_specs=y_spec,
                             axis_names=set(_free_axes(mesh)))(x, kernel, bias)

    def _local(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *, dtype: Any,
               reduce: tuple[str, ...], batch: tuple[str, ...]) -> jax.Array:
        n_in = len(self.in_shape)
        y = jnp.tensordot(x.astype(dtype), kernel.astype(dtype),
                          axes=(tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))))
        if reduce:
            y = jax.lax.psum(y, reduce)
        if bias is not None:
            y = y + bias.astype(dtype)
        return y


_DEFAULT_INIT: Initializer = nnx.initializers.lecun_normal()


class ColumnParallelLinear(_Projection):
    """A dense layer whose output features are split over the tensor axes.

    Args:
        in_features: the input width ``d``.
        out_features: the output features, one size or a shape (``(3, heads,
            head_dim)`` for a fused QKV projection).
        out_axes: the output dimensions' logical names (e.g. ``"mlp"`` or
            ``(None, "heads", None)``); map them to the tensor role with
            :meth:`~meshkit.sharding.rules.ShardingRules.extend`.
        in_axes: the input width's logical name (``"embed"``: split over the fsdp axes).
        use_bias: add a bias (split like the output).
        dtype: the compute dtype (default: the input's); parameters stay float32.
        kernel_init: the initializer of the ``[d, prod(out)]`` matrix.
        rngs: ``nnx.Rngs`` with a ``params`` stream.

    Raises:
        ValueError: a names tuple whose length is not the number of dimensions.

    Examples:
        >>> layer = ColumnParallelLinear(8, (3, 4, 2), out_axes=(None, "heads", None),
        ...                              rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 5, 8))).shape
        (2, 5, 3, 4, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        out_axes: str | Sequence[str | None] | None = "mlp",
        in_axes: str | None = "embed",
        use_bias: bool = True,
        dtype: Any = None,
        kernel_init: Initializer = _DEFAULT_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes,
                         use_bias=use_bias, dtype=dtype, kernel_init=kernel_init, rngs=rngs)


class RowParallelLinear(_Projection):
    """A dense layer whose input features are split over the tensor axes.

    Each tensor rank multiplies its slice and the partial sums are all-reduced: the
    second half of a Megatron block.

    Args:
        in_features: the input features, one size or a shape (``(heads, head_dim)``).
        out_features: the output width ``d``.
        in_axes: the input dimensions' logical names (``"mlp"``, ``("heads", None)``).
        out_axes: the output width's logical name (``"embed"``).
        use_bias: add a bias after the all-reduce.
        dtype: the compute dtype (default: the input's).
        kernel_init: the initializer of the ``[prod(in), d]`` matrix.
        rngs: ``nnx.Rngs`` with a ``params`` stream.

    Raises:
        ValueError: a names tuple whose length is not the number of dimensions.

    Examples:
        >>> layer = RowParallelLinear((4, 2), 8, in_axes=("heads", None), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 5, 4, 2))).shape
        (2, 5, 8)
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int,
        *,
        in_axes: str | Sequence[str | None] | None = "mlp",
        out_axes: str | None = "embed",
        use_bias: bool = True,
        dtype: Any = None,
        kernel_init: Initializer = _DEFAULT_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes,
                         use_bias=use_bias, dtype=dtype, kernel_init=kernel_init, rngs=rngs)


class ParallelEmbed(nnx.Module):
    """A token embedding whose rows (the vocabulary) are split over the tensor axes.

    Each tensor rank looks up the ids in its rows and the others add zero; one
    all-reduce makes the result whole. The width is split over the fsdp axes and
    gathered for the lookup.

    Args:
        num_embeddings: the vocabulary size.
        features: the width ``d``.
        axes: the table's logical names (``("vocab", "embed")``).
        dtype: the output dtype (default float32).
        rngs: ``nnx.Rngs`` with a ``params`` stream.

    Examples:
        >>> ParallelEmbed(16, 8, rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32)).shape
        (2, 5, 8)
    """

    def __init__(self, num_embeddings: int, features: int, *,
                 axes: tuple[str | None, str | None] = ("vocab", "embed"),
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        table = jax.random.normal(rngs.params(), (num_embeddings, features), jnp.float32)
        self.embedding = nnx.Param(table, out_sharding=axes, eager_sharding=False)
        self.axes, self.dtype = axes, jnp.dtype(dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Look up ``ids [batch, ...]`` → ``[batch, ..., d]``.

        Raises:
            ValueError: ``ids`` not integer, or a batch that does not split.
        """
        if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim < 1:
            raise ValueError(f"ParallelEmbed: ids must be an integer [batch, ...] array, "
                             f"got {ids.dtype} {ids.shape}")
        table = self.embedding[...]
        mesh = _mesh()
        if mesh is None:
            return jnp.take(table, ids, axis=0).astype(self.dtype)
        batch_spec = logical_spec(("batch",), what="ParallelEmbed")
        batch = entry_axes(batch_spec[0])
        table_spec = logical_spec(self.axes, what="ParallelEmbed")
        vocab = tuple(a for a in entry_axes(table_spec[0]) if a not in batch)
        ids_spec = P(batch_spec[0], *(None,) * (ids.ndim - 1))

        def body(ids: jax.Array, table: jax.Array) -> jax.Array:
            table = _gather(table, table_spec, batch)
            if not vocab:
                return jnp.take(table, ids, axis=0).astype(self.dtype)
            rows = table.shape[0]
            local = ids - jax.lax.axis_index(vocab) * rows
            mine = (local >= 0) & (local < rows)
            x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
            return jax.lax.psum(jnp.where(mine[..., None], x, 0), vocab).astype(self.dtype)

        out_spec = P(*ids_spec, None)
        return jax.shard_map(body, in_specs=(ids_spec, table_spec), out_specs=out_spec,
                             axis_names=set(_free_axes(mesh)))(ids, table)
