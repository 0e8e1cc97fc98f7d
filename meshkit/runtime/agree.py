"""Agreement between the processes of a run: the elementwise maximum of a few integers.

Decisions that change what a process does next (stop now, skip a damaged checkpoint)
must be the same on every process, or one of them waits forever in a collective the
others never enter. :func:`agree_max` makes them the same: every process passes its
values and gets the maximum over all processes, through one tiny jitted all-reduce over
every device (public JAX only). It is a host round trip, so callers use it at points
where the host waits anyway (a metrics fetch, a checkpoint, start-up), never per step.

Every process must call it at the same points of its program, in the same order.

:func:`first_disagreement` builds on it: before the first collective of a run, the
processes compare a hash of each config key, so processes started with different
configs (a different ``train.steps`` would leave one waiting for a step the other never
takes) stop at once, naming the key, instead of hanging.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["agree_max", "first_disagreement"]

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

    Examples:
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


def _digest(value: Any) -> int:
    """A 31-bit hash of ``value``'s JSON text: non-negative, so its negation fits int32."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big") >> 1


def first_disagreement(
    items: Sequence[tuple[str, Any]],
    *,
    agree: Callable[[Sequence[int]], list[int]] = agree_max,
) -> str | None:
    """The first key whose value is not the same on every process, or ``None``.

    One all-reduce of two hashes per key (:func:`agree_max` of the hashes and of their
    negations: a key agrees when its maximum equals its minimum), so it is cheap enough
    to run once at start-up, before anything else talks to the other processes.

    Args:
        items: ``(key, value)`` pairs with JSON-able values (others are compared by
            ``repr``); the same keys in the same order on every process (e.g. every
            key of a config schema), since each process contributes one hash per key.
        agree: the cross-process maximum (a stand-in for tests).

    Returns:
        The first key, in ``items`` order, whose value differs between processes; with
        one process, ``None``.

    Examples:
        >>> first_disagreement([("train.steps", 2), ("train.lr", 0.01)]) is None
        True
    """
    hashes = [_digest(value) for _, value in items]
    agreed = agree([*hashes, *(-h for h in hashes)])
    highest, lowest = agreed[:len(hashes)], [-v for v in agreed[len(hashes):]]
    for (key, _), hi, lo in zip(items, highest, lowest, strict=True):
        if hi != lo:
            return key
    return None
