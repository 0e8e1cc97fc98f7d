"""Agreement between the processes of a run: the elementwise maximum of a few integers.

Decisions that change what a process does next (stop now, skip a damaged checkpoint)
must be the same on every process, or one of them waits forever in a collective the
others never enter. :func:`agree_max` makes them the same: every process passes its
values and gets the maximum over all processes, through one tiny jitted all-reduce over
every device (public JAX only). It is a host round trip, so callers use it at points
where the host waits anyway (a metrics fetch, a checkpoint, start-up), never per step.

Every process must call it at the same points of its program, in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["agree_max"]

_AXIS = "processes"


@functools.cache
def _reducer(devices: tuple[jax.Device, ...], width: int) -> tuple[
    NamedSharding, Callable[[jax.Array], jax.Array]
]:
    mesh = Mesh(np.array(devices), (_AXIS,))
    rows = NamedSharding(mesh, P(_AXIS, None))
    reduce = jax.jit(lambda x: jnp.max(x, axis=0), out_shardings=NamedSharding(mesh, P()))
    return rows, reduce


def agree_max(values: Sequence[int]) -> list[int]:
    """The elementwise maximum of ``values`` over all processes.

    With one process it returns ``values`` at once, without touching a device.

    Args:
        values: the same number of int32-sized integers on every process.

    Returns:
        The maxima, one per value, identical on every process.

    Example:
        >>> agree_max([3, -1])
        [3, -1]
    """
    if jax.process_count() == 1:
        return [int(v) for v in values]
    rows, reduce = _reducer(tuple(jax.devices()), len(values))
    local = np.asarray(values, np.int32)[None]
    # One row per device, each holding this process's values.
    stacked = jax.make_array_from_callback((jax.device_count(), len(values)), rows,
                                           lambda index: local)
    return [int(v) for v in np.asarray(reduce(stacked).addressable_data(0))]
