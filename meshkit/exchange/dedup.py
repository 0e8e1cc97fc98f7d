"""Node-deduplicated MoE exchange: each token crosses to a node once, and back once.

The flat and the two-stage exchange send a token across the inter-node network once
per chosen expert. With fine-grained experts (``k`` of 4–8) many of a token's experts
share a node, so the same row crosses the slow link several times. This module runs the
MoE exchange so that it crosses **once per (token, destination node)**, as DeepEP does
in CUDA, here over named mesh axes with public JAX collectives only. Per device, inside
``jax.shard_map`` (``N`` nodes of ``M`` devices, ``E`` experts, ``E/N`` per node, ``n``
tokens here, ``k`` experts per token):

1. **Node plan.** Each token lists its distinct destination nodes in the order its
   choices first reach them (at most ``kn = min(k, max_nodes or N, N)``). One row per
   (token, node) gets a slot in that node's buffer by :func:`meshkit.exchange.slots.dispatch_plan`
   (choice-major: every token's first node beats any token's second), node capacity
   ``Cn = min(ceil(capacity_factor · n · kn / N), n)``
   (:func:`meshkit.exchange.capacity.capacity`: a token crosses to a node at most once,
   so ``n`` rows never drop; ``n`` when dropless). Each row carries its routing for that
   node: the node-local expert id and gate of each of the token's ``k`` choices (``E/N``
   and 0 for a choice elsewhere).
2. **Node stage.** One all-to-all over the node axes, between devices with the same
   local index, moves ``[N, Cn, d]`` rows with their ``2k`` float32 metadata as extra
   columns (``[N, Cn, d + 2k]``: one message per peer, not two; with other token dtypes
   the metadata goes in an all-to-all of its own, so no gate is rounded).
3. **Fan-out.** The receiving device plans its ``N·Cn`` rows' assignments into its
   node's ``E/N`` experts (capacity ``Cf = ceil(capacity_factor · N·n · k / E)``, or
   ``N·Cn`` when dropless) and one all-to-all over the device axes delivers them to the
   experts' devices, which run their SwiGLUs.
4. **Combine**, in reverse: the device stage brings each expert's output back to the
   row's device, which sums the row's gate-weighted outputs — the partial output of that
   token on that node — and the reverse node stage returns **one** row per (token, node);
   the token adds its rows.

Each buffer is filled by **one gather** from its source rows (the node buffer from the
tokens, the fan-out buffer from the received rows), its index built by a scatter of
integers: no ``[n, kn, d]`` broadcast of the tokens and no ``k`` copies of the received
rows are materialised, and a gather's transpose (the backward pass) is one scatter-add.

Gradients come from autodiff through the same collectives (an all-to-all's transpose
is an all-to-all), the gates' included: they travel as metadata and are applied on the
expert's node. With nothing dropped the result equals the non-deduplicated exchange.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshkit.exchange.capacity import capacity
from meshkit.exchange.dispatch import (
    DispatchContext,
    Dispatcher,
    ExpertBatch,
    Routing,
    check_routing,
)
from meshkit.exchange.slots import dispatch_plan
from meshkit.strategy.axes import AxisNames, axis_names

__all__ = ["DedupDispatcher", "distinct_nodes"]



def distinct_nodes(expert_index: jax.Array, experts_per_node: int) -> jax.Array:
    """Which of each token's choices is the first to reach its node.

    Args:
        expert_index: ``[n, k]`` expert ids; node ``i`` holds experts
            ``[i·experts_per_node, (i+1)·experts_per_node)``.
        experts_per_node: ``E/N``.

    Returns:
        ``[n, k]`` bool; its row sums are the tokens' numbers of distinct nodes.

    Examples:
        >>> distinct_nodes(jnp.array([[0, 1, 5], [4, 6, 7]]), 4).tolist()
        [[True, False, True], [True, False, False]]
    """
    node = expert_index // experts_per_node
    k = node.shape[1]
    same = node[:, :, None] == node[:, None, :]  # [n, j, i]: choice j's node == choice i's
    earlier = jnp.tril(jnp.ones((k, k), jnp.bool_), -1)  # i < j
    return ~jnp.any(same & earlier, axis=-1)


def _gather_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
    """``rows[index]``, where an index equal to ``len(rows)`` gives a row of zeros.

    Out-of-bounds gathers are filled with zeros (``mode="fill"``), so no padded copy of
    ``rows`` is made; the backward pass scatter-adds into ``rows`` and drops the rest.
    """
    return rows.at[index].get(mode="fill", fill_value=0)


def _sizes(axes: AxisNames) -> int:
    return jax.lax.axis_size(tuple(axes))


@dataclasses.dataclass(frozen=True)
class _DedupContext(DispatchContext):
    node_choice: jax.Array  # [n, kn] each token's r-th distinct node (N: none)
    node_slot: jax.Array  # [n, kn] its row's slot in that node's buffer
    node_keep: jax.Array  # [n, kn] whether the row fitted
    row_expert: jax.Array  # [R, k] each received row's node-local experts (E/N: none)
    row_gate: jax.Array  # [R, k] and gates
    slot: jax.Array  # [R, k] each (row, choice)'s slot in its expert's fan-out buffer
    keep: jax.Array  # [R, k] whether it fitted
    fanout_capacity: int


class DedupDispatcher(Dispatcher[_DedupContext]):
    """The node-deduplicated exchange (module docstring) as a :class:`Dispatcher`.

    Capacities come from :func:`meshkit.exchange.capacity.capacity` on this device's
    ``n`` tokens: ``Cn`` rows per destination node for ``kn = min(k, max_nodes or N, N)``
    nodes per token, and ``Cf`` slots per node-local expert for the ``N·n`` tokens a
    device's node stage can deliver (``N·Cn`` when dropless).

    Args:
        num_experts: ``E``, divisible by the ``N·M`` devices.
        capacity_factor: as :func:`meshkit.exchange.capacity.capacity` (0: dropless).
        node_axes: the node mesh axes (outer stage).
        device_axes: the device mesh axes (inner stage).
        max_nodes: the routing's node limit (``None``: none); it bounds ``kn``.

    Raises:
        ValueError: no node or no device axes (here); at dispatch, ``E`` not divisible
            by the ``N·M`` devices or mismatched shapes.

    Example::

        dedup = DedupDispatcher(num_experts=16, capacity_factor=1.25,
                                node_axes="node", device_axes="device")
        batch, context = dedup.dispatch(tokens, Routing(expert_index, gate))  # shard_map
        y = dedup.combine(run_local_experts(batch), context)
    """

    def __init__(
        self, *, num_experts: int, capacity_factor: float, node_axes: AxisNames,
        device_axes: AxisNames, max_nodes: int | None = None,
    ) -> None:
        if not node_axes or not device_axes:
            raise ValueError(f"DedupDispatcher needs node and device axes, got {node_axes!r}, "
                             f"{device_axes!r}")
        self.node_axes = axis_names(node_axes, "node_axes", required=True)
        self.device_axes = axis_names(device_axes, "device_axes", required=True)
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.max_nodes = max_nodes

    def dispatch(self, x: jax.Array, routing: Routing) -> tuple[ExpertBatch, _DedupContext]:
        check_routing(x, routing, "DedupDispatcher")
        tokens, expert_index, gate = x, routing.expert_index, routing.gate
        nodes, per_node_devices = _sizes(self.node_axes), _sizes(self.device_axes)
        num_experts = self.num_experts
        if num_experts % (nodes * per_node_devices):
            raise ValueError(f"num_experts={num_experts} is not divisible by the "
                             f"{nodes}×{per_node_devices} devices")
        per_node = num_experts // nodes
        n, d = tokens.shape
        k = expert_index.shape[1]
        factor = self.capacity_factor
        cn = capacity(n, num_experts=nodes, top_k=min(k, self.max_nodes or nodes, nodes),
                      capacity_factor=factor)
        cf = (capacity(nodes * n, num_experts=num_experts, top_k=k, capacity_factor=factor)
              if factor else nodes * cn)

        # 1. Node plan: token t's r-th distinct node, N (= nowhere) past its last one.
        node_of = expert_index // per_node  # [n, k]
        first = distinct_nodes(expert_index, per_node)
        kn = min(k, nodes)
        rank = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
        rows_t = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
        node_choice = jnp.full((n, kn), nodes, jnp.int32).at[
            rows_t, jnp.where(first, rank, kn)].set(node_of, mode="drop")
        node_slot, node_keep = dispatch_plan(node_choice, nodes + 1, cn)
        node_keep &= node_choice < nodes
        # Each row's routing on its node: local expert id (per_node = none) and gate.
        here = node_of[:, None, :] == node_choice[:, :, None]  # [n, kn, k]
        local_id = jnp.where(here, (expert_index % per_node)[:, None, :], per_node)
        local_gate = jnp.where(here, gate[:, None, :], 0.0)
        meta = jnp.concatenate(
            [jax.lax.stop_gradient(local_id.astype(jnp.float32)), local_gate.astype(jnp.float32)],
            axis=-1,
        )  # [n, kn, 2k]
        dest = jnp.where(node_keep, node_choice, nodes)  # out of bounds: dropped by mode="drop"
        # Which (token, r) row each slot of the node buffer holds (n·kn: none), then one
        # gather each for the tokens and their metadata.
        pair = jnp.full((nodes, cn), n * kn, jnp.int32).at[dest, node_slot].set(
            jnp.arange(n * kn, dtype=jnp.int32).reshape(n, kn), mode="drop")
        send = _gather_rows(tokens, pair // kn)  # [N, Cn, d]; row n: zeros
        empty = jnp.concatenate([jnp.full((k,), per_node, jnp.float32), jnp.zeros((k,))])
        send_meta = jnp.concatenate([meta.reshape(n * kn, 2 * k), empty[None]])[pair]

        # 2. Node stage: my rows for node i go to (i, my local index).
        node_axes, device_axes = self.node_axes, self.device_axes
        if tokens.dtype == jnp.float32:  # one message per peer: rows and metadata together
            both = jax.lax.all_to_all(jnp.concatenate([send, send_meta], axis=-1), node_axes,
                                      0, 0, tiled=True).reshape(nodes * cn, d + 2 * k)
            recv, recv_meta = both[:, :d], both[:, d:]
        else:
            recv = jax.lax.all_to_all(send, node_axes, 0, 0, tiled=True).reshape(nodes * cn, d)
            recv_meta = jax.lax.all_to_all(send_meta, node_axes, 0, 0, tiled=True)
            recv_meta = recv_meta.reshape(nodes * cn, 2 * k)
        row_expert = jax.lax.stop_gradient(recv_meta[:, :k]).astype(jnp.int32)  # E/N: none
        row_gate = recv_meta[:, k:]

        # 3. Fan-out to this node's experts, over the device axes: which row each slot
        # holds (R: none), then one gather.
        slot, keep = dispatch_plan(row_expert, per_node + 1, cf)
        real = row_expert < per_node
        keep &= real
        rows_r = recv.shape[0]
        source = jnp.full((per_node, cf), rows_r, jnp.int32).at[
            jnp.where(keep, row_expert, per_node), slot].set(
            jnp.broadcast_to(jnp.arange(rows_r, dtype=jnp.int32)[:, None], (rows_r, k)),
            mode="drop")
        buf = _gather_rows(recv, source)  # [E/N, Cf, d]
        buf = jax.lax.all_to_all(buf, device_axes, 0, 1, tiled=True)  # [E/P, M·Cf, d]

        # Dropped: assignments whose row missed its node here, plus fan-out misses there.
        row_of = jnp.argmax(node_choice[:, None, :] == node_of[:, :, None], axis=-1)  # [n, k]
        row_dropped = ~jnp.take_along_axis(node_keep, row_of, axis=1)
        dropped = jnp.sum(row_dropped, dtype=jnp.int32) + jnp.sum(real & ~keep, dtype=jnp.int32)
        context = _DedupContext(
            dropped=dropped, node_choice=node_choice, node_slot=node_slot,
            node_keep=node_keep, row_expert=row_expert, row_gate=row_gate, slot=slot,
            keep=keep, fanout_capacity=cf,
        )
        return ExpertBatch(buf), context

    def combine(self, expert_outputs: jax.Array, context: _DedupContext) -> jax.Array:
        nodes = _sizes(self.node_axes)
        per_node = self.num_experts // nodes
        cf = context.fanout_capacity
        out = jax.lax.all_to_all(expert_outputs, self.device_axes, 1, 0, tiled=True)
        out = out.astype(jnp.float32)

        # 4. Combine: sum each row's weighted outputs on the node, send one row back.
        row_expert, slot = context.row_expert, context.slot
        weight = jnp.where(context.keep, context.row_gate, 0.0)
        picked = out[jnp.minimum(row_expert, per_node - 1), jnp.minimum(slot, cf - 1)]
        d = out.shape[-1]
        partial = jnp.einsum("rk,rkd->rd", weight, picked).reshape(nodes, -1, d)
        cn = partial.shape[1]
        back = jax.lax.all_to_all(partial, self.node_axes, 0, 0, tiled=True)  # [N, Cn, d] home
        node_choice = context.node_choice
        rows = back[jnp.minimum(node_choice, nodes - 1), jnp.minimum(context.node_slot, cn - 1)]
        return jnp.einsum("nr,nrd->nd", context.node_keep.astype(jnp.float32), rows)
