"""ZeRO-1: the optimizer state sharded over the data axes, the parameters replicated.

Under data parallelism every device holds the whole AdamW state (two moments, each the
size of the parameters) and updates all of it identically. With ``parallel.zero1`` each
moment is instead split over the data axes, on its largest dimension the data devices
divide (on top of whatever split it already has: experts over the expert axes, widths
over fsdp or tensor). The train step is unchanged: the moments' shardings alone make
XLA's partitioner reduce each gradient, keep this device's slice of it, update only that
slice of the moments and of the parameter, and all-gather the new parameters (which
leave the step replicated, as they came in).

Which collective carries the gradient reduction is the compiler's choice, read in the
tests with :func:`meshkit.strategy.hlo.collectives`. With meshkit's transformer it stays
an all-reduce on XLA:CPU: the model runs inside ``jax.shard_map`` and reduces a
replicated parameter's gradient there (the transpose of its implicit broadcast is a
``psum``), before the optimizer sees it; each device then slices its share. XLA:CPU does
emit a true reduce-scatter for an explicit ``jax.lax.psum_scatter``, but that would need
the model to hand back unreduced gradients. So ZeRO-1 here saves optimizer memory
(÷ data size), and its traffic is one all-reduce plus one all-gather of the parameters.

Example::

    shardings = zero1_shardings(abstract_opt_state, opt_shardings, data_axes=("dp",))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.sharding.rules import axes_entry, entry_axes

__all__ = ["zero1_shardings", "zero1_spec"]


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

    Example:
        >>> zero1_spec((8, 6), P(None, "tp"), sizes={"dp": 2, "tp": 3}, data_axes=("dp",))
        PartitionSpec('dp', 'tp')
        >>> zero1_spec((3,), P(), sizes={"dp": 2}, data_axes=("dp",))
        PartitionSpec(None,)
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
