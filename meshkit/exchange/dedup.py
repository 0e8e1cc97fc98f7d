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
   ``Cn = ceil(capacity_factor · n · kn / N)`` (:func:`meshkit.exchange.capacity.capacity`; ``n``
   when dropless). Each row carries its routing for that node: the node-local expert id
   and gate of each of the token's ``k`` choices (``E/N`` and 0 for a choice elsewhere).
2. **Node stage.** One all-to-all over the node axes, between devices with the same
   local index, moves ``[N, Cn, d]`` rows and ``[N, Cn, 2k]`` float32 metadata.
3. **Fan-out.** The receiving device plans its ``N·Cn`` rows' assignments into its
   node's ``E/N`` experts (capacity ``Cf = ceil(capacity_factor · N·n · k / E)``, or
   ``N·Cn`` when dropless) and one all-to-all over the device axes delivers them to the
   experts' devices, which run their SwiGLUs.
4. **Combine**, in reverse: the device stage brings each expert's output back to the
   row's device, which sums the row's gate-weighted outputs — the partial output of that
   token on that node — and the reverse node stage returns **one** row per (token, node);
   the token adds its rows.

Gradients come from autodiff through the same collectives (an all-to-all's transpose
is an all-to-all), the gates' included: they travel as metadata and are applied on the
expert's node. With nothing dropped the result equals the non-deduplicated exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshkit.exchange.slots import dispatch_plan
from meshkit.strategy.axes import AxisNames

__all__ = ["dedup_exchange", "distinct_nodes"]



def distinct_nodes(expert_index: jax.Array, experts_per_node: int) -> jax.Array:
    """Which of each token's choices is the first to reach its node.

    Args:
        expert_index: ``[n, k]`` expert ids; node ``i`` holds experts
            ``[i·experts_per_node, (i+1)·experts_per_node)``.
        experts_per_node: ``E/N``.

    Returns:
        ``[n, k]`` bool; its row sums are the tokens' numbers of distinct nodes.

    Example:
        >>> distinct_nodes(jnp.array([[0, 1, 5], [4, 6, 7]]), 4).tolist()
        [[True, False, True], [True, False, False]]
    """
    node = expert_index // experts_per_node
    k = node.shape[1]
    same = node[:, :, None] == node[:, None, :]  # [n, j, i]: choice j's node == choice i's
    earlier = jnp.tril(jnp.ones((k, k), jnp.bool_), -1)  # i < j
    return ~jnp.any(same & earlier, axis=-1)


def _sizes(axes: AxisNames) -> int:
    return jax.lax.axis_size(tuple(axes))


def dedup_exchange(
    tokens: jax.Array,
    expert_index: jax.Array,
    gate: jax.Array,
    experts: Callable[[jax.Array], jax.Array],
    *,
    num_experts: int,
    node_capacity: int,
    fanout_capacity: int,
    node_axes: AxisNames,
    device_axes: AxisNames,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch, run and combine one device's tokens through the deduplicated exchange.

    Must run inside ``jax.shard_map`` with ``node_axes`` and ``device_axes`` manual.
    The steps are in this module's docstring.

    Args:
        tokens: ``[n, d]`` this device's tokens.
        expert_index: ``[n, k]`` int expert ids (node-major layout, as
            :func:`meshkit.model.moe.route` returns).
        gate: ``[n, k]`` float gates.
        experts: runs this device's ``E/P`` experts on ``[E/P, S, d]`` rows, returning
            ``[E/P, S, d]``.
        num_experts: ``E``.
        node_capacity: ``Cn``, rows per destination node (from each device).
        fanout_capacity: ``Cf``, slots per node-local expert (from each device).
        node_axes: the node mesh axes (outer stage).
        device_axes: the device mesh axes (inner stage).

    Returns:
        ``(y [n, d] float32, dropped int32)``: the gate-weighted sum of each token's kept
        assignments, and this device's share of dropped assignments (those whose row
        missed the node capacity, counted here; those that missed an expert slot on
        arrival, counted where they arrived), so the sum over all devices is the total.

    Raises:
        ValueError: ``E`` not divisible by the ``N·M`` devices, or no node/device axes.

    Example::

        y, dropped = dedup_exchange(tokens, idx, gate, run_local_experts, num_experts=16,
                                    node_capacity=8, fanout_capacity=8,
                                    node_axes=("node",), device_axes=("device",))
    """
    if not node_axes or not device_axes:
        raise ValueError(f"dedup_exchange needs node and device axes, got {node_axes!r}, "
                         f"{device_axes!r}")
    nodes, per_node_devices = _sizes(node_axes), _sizes(device_axes)
    if num_experts % (nodes * per_node_devices):
        raise ValueError(f"num_experts={num_experts} is not divisible by the "
                         f"{nodes}×{per_node_devices} devices")
    per_node = num_experts // nodes
    n, d = tokens.shape
    k = expert_index.shape[1]
    cn, cf = node_capacity, fanout_capacity

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
    send = jnp.zeros((nodes, cn, d), tokens.dtype).at[dest, node_slot].set(
        jnp.broadcast_to(tokens[:, None, :], (n, kn, d)), mode="drop")
    empty = jnp.concatenate([jnp.full((k,), per_node, jnp.float32), jnp.zeros((k,))])
    send_meta = jnp.broadcast_to(empty, (nodes, cn, 2 * k)).at[dest, node_slot].set(
        meta, mode="drop")

    # 2. Node stage: my rows for node i go to (i, my local index).
    node_axes, device_axes = tuple(node_axes), tuple(device_axes)
    recv = jax.lax.all_to_all(send, node_axes, 0, 0, tiled=True).reshape(nodes * cn, d)
    recv_meta = jax.lax.all_to_all(send_meta, node_axes, 0, 0, tiled=True)
    recv_meta = recv_meta.reshape(nodes * cn, 2 * k)
    row_expert = recv_meta[:, :k].astype(jnp.int32)  # [R, k], per_node = none
    row_gate = recv_meta[:, k:]

    # 3. Fan-out to this node's experts, over the device axes.
    slot, keep = dispatch_plan(row_expert, per_node + 1, cf)
    real = row_expert < per_node
    keep &= real
    flat_e = jnp.where(keep, row_expert, per_node).T.reshape(-1)
    flat_s = slot.T.reshape(-1)
    buf = jnp.zeros((per_node, cf, d), tokens.dtype).at[flat_e, flat_s].set(
        jnp.tile(recv, (k, 1)), mode="drop")
    buf = jax.lax.all_to_all(buf, device_axes, 0, 1, tiled=True)  # [E/P, M·Cf, d]
    out = experts(buf)
    out = jax.lax.all_to_all(out, device_axes, 1, 0, tiled=True).astype(jnp.float32)

    # 4. Combine: sum each row's weighted outputs on the node, send one row back.
    weight = jnp.where(keep, row_gate, 0.0)
    picked = out[jnp.minimum(row_expert, per_node - 1), jnp.minimum(slot, cf - 1)]  # [R, k, d]
    partial = jnp.einsum("rk,rkd->rd", weight, picked).reshape(nodes, cn, d)
    back = jax.lax.all_to_all(partial, node_axes, 0, 0, tiled=True)  # [N, Cn, d] home
    rows = back[jnp.minimum(node_choice, nodes - 1), jnp.minimum(node_slot, cn - 1)]
    y = jnp.einsum("nr,nrd->nd", node_keep.astype(jnp.float32), rows)

    # Dropped: assignments whose row missed its node here, plus fan-out misses there.
    row_of = jnp.argmax(node_choice[:, None, :] == node_of[:, :, None], axis=-1)  # [n, k]
    row_dropped = ~jnp.take_along_axis(node_keep, row_of, axis=1)
    dropped = jnp.sum(row_dropped, dtype=jnp.int32) + jnp.sum(real & ~keep, dtype=jnp.int32)
    return y, dropped
