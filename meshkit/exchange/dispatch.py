"""One interface for every MoE exchange: ``dispatch`` the tokens, ``combine`` the outputs.

A :class:`Dispatcher` moves one device's routed tokens to the devices holding their
experts and brings the experts' outputs back, inside ``jax.shard_map``::

    batch, context = dispatcher.dispatch(tokens, routing)   # ExpertBatch, rows per expert
    y = dispatcher.combine(run_local_experts(batch), context)  # [n, d] float32

The layer that calls it never needs to know which exchange runs behind the two calls
(torchtitan's ``BaseEPTokenDispatcher`` has the same shape). The implementations:

- :class:`FlatDispatcher`: capacity buffers, one flat all-to-all over the expert axes.
- :class:`TwoStageDispatcher`: capacity buffers, the two-stage (hierarchical) exchange of
  :mod:`meshkit.exchange.two_stage`, in either order, or chosen per call (``"auto"``).
- :class:`meshkit.exchange.dedup.DedupDispatcher`: each token crosses to a node once.
- :class:`meshkit.exchange.ragged.RaggedDispatcher`: dropless, only the real rows.

Each takes plain arguments (axis names, sizes, capacity factor, topology), never a config.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp

from meshkit.choices import DISPATCH_MODES
from meshkit.exchange import cost
from meshkit.exchange import two_stage as stages
from meshkit.exchange.capacity import capacity
from meshkit.exchange.slots import _cumsum_plan, dispatch_plan
from meshkit.strategy.axes import AxisNames, axis_names

__all__ = [
    "DispatchContext",
    "Dispatcher",
    "ExpertBatch",
    "FlatDispatcher",
    "Routing",
    "TwoStageDispatcher",
    "check_routing",
]


@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their gates.

    Attributes:
        expert_index: ``[n, k]`` int32 expert ids in ``[0, E)``, distinct per token,
            laid out node-major (device ``p`` of the expert axes holds experts
            ``[p·E/P, (p+1)·E/P)``).
        gate: ``[n, k]`` gates, the weight of each choice's output.

    Examples:
        >>> r = Routing(jnp.array([[0, 3]], jnp.int32), jnp.array([[0.75, 0.25]]))
        >>> r.num_tokens, r.top_k
        (1, 2)
    """

    expert_index: jax.Array
    gate: jax.Array

    @property
    def num_tokens(self) -> int:
        """``n``, the tokens routed."""
        return int(self.expert_index.shape[0])

    @property
    def top_k(self) -> int:
        """``k``, the experts per token."""
        return int(self.expert_index.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertBatch:
    """The rows one device's local experts run on, in one of two layouts.

    Attributes:
        rows: ``[L, S, d]`` (``S`` padded slots per local expert, padding rows are 0)
            when ``group_sizes`` is ``None``; otherwise ``[R, d]`` rows grouped by local
            expert, group ``j`` the ``group_sizes[j]`` rows after group ``j − 1``, rows
            past the last group padding.
        group_sizes: ``[L]`` int32 rows per local expert, or ``None`` (padded layout).

    The expert outputs handed to :meth:`Dispatcher.combine` have the shape of ``rows``;
    what the experts return for padding rows is never used.

    Examples:
        >>> ExpertBatch(jnp.zeros((2, 3, 4))).group_sizes is None
        True
    """

    rows: jax.Array
    group_sizes: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class DispatchContext:
    """What :meth:`Dispatcher.combine` needs from its :meth:`Dispatcher.dispatch`.

    Attributes:
        dropped: this device's share of the dropped assignments (int32); summed over
            every device it is the total.

    Each dispatcher extends it with its own fields; callers read only ``dropped``.
    """

    dropped: jax.Array


C = TypeVar("C", bound=DispatchContext)


class Dispatcher(abc.ABC, Generic[C]):
    """An MoE exchange as two calls, both per device inside ``jax.shard_map``.

    Example::

        batch, context = dispatcher.dispatch(tokens, Routing(expert_index, gate))
        y = dispatcher.combine(experts(batch), context)
        dropped = context.dropped
    """

    @abc.abstractmethod
    def dispatch(self, x: jax.Array, routing: Routing) -> tuple[ExpertBatch, C]:
        """Send this device's token rows to their experts' devices.

        Args:
            x: ``[n, d]`` this device's tokens.
            routing: their ``[n, k]`` experts and gates.

        Returns:
            ``(batch, context)``: the rows this device's experts run on, and what
            :meth:`combine` needs (``context.dropped`` counts the dropped assignments).
        """

    @abc.abstractmethod
    def combine(self, expert_outputs: jax.Array, context: C) -> jax.Array:
        """Bring the experts' outputs home and sum each token's, weighted by its gates.

        Args:
            expert_outputs: the local experts' outputs, shaped like ``batch.rows``.
            context: the context :meth:`dispatch` returned.

        Returns:
            ``y [n, d]`` float32; a token whose every choice was dropped gets 0.
        """


def check_routing(x: jax.Array, routing: Routing, who: str) -> None:
    """Raise ``ValueError`` unless ``x`` is ``[n, d]`` and ``routing`` is ``[n, k]``.

    Args:
        x: the tokens.
        routing: their routing.
        who: the caller, to start the message with.

    Raises:
        ValueError: the shapes do not match.

    Examples:
        >>> check_routing(jnp.zeros((2, 4)), Routing(jnp.zeros((3, 1), int), jnp.zeros((3, 1))),
        ...               "flat")
        Traceback (most recent call last):
        ...
        ValueError: flat: expert_index and gate must both be [2, k], got shapes (3, 1) and (3, 1)
    """
    if x.ndim != 2:
        raise ValueError(f"{who}: tokens must be [n, d], got shape {x.shape}")
    index, gate = routing.expert_index, routing.gate
    if index.ndim != 2 or index.shape[0] != x.shape[0] or gate.shape != index.shape:
        raise ValueError(
            f"{who}: expert_index and gate must both be [{x.shape[0]}, k], got shapes "
            f"{index.shape} and {gate.shape}"
        )


@dataclasses.dataclass(frozen=True)
class _CapacityContext(DispatchContext):
    expert_index: jax.Array
    gate: jax.Array
    slot: jax.Array
    keep: jax.Array
    capacity: int


class _CapacityDispatcher(Dispatcher[_CapacityContext]):
    """Capacity buffers ``[E, C, d]``, exchanged by :meth:`_exchange`.

    Slots come from :func:`meshkit.exchange.slots.dispatch_plan` (choice-major, so a
    first choice never loses its slot to a second choice); ``C`` from
    :func:`meshkit.exchange.capacity.capacity` on this device's tokens.
    """

    def __init__(self, *, num_experts: int, capacity_factor: float, mode: str) -> None:
        if mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {mode!r}")
        self.num_experts, self.capacity_factor, self.mode = num_experts, capacity_factor, mode

    @abc.abstractmethod
    def _exchange(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        """The all-to-all over the expert axes (identity when there are none)."""

    def dispatch(self, x: jax.Array, routing: Routing) -> tuple[ExpertBatch, _CapacityContext]:
        check_routing(x, routing, type(self).__name__)
        expert_index, gate = routing.expert_index, routing.gate
        e, k = self.num_experts, routing.top_k
        n, d = x.shape
        c = capacity(n, num_experts=e, top_k=k, capacity_factor=self.capacity_factor)
        if self.mode == "sort":
            slot, keep = dispatch_plan(expert_index, e, c)
            # Dropped assignments point at slot c, out of bounds, and mode="drop" skips
            # them; kept (expert, slot) pairs are unique, so adding into zeros is a pure
            # copy. An add, not a set: a set's backward pass keeps index buffers saying
            # which update won (0.5 MiB of the matched MoE dp8 step's temp).
            flat_e = expert_index.T.reshape(-1)
            flat_s = jnp.where(keep, slot, c).T.reshape(-1)
            rows = jnp.tile(x, (k, 1))
            buf = jnp.zeros((e, c, d), x.dtype).at[flat_e, flat_s].add(rows, mode="drop")
        else:
            slot = _cumsum_plan(expert_index, e)
            keep = slot < c
            # [N, k, E] x [N, k, C] one-hots summed over k: the GShard dispatch tensor.
            place = jnp.einsum(
                "nke,nkc->nec",
                jax.nn.one_hot(expert_index, e, dtype=jnp.float32),
                jax.nn.one_hot(jnp.where(keep, slot, c), c, dtype=jnp.float32),
            )
            buf = jnp.einsum("nec,nd->ecd", place, x.astype(jnp.float32)).astype(x.dtype)
        buf = self._exchange(buf, 0, 1)  # [E/P, P·C, d]: my experts, every device's slots
        context = _CapacityContext(
            dropped=jnp.sum(~keep, dtype=jnp.int32), expert_index=expert_index, gate=gate,
            slot=slot, keep=keep, capacity=c,
        )
        return ExpertBatch(buf), context

    def combine(self, expert_outputs: jax.Array, context: _CapacityContext) -> jax.Array:
        e, c = self.num_experts, context.capacity
        expert_index, slot, keep = context.expert_index, context.slot, context.keep
        out = self._exchange(expert_outputs, 1, 0).astype(jnp.float32)  # [E, C, d] home
        weight = jnp.where(keep, context.gate, 0.0)
        if self.mode == "sort":
            rows = out[expert_index, jnp.minimum(slot, c - 1)]  # [N, k, d]
            return jnp.einsum("nk,nkd->nd", weight, rows)
        combine = jnp.einsum(
            "nke,nkc->nec",
            jax.nn.one_hot(expert_index, e, dtype=jnp.float32) * weight[..., None],
            jax.nn.one_hot(jnp.where(keep, slot, c), c, dtype=jnp.float32),
        )
        return jnp.einsum("nec,ecd->nd", combine, out)


class FlatDispatcher(_CapacityDispatcher):
    """Capacity buffers exchanged by one flat all-to-all over the expert axes.

    Args:
        num_experts: ``E``, divisible by the devices of ``axes``.
        capacity_factor: per-device capacity factor
            (:func:`meshkit.exchange.capacity.capacity`; 0: dropless, padded to ``n``).
        axes: the expert mesh axes, row-major; ``()``: every device holds every expert
            and nothing is exchanged.
        mode: ``"sort"`` (scatter by slot) or ``"einsum"`` (GShard's one-hot tensors;
            same results).

    Raises:
        ValueError: an unknown ``mode``; bad axis names
            (:func:`meshkit.strategy.axes.axis_names`).

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("e",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> flat = FlatDispatcher(num_experts=8, capacity_factor=8.0, axes="e")  # C = 4
        >>> def body(x):
        ...     routing = Routing(jnp.zeros((4, 1), jnp.int32) + jax.lax.axis_index("e"),
        ...                       jnp.ones((4, 1)))
        ...     batch, context = flat.dispatch(x, routing)
        ...     return flat.combine(batch.rows * 2, context)  # "experts" that double
        >>> f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("e"), out_specs=P("e")))
        >>> bool((f(jnp.ones((32, 3))) == 2).all())
        True
    """

    def __init__(
        self, *, num_experts: int, capacity_factor: float, axes: AxisNames = (),
        mode: str = "sort",
    ) -> None:
        super().__init__(num_experts=num_experts, capacity_factor=capacity_factor, mode=mode)
        self.axes = axis_names(axes, "axes")

    def _exchange(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        if not self.axes:
            return x
        return jax.lax.all_to_all(x, self.axes, split_axis, concat_axis, tiled=True)


class TwoStageDispatcher(_CapacityDispatcher):
    """Capacity buffers exchanged across nodes and inside them in two stages.

    Args:
        num_experts: ``E``, divisible by the ``N·M`` devices.
        capacity_factor: as :class:`FlatDispatcher`.
        node_axes: mesh axes spanning nodes (outer).
        device_axes: mesh axes spanning a node's devices (inner).
        method: ``"hierarchical"`` (two stages in ``order``), or ``"auto"``/``"flat"``:
            :func:`meshkit.exchange.two_stage.all_to_all` with that method, per buffer.
        order: ``"node_first"`` or ``"device_first"`` (``"hierarchical"`` only).
        topology: the cost model's hardware for ``"auto"`` (``None``: the default).
        mode: as :class:`FlatDispatcher`.

    Raises:
        ValueError: an unknown ``method``, ``order`` or ``mode``; no node or no device
            axes.

    Examples:
        >>> TwoStageDispatcher(num_experts=8, capacity_factor=1.0, node_axes="node",
        ...                    device_axes="device", order="device_first").order
        'device_first'
    """

    def __init__(
        self, *, num_experts: int, capacity_factor: float, node_axes: AxisNames,
        device_axes: AxisNames, method: str = "hierarchical", order: str = "node_first",
        topology: cost.Topology | None = None, mode: str = "sort",
    ) -> None:
        super().__init__(num_experts=num_experts, capacity_factor=capacity_factor, mode=mode)
        if method not in stages.METHODS:
            raise ValueError(f"method must be one of {stages.METHODS}, got {method!r}")
        if order not in stages.ORDERS:
            raise ValueError(f"order must be one of {stages.ORDERS}, got {order!r}")
        self.node_axes = axis_names(node_axes, "node_axes", required=True)
        self.device_axes = axis_names(device_axes, "device_axes", required=True)
        self.method, self.order, self.topology = method, order, topology

    def _exchange(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        if self.method == "hierarchical":
            return stages.hierarchical_all_to_all(
                x, split_axis, concat_axis, node_axis=self.node_axes,
                device_axis=self.device_axes, order=self.order,
            )
        return stages.all_to_all(
            x, split_axis, concat_axis, node_axis=self.node_axes, device_axis=self.device_axes,
            method=self.method, topology=self.topology,
        )

