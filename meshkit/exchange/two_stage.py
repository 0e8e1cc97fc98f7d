"""Flat and two-stage (hierarchical) all-to-all inside ``jax.shard_map``.

An all-to-all over ``P = N × M`` devices (``N`` nodes of ``M`` devices each) moves piece
``p`` of every device's buffer to device ``p``. Done flat, each device sends ``(N−1)·M``
messages across the slow inter-node network. Done in two stages — across nodes between
devices with the same local index, then inside each node — each device sends ``N−1``
inter-node messages, each ``M`` times larger, for the same number of bytes. Which one is
faster depends on message size and scale; :mod:`meshkit.exchange.cost` decides, at trace time,
when ``method="auto"``.

Both functions return exactly what
``jax.lax.all_to_all(x, (*node_axes, *device_axes), split_axis, concat_axis, tiled=True)``
returns: the same values bit for bit (an all-to-all only moves data) and the same
gradients (the transpose of each stage is again an all-to-all).
"""

from __future__ import annotations

import jax
import numpy as np

from meshkit.choices import EXCHANGE_METHODS, EXCHANGE_ORDERS
from meshkit.exchange import cost
from meshkit.strategy.axes import AxisNames, axis_names

__all__ = ["METHODS", "ORDERS", "all_to_all", "hierarchical_all_to_all"]

#: Accepted values of ``order`` in :func:`hierarchical_all_to_all` (:mod:`meshkit.choices`).
ORDERS = EXCHANGE_ORDERS
#: Accepted values of ``method`` in :func:`all_to_all` (:mod:`meshkit.choices`).
METHODS = EXCHANGE_METHODS

def _resolve(
    node_axis: AxisNames, device_axis: AxisNames, caller: str
) -> tuple[tuple[str, ...], tuple[str, ...], int, int]:
    """Validate the axis names against the enclosing shard_map; return them and N, M."""
    node_axes = axis_names(node_axis, "node_axis", required=True)
    device_axes = axis_names(device_axis, "device_axis", required=True)
    seen: set[str] = set()
    for name in (*node_axes, *device_axes):
        if name in seen:
            raise ValueError(
                f"mesh axis {name!r} is listed twice in node_axis={node_axis!r}, "
                f"device_axis={device_axis!r}; each axis may appear once"
            )
        seen.add(name)
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(mesh.manual_axes)
    if not manual:
        raise NameError(
            f"meshkit.{caller} must be called inside jax.shard_map: no manual "
            f"mesh axis is bound here (wanted {(*node_axes, *device_axes)!r})"
        )
    for name in seen:
        if name not in manual:
            where = "is not a manual axis of" if name in mesh.axis_names else "is not an axis of"
            raise NameError(
                f"mesh axis {name!r} {where} the enclosing shard_map (manual axes: {manual!r})"
            )
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    n = int(np.prod([sizes[a] for a in node_axes]))
    m = int(np.prod([sizes[a] for a in device_axes]))
    return node_axes, device_axes, n, m


def _norm_axis(axis: int, ndim: int, arg: str) -> int:
    if not isinstance(axis, int | np.integer) or isinstance(axis, bool):
        raise TypeError(f"{arg} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{arg}={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def _check_shape(x: jax.Array, split_axis: int, concat_axis: int, p: int) -> tuple[int, int]:
    if x.ndim < 1:
        raise ValueError("all_to_all needs an array of rank >= 1, got a scalar")
    s = _norm_axis(split_axis, x.ndim, "split_axis")
    c = _norm_axis(concat_axis, x.ndim, "concat_axis")
    if x.shape[s] % p:
        raise ValueError(
            f"split dimension {split_axis} of x (size {x.shape[s]}, shape {x.shape}) is not "
            f"divisible by the number of devices P = {p}"
        )
    return s, c


def _flat(x: jax.Array, axes: tuple[str, ...], s: int, c: int) -> jax.Array:
    return jax.lax.all_to_all(x, axes, s, c, tiled=True)


def _two_stage(
    x: jax.Array, s: int, c: int, stages: tuple[tuple[tuple[str, ...], int], ...], n: int, m: int
) -> jax.Array:
    """Both stages on a view of x whose split dimension is (node N, device M, chunk k).

    Each stage is an untiled all-to-all whose split and concat dimension is the same
    size-N (or size-M) dimension: it swaps "destination index" for "source index" in
    place. XLA then cuts and joins only along that dimension, so between the stages the
    join of one and the cut of the next fuse into a single pass over the data, and the
    result is (source node, source device, chunk) with no transpose. Only when the
    concat dimension differs from the split dimension do the two source dimensions move
    next to it, which XLA folds into the final join.
    """
    k = x.shape[s] // (n * m)
    y = x.reshape(*x.shape[:s], n, m, k, *x.shape[s + 1 :])
    for axes, dim in stages:
        y = jax.lax.all_to_all(y, axes, dim, dim, tiled=False)
    if s != c:
        target = c + 2 if c > s else c
        rest = [d for d in range(y.ndim) if d not in (s, s + 1)]
        at = rest.index(target)
        y = y.transpose((*rest[:at], s, s + 1, *rest[at:]))
    out_shape = list(x.shape)
    out_shape[s] = k
    out_shape[c] *= n * m
    return y.reshape(out_shape)


def hierarchical_all_to_all(
    x: jax.Array,
    split_axis: int,
    concat_axis: int,
    *,
    node_axis: AxisNames = "node",
    device_axis: AxisNames = "device",
    order: str = "node_first",
) -> jax.Array:
    """Two-stage all-to-all over ``(*node_axes, *device_axes)``, inside ``jax.shard_map``.

    Let ``N`` be the product of the node axes' sizes, ``M`` that of the device axes and
    ``P = N·M``. Device ``(n, m)`` cuts its split dimension into ``P`` pieces; piece
    ``p = n'·M + m'`` belongs to device ``(n', m')``: its buffer is ``N`` node blocks of
    ``M`` pieces each. A node's block, as the node stage delivers it (``N·M`` pieces,
    ordered source node, then destination local device), is spread so that piece ``j``
    (1-based) goes to local device ``(j − 1) % M + 1``.

    With ``order="node_first"``:

    1. Node stage — an all-to-all over the node axes between devices with the same local
       index ``m``: device ``(n, m)`` sends node block ``n'`` (its ``M`` pieces for node
       ``n'``) to device ``(n', m)`` as one message. Afterwards device ``(n', m)`` holds,
       for every source node ``n``, the ``M`` pieces that ``(n, m)`` meant for node
       ``n'``: layout ``[source node n][destination local device m'][piece]``.
    2. Device stage — an all-to-all over the device axes inside each node: the pieces for
       local device ``m'`` (one from every source node) go to ``(n', m')``. Device
       ``(n', m')`` ends with layout ``[source node n][source device m][piece]``, i.e.
       the ``P`` received pieces in source order ``n·M + m`` — the flat result.

    ``order="device_first"`` runs the same two stages the other way round: first inside
    the node (device ``(n, m)`` sends to ``(n, m')`` every piece meant for local index
    ``m'`` on any node), then across nodes. Both orders give identical results and send
    the same messages across nodes (``N − 1`` per device, each ``M`` pieces).

    Internally the split dimension is viewed as ``(N, M, k)``; each stage is an untiled
    all-to-all over one of the two size-``N``/``M`` dimensions that replaces the
    destination index with the source index in place, so the final layout
    ``(source node, source device, k)`` needs only a reshape (and, when ``concat_axis !=
    split_axis``, moving those two dimensions next to the concat dimension). With
    ``N == 1`` or ``M == 1`` one flat collective is emitted instead.

    Args:
        x: the per-device block (rank >= 1, any dtype).
        split_axis: dimension cut into ``P`` pieces; its size must be divisible by ``P``.
            Negative values count from the end.
        concat_axis: dimension along which received pieces are concatenated (may equal
            ``split_axis``). Negative values count from the end.
        node_axis: mesh axis name, or tuple of names, spanning nodes (outer).
        device_axis: mesh axis name, or tuple of names, spanning a node's devices (inner).
        order: ``"node_first"`` (node stage then device stage) or ``"device_first"``.

    Returns:
        An array equal to ``jax.lax.all_to_all(x, (*node_axes, *device_axes), split_axis,
        concat_axis, tiled=True)``: ``split_axis`` divided by ``P``, ``concat_axis``
        multiplied by ``P``.

    Raises:
        NameError: called outside ``jax.shard_map``, or an axis name is not a manual axis
            of the enclosing ``shard_map``.
        ValueError: an axis is listed twice or a name tuple is empty; ``split_axis`` or
            ``concat_axis`` is out of range; the split dimension is not divisible by
            ``P``; ``order`` is not one of :data:`ORDERS`; ``x`` is a scalar.
        TypeError: an axis name is not a str, or an axis index is not an int.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4),
        ...                          ("node", "device"))
        >>> spec = P(("node", "device"))
        >>> f = jax.jit(jax.shard_map(
        ...     lambda b: hierarchical_all_to_all(b, 0, 1), mesh=mesh,
        ...     in_specs=spec, out_specs=spec))
        >>> x = jnp.arange(64 * 3).reshape(64, 3)
        >>> f(x).shape  # 8 devices: local (8, 3) -> (1, 24)
        (8, 24)
        >>> flat = jax.jit(jax.shard_map(
        ...     lambda b: jax.lax.all_to_all(b, ("node", "device"), 0, 1, tiled=True),
        ...     mesh=mesh, in_specs=spec, out_specs=spec))
        >>> bool((f(x) == flat(x)).all())
        True
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    node_axes, device_axes, n, m = _resolve(node_axis, device_axis, "hierarchical_all_to_all")
    s, c = _check_shape(x, split_axis, concat_axis, n * m)
    if n == 1 or m == 1:
        return _flat(x, (*node_axes, *device_axes), s, c)
    node_stage = (node_axes, s)
    device_stage = (device_axes, s + 1)
    stages = (node_stage, device_stage) if order == "node_first" else (device_stage, node_stage)
    return _two_stage(x, s, c, stages, n, m)


def all_to_all(
    x: jax.Array,
    split_axis: int,
    concat_axis: int,
    *,
    node_axis: AxisNames = "node",
    device_axis: AxisNames = "device",
    method: str = "auto",
    topology: cost.Topology | None = None,
) -> jax.Array:
    """All-to-all over ``(*node_axes, *device_axes)`` by the flat or the two-stage method.

    Must be called inside ``jax.shard_map``. ``method="auto"`` asks
    :func:`meshkit.exchange.cost.choose` at trace time, with ``bytes_per_device = x.size *
    x.dtype.itemsize`` (the whole buffer one device sends) and ``topology``; the choice
    is baked into the compiled program, so it costs nothing at run time.
    ``topology=None`` means :func:`meshkit.exchange.cost.default_topology` for this mesh's ``N``
    and ``M`` (H100 nodes with 8 × 400 Gb/s InfiniBand link numbers).

    Args:
        x: the per-device block (rank >= 1, any dtype).
        split_axis: dimension cut into ``P = N·M`` pieces (divisible by ``P``).
        concat_axis: dimension along which received pieces are concatenated.
        node_axis: mesh axis name, or tuple of names, spanning nodes (outer).
        device_axis: mesh axis name, or tuple of names, spanning a node's devices (inner).
        method: ``"flat"``, ``"hierarchical"`` (``order="node_first"``) or ``"auto"``.
        topology: the hardware for ``"auto"``; its ``nodes`` and ``devices_per_node``
            must equal ``N`` and ``M``. Ignored by the other methods.

    Returns:
        ``jax.lax.all_to_all(x, (*node_axes, *device_axes), split_axis, concat_axis,
        tiled=True)``, bit for bit, whichever method runs.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`; ``topology`` does not match
            the mesh; plus everything :func:`hierarchical_all_to_all` raises.
        NameError: as :func:`hierarchical_all_to_all`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from meshkit.exchange import cost
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4),
        ...                          ("node", "device"))
        >>> spec = P(("node", "device"))
        >>> f = jax.jit(jax.shard_map(
        ...     lambda b: all_to_all(b, 0, 1, method="auto",
        ...                          topology=cost.preset("a100-8x200g", 2, 4)),
        ...     mesh=mesh, in_specs=spec, out_specs=spec))
        >>> f(jnp.zeros((64, 3))).shape
        (8, 24)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    node_axes, device_axes, n, m = _resolve(node_axis, device_axis, "all_to_all")
    s, c = _check_shape(x, split_axis, concat_axis, n * m)
    if method == "auto":
        if topology is None:
            topology = cost.default_topology(n, m)
        elif (topology.nodes, topology.devices_per_node) != (n, m):
            raise ValueError(
                f"topology has {topology.nodes} nodes × {topology.devices_per_node} "
                f"devices but the mesh axes give N = {n}, M = {m}; build it with "
                f"meshkit.exchange.cost.preset(name, nodes={n}, devices_per_node={m})"
            )
        method = cost.choose(x.size * x.dtype.itemsize, topology)
    if method == "flat":
        return _flat(x, (*node_axes, *device_axes), s, c)
    return hierarchical_all_to_all(
        x, s, c, node_axis=node_axes, device_axis=device_axes, order="node_first"
    )
