"""Strategy → ``jax.sharding.Mesh``, with process-boundary checks.

Position ``p`` of the mesh holds ``devices[strategy.ranks.flat[p]]``: rank ``r`` is
``devices[r]``. The mesh's axis names are the strategy's, so a collective over mesh axes
``A`` runs over exactly ``strategy.groups(A)``.

Axis types: meshkit defaults to ``AxisType.Auto``. With Auto axes the compiler
propagates shardings through ``jax.jit`` and ``jax.shard_map`` reshards its inputs as
needed, so ordinary Flax/optax code and meshkit's explicit collectives compose without
annotating every intermediate. Pass ``axis_types=jax.sharding.AxisType.Explicit`` (one
type or one per axis) to opt in to sharding-in-types; then ``shard_map`` inputs must
already carry the matching sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

if TYPE_CHECKING:  # ranks.py imports this module for Strategy.mesh()
    from meshkit.strategy.ranks import Strategy

__all__ = ["check_process_blocks", "default_inner_axes", "make_mesh"]


def default_inner_axes(strategy: Strategy, devices_per_process: int) -> tuple[str, ...]:
    """The longest suffix of axes whose groups fit inside one process.

    Args:
        strategy: the strategy.
        devices_per_process: how many devices each process holds.

    Returns:
        The innermost axes whose sizes multiply to a divisor of ``devices_per_process``
        (possibly empty: then no axis is required to stay inside a process).

    Examples:
        >>> from meshkit import Strategy
        >>> default_inner_axes(Strategy.from_axes({"node": 2, "device": 4}), 4)
        ('device',)
    """
    names: list[str] = []
    product = 1
    for name, size in reversed(strategy.shape.items()):
        if devices_per_process % (product * size):
            break
        product *= size
        names.insert(0, name)
    return tuple(names)


def check_process_blocks(
    strategy: Strategy, process_of_rank: Sequence[int], inner_axes: Sequence[str]
) -> None:
    """Check that processes own whole, aligned blocks of the rank array.

    Two rules, so that the outer axes (e.g. ``node``) follow process boundaries:

    1. every group over ``inner_axes`` lives inside one process;
    2. a process spans at most one more axis than ``inner_axes`` (the innermost axis
       outside them): its ranks share their coordinates on every axis further out.
       With no inner axes, a process lies inside one group of the innermost axis.

    Args:
        strategy: the strategy.
        process_of_rank: ``process_of_rank[r]`` is the process holding rank ``r``.
        inner_axes: axes whose groups must not straddle processes.

    Raises:
        ValueError: naming the group that straddles processes (rule 1), or the process
            whose ranks straddle an outer axis (rule 2), with the ranks involved.

    Examples:
        >>> from meshkit import Strategy
        >>> s = Strategy.from_axes({"node": 2, "device": 4})
        >>> check_process_blocks(s, [0, 0, 0, 0, 1, 1, 1, 1], ["device"])
        >>> check_process_blocks(s, [0, 0, 1, 1, 2, 2, 3, 3], [])
    """
    procs = np.asarray(process_of_rank)
    hint = (
        "each process's devices must form whole blocks of the inner axes (the outer "
        "axes, e.g. 'node', must follow process boundaries). Reorder the rank array "
        "or choose other inner_axes."
    )
    if inner_axes:
        groups = strategy.groups(tuple(inner_axes))
        owners = procs[groups]
        bad = np.flatnonzero(np.any(owners != owners[:, :1], axis=1))
        if bad.size:
            raise ValueError(
                f"the group over inner axes {list(inner_axes)} with ranks "
                f"{groups[bad[0]].tolist()} spans processes {owners[bad[0]].tolist()}: {hint}"
            )
    rest = [a for a in strategy.axis_names if a not in inner_axes]
    outer = rest[:-1]  # the innermost remaining axis may be split between processes
    if not outer:
        return
    coords = np.stack(
        np.unravel_index(np.argsort(strategy.ranks.ravel()), strategy.axis_sizes), axis=1
    )[:, [strategy.axis_names.index(a) for a in outer]]
    for proc in np.unique(procs):
        mine = np.flatnonzero(procs == proc)
        if np.any(coords[mine] != coords[mine[0]]):
            raise ValueError(
                f"process {int(proc)} holds ranks {mine[:16].tolist()} that differ on the "
                f"outer axes {outer}: {hint}"
            )


def _axis_types(strategy: Strategy, axis_types: Any) -> tuple[AxisType, ...]:
    if axis_types is None:
        return (AxisType.Auto,) * len(strategy.axis_names)
    if isinstance(axis_types, AxisType):
        return (axis_types,) * len(strategy.axis_names)
    types = tuple(axis_types)
    if len(types) != len(strategy.axis_names) or not all(
        isinstance(t, AxisType) for t in types
    ):
        raise ValueError(
            f"axis_types must be one AxisType or one per axis {list(strategy.axis_names)}, "
            f"got {axis_types!r}"
        )
    return types


def make_mesh(
    strategy: Strategy,
    devices: Sequence[Any] | None = None,
    axis_types: Any = None,
    *,
    inner_axes: Sequence[str] | None = None,
) -> Mesh:
    """Build the ``jax.sharding.Mesh`` of a strategy.

    Args:
        strategy: the strategy; rank ``r`` is ``devices[r]``.
        devices: devices indexed by rank (default ``jax.devices()``); only the first
            ``strategy.size`` are used.
        axis_types: ``None`` for ``AxisType.Auto`` on every axis (see module doc), one
            ``AxisType`` for all axes, or one per axis.
        inner_axes: axes that must stay inside one process when the devices span
            several processes. Default: the longest suffix of axes whose sizes divide
            the devices per process (for ``node × device`` on one host per node, the
            device axis).

    Returns:
        A mesh with the strategy's axis names and shape.

    Raises:
        ValueError: fewer devices than ranks, repeated devices, bad ``axis_types``,
            unknown ``inner_axes``, processes left without a device in the mesh, or a
            layout that breaks :func:`check_process_blocks`.

    Examples:
        >>> from meshkit import Strategy
        >>> mesh = make_mesh(Strategy.from_axes({"node": 2, "device": 4}))
        >>> dict(mesh.shape)
        {'node': 2, 'device': 4}
    """
    defaulted = devices is None
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < strategy.size:
        raise ValueError(
            f"strategy {strategy!r} needs {strategy.size} devices, only {len(devices)} "
            "available (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "before JAX starts)"
        )
    devices = devices[: strategy.size]
    if len({id(d) for d in devices}) != len(devices):
        raise ValueError("devices must be distinct")
    types = _axis_types(strategy, axis_types)
    by_rank = np.empty(strategy.size, dtype=object)
    by_rank[:] = devices
    process_of_rank = [getattr(d, "process_index", 0) for d in devices]
    num_processes = len(set(process_of_rank))
    if inner_axes is not None:
        unknown = [a for a in inner_axes if a not in strategy.axis_names]
        if unknown:
            raise ValueError(
                f"inner_axes {unknown} are not axes of the strategy {list(strategy.axis_names)}"
            )
    if defaulted and jax.process_count() > 1:
        everyone = set(range(jax.process_count()))
        if set(process_of_rank) != everyone:
            raise ValueError(
                f"the strategy's {strategy.size} devices (the first of jax.devices()) leave "
                f"processes {sorted(everyone - set(process_of_rank))} without a device in the "
                "mesh: make the strategy cover every process's devices"
            )
    if num_processes > 1:
        if inner_axes is None:
            per_process = math.gcd(*np.bincount(process_of_rank).tolist())
            inner_axes = default_inner_axes(strategy, per_process)
        check_process_blocks(strategy, process_of_rank, inner_axes)
    return Mesh(by_rank[strategy.ranks], strategy.axis_names, axis_types=types)
