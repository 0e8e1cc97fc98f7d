"""ZeRO-1: the optimizer state sharded over the data axes, the parameters replicated.

Under data parallelism every device holds the whole AdamW state (two moments, each the
size of the parameters) and updates all of it identically. With ``parallel.zero1`` each
moment is instead split over the data axes, on its largest dimension the data devices
divide (on top of whatever split it already has: experts over the expert axes, widths
over fsdp or tensor). Each device updates only its slice of the moments and of each
parameter, and the parameters leave the step all-gathered over the data groups
(replicated, as they came in).

The gradients arrive already sliced, by a true reduce-scatter, for modules that run
through :func:`meshkit.sharding.params.shard_call` (meshkit's transformer, a user's
per-device modules): under :func:`reduce_scatter_gradients` each parameter enters the
``jax.shard_map`` twice, its value with the gradient stopped and a *sink*, its ZeRO-1
slice, whose gradient is ``jax.lax.psum_scatter`` of the device's own (a custom VJP that
marks the value varying over the data axes, so autodiff does not all-reduce it first).
The traffic is then textbook ZeRO-1: a reduce-scatter of the gradients and an all-gather
of the parameters, the bytes of data parallelism's one all-reduce. Any other model
(plain Flax modules under ``jax.jit``) gets the moments' shardings alone: XLA:CPU then
all-reduces the whole gradient and each device slices its share, which saves the memory
but not the traffic.

Example::

    shardings = zero1_shardings(abstract_opt_state, opt_shardings, data_axes=("dp",))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.sharding.rules import axes_entry, entry_axes

__all__ = [
    "attach_sinks",
    "gradient_axes",
    "gradient_sinks",
    "reduce_scatter_gradients",
    "zero1_shardings",
    "zero1_spec",
]


def zero1_spec(shape: Sequence[int], spec: P, *, sizes: dict[str, int],
               data_axes: Sequence[str]) -> P:
    """One array's ``PartitionSpec`` with the data axes added on its largest dimension
    whose local size they divide.

    Args:
        shape: the array's global shape.
        spec: its sharding without ZeRO-1 (data axes must not be in it already).
        sizes: mesh axis name → size.
        data_axes: the axes to shard over (outer → inner).

    Returns:
        The new spec; ``spec`` itself (padded to the rank) when no dimension divides,
        when the array is a scalar, or when ``data_axes`` is empty or of size 1.

    Raises:
        ValueError: a data axis already in ``spec`` (named in the message).

    Examples:
        >>> spec = zero1_spec((8, 6), P(None, "tp"), sizes={"dp": 2, "tp": 3},
        ...                   data_axes=("dp",))
        >>> tuple(spec)
        ('dp', 'tp')
        >>> tuple(zero1_spec((3,), P(), sizes={"dp": 2}, data_axes=("dp",)))
        (None,)
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in entry_axes(e)}
    twice = [a for a in data_axes if a in used]
    if twice:
        raise ValueError(f"zero1: data axes {twice} already shard this array ({spec})")
    ways = math.prod(sizes[a] for a in data_axes)
    if not shape or ways == 1:
        return P(*entries)
    local = [size // math.prod(sizes[a] for a in entry_axes(e))
             for size, e in zip(shape, entries, strict=True)]
    # The largest local dimension keeps the slices contiguous and least padded; the
    # first of equals, so the choice is stable.
    fits = [d for d in range(len(shape)) if local[d] % ways == 0]
    if not fits:
        return P(*entries)
    dim = max(fits, key=lambda d: (local[d], -d))
    entries[dim] = axes_entry((*entry_axes(entries[dim]), *data_axes))
    return P(*entries)


def zero1_shardings(abstract: Any, shardings: Any, *, data_axes: Sequence[str]) -> Any:
    """The shardings of an optimizer state with every array split over the data axes.

    Args:
        abstract: the optimizer state's shapes (any pytree of objects with ``.shape``).
        shardings: its ``NamedSharding`` s, the same structure.
        data_axes: the mesh's data axes.

    Returns:
        ``shardings`` with each non-scalar leaf's spec passed through :func:`zero1_spec`.

    Raises:
        ValueError: no data axes, or a data axis already in a leaf's spec.

    Example::

        opt = zero1_shardings(abstract_state[1], state_sharding[1], data_axes=("dp",))
    """
    if not data_axes:
        raise ValueError("zero1: needs data axes to shard the optimizer state over, got none")

    def place(array: Any, sharding: NamedSharding) -> NamedSharding:
        mesh = sharding.mesh
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        spec = zero1_spec(tuple(array.shape), sharding.spec, sizes=sizes, data_axes=data_axes)
        return NamedSharding(mesh, spec)

    return jax.tree.map(place, abstract, shardings)


# The data axes of the ZeRO-1 step being traced (innermost last); empty: none.
_GRADIENT_AXES: list[tuple[str, ...]] = []


@contextlib.contextmanager
def reduce_scatter_gradients(data_axes: Sequence[str]) -> Iterator[None]:
    """While tracing a ZeRO-1 train step: :func:`meshkit.sharding.params.shard_call`
    hands back its parameters' gradients reduce-scattered over ``data_axes``.

    Args:
        data_axes: the mesh's data axes (the ZeRO-1 shards' axes).

    Yields:
        Nothing; the previous setting is restored on exit.

    Example::

        with reduce_scatter_gradients(("dp",)):
            grads = nnx.grad(loss)(model, batch)  # model calls shard_call
    """
    _GRADIENT_AXES.append(tuple(data_axes))
    try:
        yield
    finally:
        _GRADIENT_AXES.pop()


def gradient_axes() -> tuple[str, ...]:
    """The data axes :func:`reduce_scatter_gradients` set, or ``()`` outside it.

    Returns:
        The axes.

    Examples:
        >>> gradient_axes()
        ()
    """
    return _GRADIENT_AXES[-1] if _GRADIENT_AXES else ()


def _local_scatter(axes: tuple[str, ...], dim: int) -> Callable[[Any, Any], Any]:
    """``attach(value, sink) -> value``, varying over ``axes``, whose backward pass gives
    ``sink`` this device's slice of the gradient summed over ``axes``: a reduce-scatter,
    where autodiff would all-reduce the whole gradient into ``value``."""

    @jax.custom_vjp
    def attach(value: Any, sink: Any) -> Any:
        # Varying over the data axes from here on, so that the gradient arriving in the
        # backward pass is each device's own, not yet summed.
        return jax.lax.pcast(value, axes, to="varying")

    def forward(value: Any, sink: Any) -> tuple[Any, None]:
        return attach(value, sink), None

    def backward(_: None, grad: Any) -> tuple[None, Any]:
        return None, jax.lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)

    attach.defvjp(forward, backward)
    return attach


def gradient_sinks(leaves: Sequence[Any], specs: Sequence[P]) -> list[tuple[int, Any, P, int]]:
    """For :func:`meshkit.sharding.params.shard_call` under :func:`reduce_scatter_gradients`:
    which of a module's arrays take their gradient reduce-scattered, and where.

    Args:
        leaves: the module state's arrays (global, outside ``jax.shard_map``).
        specs: their partition specs.

    Returns:
        ``(index, sink, sink_spec, dim)`` per floating-point array that the data axes can
        split (none outside the context or inside another ``jax.shard_map``): ``sink``
        is the array constrained to its ZeRO-1 sharding (a local slice), the input whose
        gradient is the reduce-scattered one; ``dim`` the dimension split.

    Example::

        where = gradient_sinks(jax.tree.leaves(state), leaf_specs)  # in shard_call
    """
    axes = gradient_axes()
    mesh = jax.sharding.get_abstract_mesh()
    # Inside another shard_map (a user's own around a shard_call module) the outer one's
    # transpose reduces the gradients: left to it.
    if not axes or mesh.empty or mesh.manual_axes:
        return []
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    out = []
    for i, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or not leaf.ndim:
            continue
        target = zero1_spec(leaf.shape, spec, sizes=sizes, data_axes=axes)
        dims = [d for d, (a, b) in enumerate(zip(target, (*spec, *[None] * leaf.ndim),
                                                 strict=False)) if a != b]
        if dims:
            out.append((i, jax.lax.with_sharding_constraint(leaf, target), target, dims[0]))
    return out


def attach_sinks(leaves: list[Any], sinks: Sequence[Any],
                 where: Sequence[tuple[int, Any, P, int]]) -> list[Any]:
    """Inside ``jax.shard_map``: the local arrays with each sink attached (see
    :func:`gradient_sinks`); the values are unchanged.

    Args:
        leaves: the local arrays (their gradients stopped outside).
        sinks: the local sinks, one per entry of ``where``.
        where: :func:`gradient_sinks`'s answer.

    Returns:
        The arrays to build the module from.

    Example::

        local = attach_sinks(jax.tree.leaves(local_state), local_sinks, where)
    """
    out = list(leaves)
    axes = gradient_axes()
    for (i, _, _, dim), sink in zip(where, sinks, strict=True):
        out[i] = _local_scatter(axes, dim)(out[i], sink)
    return out
