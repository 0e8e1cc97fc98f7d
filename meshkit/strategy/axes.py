"""Mesh axis names as callers give them, in one spelling: a tuple of non-empty strings.

Every API that takes axes accepts one name (``"device"``), several (``("node", "device")``,
a fused axis), or none (``()`` or ``None``), and normalises them here.

Examples:
    >>> axis_names("device", "tensor"), axis_names(["node", "device"], "expert")
    (('device',), ('node', 'device'))
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AxisNameError", "AxisNames", "axis_names"]

AxisNames = str | Sequence[str]
"""One mesh axis name, or several (a fused axis)."""


class AxisNameError(ValueError, TypeError):
    """A bad axis name: a ``ValueError`` for a wrong value, a ``TypeError`` for a non-str."""


def axis_names(value: AxisNames | None, what: str, *, required: bool = False) -> tuple[str, ...]:
    """Normalise axis names to a tuple.

    Args:
        value: one name, a sequence of names, or ``None`` (none).
        what: the argument's name, for errors (``"node_axis"``, ``"ShardingRules: tensor"``).
        required: refuse an empty result.

    Returns:
        The names, in order.

    Raises:
        AxisNameError: a name that is not a non-empty string, or none when ``required``.

    Examples:
        >>> axis_names(None, "data"), axis_names(("a", "b"), "x")
        ((), ('a', 'b'))
        >>> axis_names((), "node_axis", required=True)
        Traceback (most recent call last):
        ...
        meshkit.strategy.axes.AxisNameError: node_axis must name at least one mesh axis, got ()
    """
    if value is None:
        names: tuple[object, ...] = ()
    elif isinstance(value, str):
        names = (value,)
    elif isinstance(value, Sequence):
        names = tuple(value)
    else:
        names = (value,)
    for name in names:
        if not isinstance(name, str) or not name:
            raise AxisNameError(f"{what} axis names must be non-empty strings, got {value!r}")
    if required and not names:
        raise AxisNameError(f"{what} must name at least one mesh axis, got {value!r}")
    return tuple(str(n) for n in names)
