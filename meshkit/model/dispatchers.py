"""Which exchange an MoE layer runs: the one place that knows the dispatcher kinds.

:func:`make_dispatcher` maps the layer's exchange settings (``exchange.method``,
``exchange.order``, ``exchange.dedup``, the dropless ``capacity_factor = 0``, the cost
model's topology) and the mesh to one :class:`meshkit.exchange.dispatch.Dispatcher`;
:func:`config_topology` reads the topology a config names. The MoE layer only calls the
dispatcher's ``dispatch`` and ``combine``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax

from meshkit.exchange import cost
from meshkit.exchange.capacity import capacity, dedup_nodes_per_token
from meshkit.exchange.dedup import DedupDispatcher
from meshkit.exchange.dispatch import Dispatcher, FlatDispatcher, TwoStageDispatcher
from meshkit.exchange.ragged import RaggedDispatcher, ragged_op
from meshkit.sharding.rules import ShardingRules

if TYPE_CHECKING:
    from meshkit.config import Config

__all__ = ["config_topology", "make_dispatcher"]


def make_dispatcher(
    *,
    rules: ShardingRules,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    max_nodes: int | None = None,
    mode: str = "sort",
    method: str = "auto",
    order: str = "node_first",
    dedup: bool = False,
    topology: cost.Topology | None = None,
    bytes_per_row: int | None = None,
    num_tokens: int | None = None,
    ragged: bool = True,
) -> Dispatcher[Any]:
    """The dispatcher an MoE layer with these settings runs, inside ``jax.shard_map``.

    Public so that a model of one's own can run meshkit's exchanges around its own
    router and experts, in its own ``jax.shard_map``: the routing is an input to
    ``dispatch`` (:class:`~meshkit.exchange.dispatch.Routing`), and the experts run on
    the :class:`~meshkit.exchange.dispatch.ExpertBatch` it returns (an
    :class:`meshkit.model.experts.Experts` module takes it as is). In order of
    precedence:

    1. **dedup** (:class:`~meshkit.exchange.dedup.DedupDispatcher`) when ``dedup`` is
       set, or when ``method="auto"`` with node and device axes and ``mode="sort"`` and
       :func:`meshkit.exchange.cost.choose` picks it for the capacity buffer
       (``nodes_per_token`` as its buffers carry them,
       :func:`~meshkit.exchange.capacity.dedup_nodes_per_token`);
    2. **ragged** (:class:`~meshkit.exchange.ragged.RaggedDispatcher`) for a dropless
       layer (``capacity_factor=0``) with ``mode="sort"``, expert axes, a method other
       than ``"hierarchical"`` and ``ragged`` set, on a platform with
       ``ragged_all_to_all`` (:func:`meshkit.exchange.ragged.ragged_op`); otherwise the
       padded buffers of 3 or 4;
    3. **two-stage** (:class:`~meshkit.exchange.dispatch.TwoStageDispatcher`) with node
       and device axes and method ``"hierarchical"`` (in ``order``) or ``"auto"``;
    4. **flat** (:class:`~meshkit.exchange.dispatch.FlatDispatcher`) otherwise: method
       ``"flat"``, one level of expert axes only, or none (no exchange).

    Args:
        rules: the mesh axes of each role; experts lie over ``rules.expert_axes``.
        num_experts: ``E``.
        top_k: experts per token.
        capacity_factor: per-device capacity factor (0: dropless).
        max_nodes: node-limited routing's bound (``None``: none).
        mode: ``"sort"`` or ``"einsum"`` capacity dispatch.
        method: ``"auto"``, ``"flat"`` or ``"hierarchical"``.
        order: the two-stage order, ``"node_first"`` or ``"device_first"``.
        dedup: force the node-deduplicated exchange.
        topology: the cost model's hardware for ``"auto"`` (``None``: default for the mesh).
        bytes_per_row: bytes of one token row (``d · itemsize``), for the cost model;
            needed when ``method="auto"`` weighs the deduplicated exchange.
        num_tokens: ``n``, this device's routed tokens, for the cost model; needed
            likewise.
        ragged: whether the experts run grouped rows
            (:meth:`meshkit.model.experts.Experts.supports_grouped`); ``False`` keeps a
            dropless exchange on padded buffers.

    Returns:
        The dispatcher.

    Raises:
        ValueError: ``method="auto"`` must weigh the deduplicated exchange but
            ``bytes_per_row`` or ``num_tokens`` is missing.

    Examples:
        >>> settings = dict(num_experts=16, top_k=2, capacity_factor=1.25)
        >>> rules = ShardingRules(node="node", device="device")
        >>> type(make_dispatcher(rules=rules, method="hierarchical", **settings)).__name__
        'TwoStageDispatcher'
        >>> type(make_dispatcher(rules=rules, method="flat", **settings)).__name__
        'FlatDispatcher'

        Around a router and experts of one's own, in one's own shard_map over 2 × 4
        devices (experts ``[E/P, ...]`` per device by their partition specs):

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from meshkit.exchange.dispatch import Routing
        >>> from meshkit.model.experts import MLPExperts
        >>> P = jax.sharding.PartitionSpec
        >>> mesh = jax.make_mesh((2, 4), ("node", "device"),
        ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
        >>> graphdef, state = nnx.split(
        ...     MLPExperts(num_experts=8, d_model=4, d_ff=8, rules=rules, rngs=nnx.Rngs(0)))
        >>> def body(x, w_router, state):
        ...     gate, index = jax.lax.top_k(jax.nn.softmax(x @ w_router), 2)  # my router
        ...     dispatcher = make_dispatcher(rules=rules, num_experts=8, top_k=2,
        ...                                  capacity_factor=2.0, method="hierarchical")
        ...     batch, context = dispatcher.dispatch(x, Routing(index, gate))
        ...     return dispatcher.combine(nnx.merge(graphdef, state)(batch), context)
        >>> tokens = P(("node", "device"))
        >>> moe = jax.jit(jax.shard_map(body, mesh=mesh, out_specs=tokens,
        ...     in_specs=(tokens, P(), nnx.get_partition_spec(state))))
        >>> moe(jnp.ones((32, 4)), jnp.zeros((4, 8)), state).shape
        (32, 4)

    ``"auto"`` and dropless settings read the mesh, so call it inside ``jax.shard_map``.
    """
    node, device = rules.node, rules.device
    if _dedup_wins(dedup=dedup, rules=rules, num_experts=num_experts, top_k=top_k,
                   capacity_factor=capacity_factor, max_nodes=max_nodes, mode=mode,
                   method=method, topology=topology, bytes_per_row=bytes_per_row,
                   num_tokens=num_tokens):
        return DedupDispatcher(num_experts=num_experts, capacity_factor=capacity_factor,
                               node_axes=node, device_axes=device, max_nodes=max_nodes)
    if (ragged and not capacity_factor and mode == "sort" and rules.expert_axes
            and method != "hierarchical"
            and (op := ragged_op(jax.sharding.get_abstract_mesh())) is not None):
        return RaggedDispatcher(num_experts=num_experts, axes=rules.expert_axes, all_to_all=op)
    if node and device and method != "flat":
        return TwoStageDispatcher(num_experts=num_experts, capacity_factor=capacity_factor,
                                  node_axes=node, device_axes=device, method=method,
                                  order=order, topology=topology, mode=mode)
    return FlatDispatcher(num_experts=num_experts, capacity_factor=capacity_factor,
                          axes=rules.expert_axes, mode=mode)


def _dedup_wins(
    *, dedup: bool, rules: ShardingRules, num_experts: int, top_k: int,
    capacity_factor: float, max_nodes: int | None, mode: str, method: str,
    topology: cost.Topology | None, bytes_per_row: int | None, num_tokens: int | None,
) -> bool:
    """Whether to run the deduplicated exchange (set, or chosen by ``"auto"``)."""
    if dedup:
        return True
    if method != "auto" or mode != "sort" or not (rules.node and rules.device):
        return False
    if bytes_per_row is None or num_tokens is None:
        raise ValueError(
            "make_dispatcher: method='auto' weighs the deduplicated exchange by its size: "
            f"pass bytes_per_row and num_tokens (got {bytes_per_row} and {num_tokens}), "
            "or choose method='flat' or 'hierarchical'"
        )
    nodes, devices = jax.lax.axis_size(rules.node), jax.lax.axis_size(rules.device)
    topology = topology or cost.default_topology(nodes, devices)
    c = capacity(num_tokens, num_experts=num_experts, top_k=top_k,
                 capacity_factor=capacity_factor)
    carried = dedup_nodes_per_token(num_tokens, num_experts=num_experts, nodes=nodes,
                                    top_k=top_k, max_nodes=max_nodes,
                                    capacity_factor=capacity_factor)
    size = num_experts * c * bytes_per_row
    return cost.choose(size, topology, top_k=top_k, nodes_per_token=carried) == "dedup"


def config_topology(config: Config) -> cost.Topology | None:
    """The cost-model topology a config names (``exchange.topology``), sized to its mesh.

    Args:
        config: a validated config.

    Returns:
        The preset (or topology file) sized to the config's node and device axes, or
        ``None`` (the default topology) when ``exchange.topology`` is null.

    Examples:
        >>> from meshkit.config import load_config
        >>> config_topology(load_config(None, ["exchange.topology=h100-8x400g"])).devices
        8
    """
    if config.exchange.topology is None:
        return None
    shape = config.strategy().shape
    return cost.load_topology(
        config.exchange.topology,
        nodes=math.prod(shape[a] for a in config.node_axes),
        devices_per_node=math.prod(shape[a] for a in config.device_axes),
    )
