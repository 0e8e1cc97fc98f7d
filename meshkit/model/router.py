"""The MoE router: softmax top-``k`` routing, node limits, and the router losses.

Examples:
    >>> idx, gate, probs = route(jnp.array([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0]]), 1)
    >>> idx[:, 0].tolist(), round(float(load_balancing_loss(probs, idx)), 4)
    ([2, 0], 1.2489)
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from meshkit.strategy.axes import AxisNames

__all__ = [
    "Router",
    "check_node_limit",
    "check_router_output",
    "check_top_k",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]


class Router(Protocol):
    """A router of one's own for :class:`meshkit.model.moe.MoE` (its ``router=``).

    Called per device inside ``jax.shard_map`` on that device's ``[n, d]`` tokens, it
    returns what :func:`route` does: ``(expert_index [n, k] int, gate [n, k], probs
    [n, E])``. The experts are laid out node-major (device ``p`` of the expert axes holds
    experts ``[p·E/P, (p+1)·E/P)``); ``probs`` feeds the load-balancing loss. An
    ``nnx.Module`` router's parameters are sharded by their ``out_sharding`` metadata
    (replicated without it) and FSDP-gathered before the call.

    Example::

        class TopK(nnx.Module):
            def __init__(self, d, e, k, rngs):
                self.w, self.k = nnx.Param(jax.random.normal(rngs.params(), (d, e))), k

            def __call__(self, tokens):
                probs = jax.nn.softmax(tokens @ self.w[...])
                gate, index = jax.lax.top_k(probs, self.k)
                return index, gate / gate.sum(-1, keepdims=True), probs
    """

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]: ...


def check_router_output(
    output: Any, *, num_tokens: int, top_k: int, num_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Check what a :class:`Router` returned; return it as ``(expert_index int32, gate, probs)``.

    Args:
        output: the router's return value.
        num_tokens: ``n``, the tokens routed.
        top_k: ``k`` the layer was configured with.
        num_experts: ``E``.

    Returns:
        ``(expert_index [n, k] int32, gate [n, k], probs [n, E])``.

    Raises:
        ValueError: not a 3-tuple, a non-integer ``expert_index``, or a shape other
            than those above (the message names the array and both shapes).

    Examples:
        >>> index, gate, probs = check_router_output(
        ...     (jnp.zeros((3, 2), int), jnp.ones((3, 2)), jnp.ones((3, 8))),
        ...     num_tokens=3, top_k=2, num_experts=8)
        >>> index.dtype
        dtype('int32')
        >>> check_router_output((jnp.zeros((3, 1), int), jnp.ones((3, 1)), jnp.ones((3, 8))),
        ...                     num_tokens=3, top_k=2, num_experts=8)
        Traceback (most recent call last):
        ...
        ValueError: router: expert_index must be [3, 2] (tokens, top_k), got shape (3, 1)
    """
    if not isinstance(output, tuple | list) or len(output) != 3:
        got = (f"{len(output)} values" if isinstance(output, tuple | list)
               else type(output).__name__)
        raise ValueError(f"router: must return (expert_index, gate, probs), got {got}")
    index, gate, probs = (jnp.asarray(a) for a in output)
    want = {"expert_index": (index, (num_tokens, top_k), "tokens, top_k"),
            "gate": (gate, (num_tokens, top_k), "tokens, top_k"),
            "probs": (probs, (num_tokens, num_experts), "tokens, num_experts")}
    for name, (array, shape, dims) in want.items():
        if array.shape != shape:
            raise ValueError(
                f"router: {name} must be [{', '.join(map(str, shape))}] ({dims}), got shape "
                f"{array.shape}"
            )
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"router: expert_index must hold integers, got {index.dtype}")
    return index.astype(jnp.int32), gate, probs


def check_top_k(top_k: Any, num_experts: int) -> int:
    """Validate ``top_k`` against ``num_experts``; return it as an int.

    Args:
        top_k: experts per token.
        num_experts: ``E``.

    Returns:
        ``top_k`` as an int.

    Raises:
        ValueError: ``top_k`` not an integer in ``[1, num_experts]``.

    Examples:
        >>> check_top_k(2, 8)
        2
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    return int(top_k)


def check_node_limit(
    max_nodes: Any, *, top_k: int, num_experts: int, num_nodes: int
) -> int | None:
    """Validate ``max_nodes`` for node-limited routing; return it, or ``None`` if no limit.

    Args:
        max_nodes: nodes one token may reach (``None``: unlimited).
        top_k: experts per token.
        num_experts: ``E``, split evenly over ``num_nodes`` nodes.
        num_nodes: ``N``, the product of the exchange's node axes' sizes.

    Returns:
        ``max_nodes`` as an int, or ``None`` when it is ``None`` or ``>= num_nodes``
        (no limit then).

    Raises:
        ValueError: ``max_nodes`` not an int >= 1, ``E`` not divisible by ``N``, or the
            kept nodes holding fewer than ``top_k`` experts.

    Examples:
        >>> check_node_limit(2, top_k=8, num_experts=16, num_nodes=4)
        2
        >>> check_node_limit(1, top_k=8, num_experts=16, num_nodes=4)
        Traceback (most recent call last):
        ...
        ValueError: max_nodes=1 node(s) of 4 experts each hold fewer than top_k=8 experts
    """
    if max_nodes is None:
        return None
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an integer >= 1 or None, got {max_nodes!r}")
    if num_experts % num_nodes:
        raise ValueError(f"num_experts={num_experts} is not divisible by {num_nodes} nodes")
    per_node = num_experts // num_nodes
    if min(max_nodes, num_nodes) * per_node < top_k:
        raise ValueError(
            f"max_nodes={max_nodes} node(s) of {per_node} experts each hold fewer than "
            f"top_k={top_k} experts"
        )
    return None if max_nodes >= num_nodes else max_nodes


def route(
    logits: jax.Array, top_k: int, *, num_nodes: int = 1, max_nodes: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax router with top-``k`` selection, optionally node-limited (DeepSeek-V3).

    Experts are laid out node-major: node ``n`` holds experts ``[n·E/N, (n+1)·E/N)``.
    With ``max_nodes`` set, each token

    1. scores every node by the sum of its experts' top ``ceil(k / max_nodes)``
       probabilities (at most ``E/N`` of them);
    2. keeps the ``max_nodes`` best nodes (ties: the lower node);
    3. chooses its top-``k`` experts among those nodes' experts only.

    Gates are the chosen experts' softmax probabilities (over all ``E`` experts). With
    ``k = 1`` the gate is that probability as is (Switch: the router still gets a
    gradient through it); with ``k >= 2`` the ``k`` gates are renormalised to sum to 1
    (as GShard's top-2 and DeepSeek-V3's normalised top-k), so the output's scale does
    not shrink as ``k`` grows.

    Args:
        logits: router logits ``[N_tokens, E]`` (computed in float32 by :class:`MoE`).
        top_k: experts per token, ``1 <= k <= E``.
        num_nodes: ``N``, the number of nodes the experts are split over.
        max_nodes: nodes a token may reach (``None``: any); see
            :func:`check_node_limit`.

    Returns:
        ``(expert_index [N_tokens, k] int32, gate [N_tokens, k] float32, probs
        [N_tokens, E] float32)``; column ``j`` is each token's ``(j+1)``-th choice, in
        decreasing probability.

    Raises:
        ValueError: ``top_k`` not an int in ``[1, E]``; ``logits`` not 2-d; a bad
            ``max_nodes`` (:func:`check_node_limit`).

    Examples:
        >>> idx, gate, probs = route(jnp.array([[0.0, 1.0, 2.0]]), 2)
        >>> idx.tolist()
        [[2, 1]]
        >>> route(jnp.log(jnp.array([[.3, .3, .4, 0.]])), 2, num_nodes=2, max_nodes=1)[0]
        Array([[0, 1]], dtype=int32)
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
    num_experts = logits.shape[1]
    top_k = check_top_k(top_k, num_experts)
    max_nodes = check_node_limit(
        max_nodes, top_k=top_k, num_experts=num_experts, num_nodes=num_nodes
    )
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    candidates = probs
    if max_nodes is not None:
        n = probs.shape[0]
        per_node = num_experts // num_nodes
        grouped = probs.reshape(n, num_nodes, per_node)
        best = min(per_node, -(-top_k // max_nodes))
        node_score = jnp.sum(jax.lax.top_k(grouped, best)[0], axis=-1)  # [n, N]
        _, kept = jax.lax.top_k(node_score, max_nodes)
        allowed = jnp.any(jax.nn.one_hot(kept, num_nodes, dtype=jnp.bool_), axis=1)
        # Probabilities are >= 0, so -1 ranks every expert of a dropped node last.
        candidates = jnp.where(jnp.repeat(allowed, per_node, axis=1), probs, -1.0)
    gate, expert_index = jax.lax.top_k(candidates, top_k)
    if top_k >= 2:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    return expert_index.astype(jnp.int32), gate, probs


def _balance_terms(probs: jax.Array, expert_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    num_experts = probs.shape[-1]
    f = jnp.mean(jax.nn.one_hot(expert_index[:, 0], num_experts, dtype=jnp.float32), axis=0)
    return f, jnp.mean(probs.astype(jnp.float32), axis=0)


def load_balancing_loss(
    probs: jax.Array, expert_index: jax.Array, axis_name: AxisNames | None = None
) -> jax.Array:
    """Switch Transformer load-balancing loss ``E · Σ_e f_e · P_e``.

    ``f_e`` is the fraction of tokens whose *first* choice (top-1 assignment, column 0)
    is expert ``e``; ``P_e`` is the mean router probability of ``e``. It is 1 for a
    perfectly balanced router and ``E`` when one expert takes everything; its gradient
    flows through ``P`` only.

    Args:
        probs: router probabilities ``[N, E]``.
        expert_index: ``[N, k]`` expert ids from :func:`route`.
        axis_name: mesh axes (inside ``jax.shard_map``) over which ``f`` and ``P`` are
            averaged first, so the loss is that of all tokens on those axes (each device
            must hold the same number of tokens). ``None``: these tokens only.

    Returns:
        A float32 scalar.

    Examples:
        >>> probs = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
        >>> idx = jnp.array([[0], [0], [1], [0]])
        >>> round(float(load_balancing_loss(probs, idx)), 6)  # 2·(.75·.6 + .25·.4)
        1.1
    """
    f, p = _balance_terms(probs, expert_index)
    if axis_name is not None:
        f, p = jax.lax.pmean((f, p), axis_name)
    return probs.shape[-1] * jnp.sum(f * p)


def router_z_loss(logits: jax.Array, axis_name: AxisNames | None = None) -> jax.Array:
    """Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)²``.

    Args:
        logits: router logits ``[N, E]``.
        axis_name: mesh axes to average over as well (inside ``jax.shard_map``).

    Returns:
        A float32 scalar.

    Examples:
        >>> round(float(router_z_loss(jnp.zeros((3, 2)))), 6)  # (ln 2)²
        0.480453
    """
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    z = jnp.mean(lse**2)
    return z if axis_name is None else jax.lax.pmean(z, axis_name)
