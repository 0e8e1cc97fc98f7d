"""Expert-parallel mixture-of-experts layer: router, capacity dispatch, exchange, combine.

One MoE forward pass, per device, inside ``jax.shard_map`` over the current mesh (the one
set by ``jax.set_mesh``; :meth:`MoE.local` is the per-device body the transformer calls
inside its own shard_map):

0. **Split** the device's tokens over the tensor axes, if any: tensor ranks hold the same
   tokens after attention, and each routes and runs only its slice (gathered at the end).
1. **Route** the device's local tokens: softmax router, top-``k`` experts (any ``k`` up
   to ``E``), optionally limited to ``max_nodes`` nodes per token (:func:`route`).
2. **Plan** each assignment's slot in its expert's buffer (:func:`dispatch_plan`): a
   stable sort of the assignments by expert, flattened choice-major, so every first
   choice beats every second choice and earlier tokens beat later ones. Slots at or past
   the per-device capacity ``C`` (:func:`capacity`) are dropped and counted.
3. **Dispatch** by scattering token rows into an ``[E, C, d]`` buffer
   (``dispatch="sort"``), or by GShard's one-hot ``[N, E, C]`` einsum
   (``dispatch="einsum"``, the benchmark baseline; same results).
4. **Exchange**: :func:`meshkit.exchange.two_stage.all_to_all` splits the buffer on the expert
   dimension, so the device holding experts ``[p·E/P, (p+1)·E/P)`` receives
   ``[E/P, P·C, d]``: its experts' slots from every device.
5. **Experts**: each device runs only its ``E/P`` local gated FFNs (SwiGLU).
6. **Return** by the reverse exchange, then **combine**: every token sums its kept
   assignments' outputs weighted by their gates. Dropped assignments add nothing; a token
   with all choices dropped gets 0 here and is carried by the residual connection.
   With ``exchange_dedup=True`` steps 3–6 run through :mod:`meshkit.exchange.dedup` instead:
   each token crosses to each of its nodes once, and its outputs there are summed on
   that node before crossing back. A dropless layer (``capacity_factor=0``) on GPU/TPU
   runs steps 3–6 through :mod:`meshkit.exchange.ragged` instead, which sends only the real rows
   with ``jax.lax.ragged_all_to_all`` (see :meth:`MoE._ragged_op` for when); on CPU,
   which lacks the op, the padded buffers run. The ragged path is verified on CPU
   against an emulation of the op only, not on GPU/TPU hardware.
7. **Shared experts** (``num_shared_experts > 0``, DeepSeekMoE): one dense SwiGLU of
   width ``num_shared_experts · d_ff`` runs on every token and adds to the output.

Expert weights carry ``out_sharding`` metadata from
:class:`meshkit.sharding.rules.ShardingRules` (``P(expert_axes, fsdp_axes, None)``), so
``nnx.get_partition_spec`` (or creating the module under ``jax.set_mesh``) places on each
device exactly its ``E/P`` experts; :func:`shard_model` applies it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from meshkit.choices import DISPATCH_MODES
from meshkit.exchange import cost, ragged
from meshkit.exchange import two_stage as exchange
from meshkit.exchange.capacity import capacity
from meshkit.exchange.dedup import dedup_exchange, distinct_nodes
from meshkit.exchange.slots import _cumsum_plan, dispatch_plan
from meshkit.sharding.params import field_specs, gather_fsdp, normal, param, shard_call
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy.axes import AxisNames

if TYPE_CHECKING:
    from meshkit.config import Config

__all__ = [
    "DISPATCH_MODES",
    "MoE",
    "MoEStats",
    "check_node_limit",
    "config_topology",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "shard_model",
]

M = TypeVar("M", bound=nnx.Module)


# ---------------------------------------------------------------------- pure pieces
def _check_top_k(top_k: Any, num_experts: int) -> int:
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

    Example:
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

    Example:
        >>> idx, gate, probs = route(jnp.array([[0.0, 1.0, 2.0]]), 2)
        >>> idx.tolist()
        [[2, 1]]
        >>> route(jnp.log(jnp.array([[.3, .3, .4, 0.]])), 2, num_nodes=2, max_nodes=1)[0]
        Array([[0, 1]], dtype=int32)
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
    num_experts = logits.shape[1]
    top_k = _check_top_k(top_k, num_experts)
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

    Example:
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

    Example:
        >>> round(float(router_z_loss(jnp.zeros((3, 2)))), 6)  # (ln 2)²
        0.480453
    """
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    z = jnp.mean(lse**2)
    return z if axis_name is None else jax.lax.pmean(z, axis_name)


# ---------------------------------------------------------------------- the layer
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """Routing statistics of one MoE layer over all tokens on the mesh.

    Attributes:
        aux_loss: load-balancing loss (:func:`load_balancing_loss`, global ``f``, ``P``).
        z_loss: router z-loss (:func:`router_z_loss`, mean over all tokens).
        dropped: number of dropped assignments (int32).
        assignments: number of assignments, ``tokens × k`` (int32).
        expert_load: ``[E]`` fraction of all assignments (before dropping) per expert.
        nodes_per_token: mean number of distinct nodes (of the exchange's node axes)
            a token's experts live on: the rows per token the deduplicated exchange
            sends across nodes, against ``k`` for the others.

    A registered pytree, so it passes through ``jax.jit``, ``jax.shard_map`` and
    ``jax.tree`` functions like any tuple of arrays.

    Example:
        >>> stats = MoEStats(aux_loss=jnp.float32(1.0), z_loss=jnp.float32(0.5),
        ...                  dropped=jnp.int32(3), assignments=jnp.int32(16),
        ...                  expert_load=jnp.full(4, 0.25), nodes_per_token=jnp.float32(1.5))
        >>> float(stats.dropped / stats.assignments)  # fraction of assignments dropped
        0.1875
        >>> len(jax.tree.leaves(stats))
        6
    """

    aux_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array
    assignments: jax.Array
    expert_load: jax.Array
    nodes_per_token: jax.Array


def _swiglu(
    buf: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, dtype: Any
) -> jax.Array:
    """Gated FFN per expert: ``(silu(x W_gate) ⊙ x W_up) W_down``; ``buf`` is [E, S, d]."""
    buf = buf.astype(dtype)
    g = jnp.einsum("esd,edf->esf", buf, w_gate.astype(dtype))
    u = jnp.einsum("esd,edf->esf", buf, w_up.astype(dtype))
    return jnp.einsum("esf,efd->esd", jax.nn.silu(g) * u, w_down.astype(dtype))


def _ragged_swiglu(
    rows: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
    w_down: jax.Array, dtype: Any,
) -> jax.Array:
    """:func:`_swiglu` on rows grouped by expert (``[R, d]``, ``group_sizes [E]``).

    ``jax.lax.ragged_dot`` multiplies each group by its expert's matrix; rows past the
    groups come out 0. Chosen over scattering the rows into a padded ``[E, S, d]`` buffer
    for :func:`_swiglu`: the rows arrive grouped already, and the padded buffer would
    bring back the worst-case memory and FLOPs the ragged exchange avoids.
    """
    rows = rows.astype(dtype)
    g = jax.lax.ragged_dot(rows, w_gate.astype(dtype), group_sizes)
    u = jax.lax.ragged_dot(rows, w_up.astype(dtype), group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down.astype(dtype), group_sizes)


class MoE(nnx.Module):
    """Expert-parallel top-k MoE feed-forward layer with SwiGLU experts.

    Mesh axes come from ``rules`` (:class:`meshkit.sharding.rules.ShardingRules`): experts are
    spread over the expert axes ``(*rules.node, *rules.device)``, ``P`` devices in all,
    device ``p`` (row-major over those axes) holding experts ``[p·E/P, (p+1)·E/P)``;
    with no expert axes every device holds every expert and nothing is exchanged. Tokens
    are split over the batch axes and then over the tensor axes (:attr:`rules.token_axes
    <meshkit.sharding.rules.ShardingRules.token_axes>`), so tensor-parallel ranks never route
    or run the same token; capacity is per device. FSDP axes shard every weight on the
    model width. The layer uses the mesh of the enclosing ``jax.set_mesh(mesh)``.

    Args:
        d_model: model width ``d``.
        d_ff: hidden width of each expert ``f``.
        num_experts: ``E``, divisible by the number of expert devices.
        top_k: experts per token, ``1 <= k <= E`` (gates: :func:`route`).
        capacity_factor: per-device capacity is ``ceil(cf · local_tokens · k / E)``;
            0 means dropless (:func:`capacity`). Dropless on GPU/TPU with
            ``dispatch="sort"`` and a flat or ``"auto"`` exchange (not deduplicated)
            sends only the real rows (:mod:`meshkit.exchange.ragged`); otherwise, and always on
            CPU, it exchanges the worst-case padded buffers.
        num_shared_experts: ``S`` shared experts, one dense SwiGLU of hidden width
            ``S · d_ff`` applied to every token (0: none). Its weights are sharded like
            the router: FSDP on the model width, replicated otherwise.
        max_nodes: node-limited routing (:func:`route`): a token's experts lie on at
            most this many nodes (the product of the node axes); ``None``: no limit.
        dispatch: ``"sort"`` (scatter, default) or ``"einsum"`` (GShard one-hot).
        dtype: compute dtype of the experts (parameters and the router stay float32).
        rules: the mesh axes of each role (default: experts over ``node`` × ``device``).
        exchange_method: ``"flat"``, ``"hierarchical"`` or ``"auto"``
            (:func:`meshkit.exchange.two_stage.all_to_all`); used when both node and device axes
            are set, otherwise the one level is a flat all-to-all. ``"auto"`` also
            weighs the deduplicated exchange (:func:`meshkit.exchange.cost.choose` with
            ``nodes_per_token`` at its bound ``min(k, max_nodes, N)``) and runs it when
            predicted fastest (with ``dispatch="sort"``).
        exchange_order: ``"node_first"`` or ``"device_first"``; used when
            ``exchange_method="hierarchical"`` (``auto`` picks ``node_first``).
        exchange_dedup: run the node-deduplicated exchange (:mod:`meshkit.exchange.dedup`)
            instead: a token crosses to a node once however many of its experts live
            there. Needs node and device axes and ``dispatch="sort"``; the exchange
            method and order are then unused.
        topology: :class:`meshkit.exchange.cost.Topology` for ``"auto"`` (``None``: default).
        rngs: ``nnx.Rngs`` for initialisation.

    Raises:
        ValueError: non-positive sizes; ``top_k`` not in ``[1, E]``; a negative
            ``num_shared_experts``; a bad ``max_nodes`` (:func:`check_node_limit`);
            ``exchange_dedup`` without node and device axes or with einsum dispatch; unknown
            ``dispatch``/``exchange_method``/``exchange_order``; and, when a mesh is set
            at construction or call, role axes missing from it or ``E`` not divisible by
            ``P``; at call time, a batch not divisible by the batch devices or no mesh.

    Example::

        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        with jax.set_mesh(mesh):
            moe = MoE(d_model=16, d_ff=32, num_experts=8, rngs=nnx.Rngs(0))
            y, stats = moe(jnp.ones((8, 4, 16)))
    """

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        num_shared_experts: int = 0,
        max_nodes: int | None = None,
        dispatch: str = "sort",
        dtype: Any = jnp.float32,
        rules: ShardingRules | None = None,
        exchange_method: str = "auto",
        exchange_order: str = "node_first",
        exchange_dedup: bool = False,
        topology: cost.Topology | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoE: {name} must be a positive integer, got {value!r}")
        if not capacity_factor >= 0:
            raise ValueError(
                f"MoE: capacity_factor must be >= 0 (0: dropless), got {capacity_factor!r}"
            )
        try:
            self.top_k = _check_top_k(top_k, num_experts)
            check_node_limit(max_nodes, top_k=self.top_k, num_experts=num_experts, num_nodes=1)
        except ValueError as err:
            raise ValueError(f"MoE: {err}") from None
        if (
            isinstance(num_shared_experts, bool)
            or not isinstance(num_shared_experts, int)
            or num_shared_experts < 0
        ):
            raise ValueError(
                f"MoE: num_shared_experts must be an integer >= 0, got {num_shared_experts!r}"
            )
        self.num_shared_experts, self.max_nodes = num_shared_experts, max_nodes
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"MoE: dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
        if exchange_method not in exchange.METHODS:
            raise ValueError(
                f"MoE: exchange_method must be one of {exchange.METHODS}, got {exchange_method!r}"
            )
        if exchange_order not in exchange.ORDERS:
            raise ValueError(
                f"MoE: exchange_order must be one of {exchange.ORDERS}, got {exchange_order!r}"
            )
        self.rules = ShardingRules(node="node", device="device") if rules is None else rules
        if not isinstance(exchange_dedup, bool):
            raise ValueError(f"MoE: exchange_dedup must be True or False, got {exchange_dedup!r}")
        if exchange_dedup and not (self.rules.node and self.rules.device):
            raise ValueError(
                "MoE: exchange_dedup needs both node and device axes, got node="
                f"{self.rules.node}, device={self.rules.device}"
            )
        if exchange_dedup and dispatch != "sort":
            raise ValueError(f"MoE: exchange_dedup needs dispatch='sort', got {dispatch!r}")
        self.exchange_dedup = bool(exchange_dedup)
        self.d_model, self.d_ff, self.num_experts = d_model, d_ff, num_experts
        self.capacity_factor = float(capacity_factor)
        self.exchange_method, self.exchange_order = exchange_method, exchange_order
        self.topology = topology
        self.dispatch = dispatch
        self.dtype = dtype
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            self._check_mesh(mesh)

        e, d, f = num_experts, d_model, d_ff
        spec = self.rules.spec
        # The router is tiny and every device routes its own tokens: replicate it
        # (but for FSDP, which shards every matrix on the model width).
        self.router = param(normal(rngs, (d, e), d), spec("embed", None))
        self.w_gate = param(normal(rngs, (e, d, f), d), spec("experts", "embed", None))
        self.w_up = param(normal(rngs, (e, d, f), d), spec("experts", "embed", None))
        self.w_down = param(normal(rngs, (e, f, d), f), spec("experts", None, "embed"))
        if num_shared_experts:
            # Every device runs the shared expert on its own tokens, so like the router
            # it is replicated (FSDP-sharded on the model width).
            s = num_shared_experts * f
            self.shared_gate = param(normal(rngs, (d, s), d), spec("embed", None))
            self.shared_up = param(normal(rngs, (d, s), d), spec("embed", None))
            self.shared_down = param(normal(rngs, (s, d), s), spec(None, "embed"))

    @classmethod
    def from_config(cls, config: Config, *, rngs: nnx.Rngs) -> MoE:
        """The MoE layer of a config's ``model``, ``parallel`` and ``exchange`` sections.

        Args:
            config: a validated :class:`meshkit.config.Config`.
            rngs: initialisation randomness.

        Returns:
            An unsharded layer (create it inside ``jax.jit`` under the mesh to shard it).

        Example:
            >>> from meshkit.config import Config
            >>> MoE.from_config(Config(), rngs=nnx.Rngs(0)).w_up.shape  # [E, d, f]
            (8, 64, 128)
        """
        m = config.model
        return cls(
            d_model=m.d_model,
            d_ff=m.d_ff,
            num_experts=m.num_experts,
            top_k=m.top_k,
            capacity_factor=m.capacity_factor,
            num_shared_experts=m.num_shared_experts,
            max_nodes=m.max_nodes,
            dispatch=m.dispatch,
            dtype=jnp.dtype(m.dtype),
            rules=ShardingRules.from_config(config),
            exchange_method=config.exchange.method,
            exchange_order=config.exchange.order,
            exchange_dedup=config.exchange.dedup,
            topology=config_topology(config),
            rngs=rngs,
        )

    def _check_mesh(self, mesh: Any) -> int:
        """Validate axes against ``mesh``; return the number of batch devices."""
        try:
            self.rules.check_mesh(mesh.axis_names)
        except ValueError as e:
            raise ValueError(f"MoE: {e}") from None
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        p = math.prod(sizes[a] for a in self.rules.expert_axes)
        if self.num_experts % p:
            raise ValueError(
                f"MoE: num_experts={self.num_experts} is not divisible by the {p} expert "
                f"devices (axes {self.rules.expert_axes})"
            )
        try:
            check_node_limit(self.max_nodes, top_k=self.top_k, num_experts=self.num_experts,
                             num_nodes=math.prod(sizes[a] for a in self.rules.node))
        except ValueError as e:
            raise ValueError(f"MoE: {e} (node axes {self.rules.node})") from None
        return math.prod(sizes[a] for a in self.rules.batch_axes)

    def _exchange(self, x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
        node, device = self.rules.node, self.rules.device
        if not node or not device:
            # One level only: nothing to stage, and meshkit.exchange.two_stage wants both levels.
            return jax.lax.all_to_all(x, (*node, *device), split_axis, concat_axis, tiled=True)
        if self.exchange_method == "hierarchical":
            return exchange.hierarchical_all_to_all(
                x, split_axis, concat_axis, node_axis=node, device_axis=device,
                order=self.exchange_order,
            )
        return exchange.all_to_all(
            x, split_axis, concat_axis, node_axis=node, device_axis=device,
            method=self.exchange_method, topology=self.topology,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Apply the layer.

        Args:
            x: ``[B, T, d]`` activations; ``B`` divisible by the batch devices.

        Returns:
            ``(y [B, T, d] in x.dtype, MoEStats)``; stats are global over the mesh.

        Raises:
            ValueError: no mesh set, mesh/axis mismatch, or bad shapes.

        Example::

            mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
            with jax.set_mesh(mesh):
                moe = nnx.jit(lambda: MoE(d_model=16, d_ff=32, num_experts=8,
                                          rngs=nnx.Rngs(0)))()
                y, stats = moe(jnp.ones((8, 4, 16)))
            y.shape, int(stats.assignments), stats.expert_load.shape
            # ((8, 4, 16), 64, (8,))
        """
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("MoE must be called under `with jax.set_mesh(mesh):`")
        batch_devices = self._check_mesh(mesh)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: x must be [B, T, {self.d_model}], got shape {x.shape}")
        if x.shape[0] % batch_devices:
            raise ValueError(
                f"MoE: batch size {x.shape[0]} is not divisible by the {batch_devices} batch "
                f"devices (axes {self.rules.batch_axes})"
            )
        spec = self.rules.spec("batch", None, None)
        stats_spec = field_specs(MoEStats)
        return shard_call(self, MoE.local, x, arg_specs=[spec], out_specs=(spec, stats_spec))

    def local(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """The per-device body (inside ``jax.shard_map``, parameters as local shards).

        Args:
            x: this device's ``[b, T, d]`` tokens, the same on every tensor rank.

        Returns:
            ``(y [b, T, d], MoEStats)``: ``y`` the same on every tensor rank, the stats
            reduced over every device holding tokens.

        Raises:
            ValueError: ``b·T`` not divisible by the tensor devices.
        """
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        tensor = self.rules.tensor
        if tensor:
            # Each tensor rank routes and runs its own slice of the (replicated) tokens.
            ways = jax.lax.axis_size(tensor)
            if tokens.shape[0] % ways:
                raise ValueError(
                    f"MoE: {tokens.shape[0]} tokens per device cannot be split over the "
                    f"{ways} tensor devices {tensor}"
                )
            n = tokens.shape[0] // ways
            tokens = jax.lax.dynamic_slice_in_dim(tokens, jax.lax.axis_index(tensor) * n, n)
        y, stats = self._route_and_run(tokens)
        if tensor:
            y = jax.lax.all_gather(y, tensor, axis=0, tiled=True, to="invarying")
        return y.reshape(b, t, d).astype(x.dtype), stats

    def _weights(self) -> tuple[jax.Array, ...]:
        fsdp = self.rules.fsdp
        return tuple(
            gather_fsdp(p[...], p.out_sharding, fsdp)
            for p in (self.router, self.w_gate, self.w_up, self.w_down)
        )

    def _shared(self, tokens: jax.Array) -> jax.Array:
        """The shared experts' output ``[n, d]`` (float32) for every token."""
        fsdp = self.rules.fsdp
        gate, up, down = (gather_fsdp(p[...], p.out_sharding, fsdp)[None]
                          for p in (self.shared_gate, self.shared_up, self.shared_down))
        return _swiglu(tokens[None], gate, up, down, self.dtype)[0].astype(jnp.float32)

    def _num_nodes(self) -> int:
        return jax.lax.axis_size(self.rules.node) if self.rules.node else 1

    def _route_and_run(self, tokens: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Route, dispatch, exchange, run the local experts, return and combine."""
        w_router, w_gate, w_up, w_down = self._weights()
        e, k = self.num_experts, self.top_k
        n = tokens.shape[0]
        logits = tokens.astype(jnp.float32) @ w_router
        expert_index, gate, probs = route(logits, k, num_nodes=self._num_nodes(),
                                          max_nodes=self.max_nodes)
        nodes = self._num_nodes()
        if self._dedup(n, tokens.shape[1], tokens.dtype, nodes):
            kn = min(k, self.max_nodes or nodes, nodes)
            factor = self.capacity_factor
            cn = capacity(n, num_experts=nodes, top_k=kn, capacity_factor=factor)
            cf = (capacity(nodes * n, num_experts=e, top_k=k, capacity_factor=factor) if factor
                  else nodes * cn)
            y, dropped = dedup_exchange(
                tokens, expert_index, gate,
                lambda buf: _swiglu(buf, w_gate, w_up, w_down, self.dtype),
                num_experts=e, node_capacity=cn, fanout_capacity=cf,
                node_axes=self.rules.node, device_axes=self.rules.device,
            )
        elif (op := self._ragged_op()) is not None:
            y = ragged.ragged_exchange(
                tokens, expert_index, gate,
                lambda rows, sizes: _ragged_swiglu(rows, sizes, w_gate, w_up, w_down,
                                                   self.dtype),
                num_experts=e, axes=self.rules.expert_axes, all_to_all=op,
            )
            dropped = jnp.zeros((), jnp.int32)  # dropless by construction
        else:
            y, dropped = self._dispatch_and_combine(tokens, expert_index, gate,
                                                    (w_gate, w_up, w_down))
        if self.num_shared_experts:
            y = y + self._shared(tokens)

        axes = self.rules.token_axes
        counts = jnp.bincount(expert_index.reshape(-1), length=e)
        counts = jax.lax.psum(counts, axes)
        assignments = jax.lax.psum(jnp.int32(n * k), axes)
        reached = jnp.sum(distinct_nodes(expert_index, e // nodes), dtype=jnp.int32)
        stats = MoEStats(
            aux_loss=load_balancing_loss(probs, expert_index, axes),
            z_loss=router_z_loss(logits, axes),
            dropped=jax.lax.psum(dropped, axes),
            assignments=assignments,
            expert_load=counts.astype(jnp.float32) / assignments,
            nodes_per_token=(jax.lax.psum(reached, axes) * k).astype(jnp.float32)
            / assignments,
        )
        return y, stats

    def _ragged_op(self) -> ragged.RaggedAllToAll | None:
        """The ragged all-to-all for a dropless layer (:mod:`meshkit.exchange.ragged`), or ``None``.

        ``None`` (the padded path) unless the layer is dropless with ``dispatch="sort"``,
        has expert axes and does not ask for the two-stage exchange (``"hierarchical"``:
        there is no two-stage ragged exchange; ``"auto"`` and ``"flat"`` run the flat
        ragged one), and the mesh's platform implements the op (GPU/TPU, not CPU).
        """
        if (self.capacity_factor or self.dispatch != "sort" or not self.rules.expert_axes
                or self.exchange_method == "hierarchical"):
            return None
        return ragged.ragged_op(jax.sharding.get_abstract_mesh())

    def _dedup(self, n: int, d: int, dtype: Any, nodes: int) -> bool:
        """Whether to run the deduplicated exchange (set, or chosen by ``"auto"``)."""
        if self.exchange_dedup:
            return True
        rules = self.rules
        if (self.exchange_method != "auto" or self.dispatch != "sort"
                or not (rules.node and rules.device)):
            return False
        devices = jax.lax.axis_size(rules.device)
        topology = self.topology or cost.default_topology(nodes, devices)
        c = capacity(n, num_experts=self.num_experts, top_k=self.top_k,
                     capacity_factor=self.capacity_factor)
        bound = min(self.top_k, self.max_nodes or nodes, nodes)
        size = self.num_experts * c * d * jnp.dtype(dtype).itemsize
        return cost.choose(size, topology, top_k=self.top_k, nodes_per_token=bound) == "dedup"

    def _dispatch_and_combine(
        self, tokens: jax.Array, expert_index: jax.Array, gate: jax.Array,
        weights: tuple[jax.Array, jax.Array, jax.Array],
    ) -> tuple[jax.Array, jax.Array]:
        """Capacity dispatch, flat or two-stage exchange, experts, return and combine:
        ``(y [n, d] float32, this device's dropped assignments)``."""
        e, k = self.num_experts, self.top_k
        n, d = tokens.shape
        c = capacity(n, num_experts=e, top_k=k, capacity_factor=self.capacity_factor)

        if self.dispatch == "sort":
            slot, keep = dispatch_plan(expert_index, e, c)
            # Dropped assignments point at slot c, out of bounds, and mode="drop" skips
            # them; kept (expert, slot) pairs are unique, so the scatter is a pure copy.
            flat_e = expert_index.T.reshape(-1)
            flat_s = jnp.where(keep, slot, c).T.reshape(-1)
            rows = jnp.tile(tokens, (k, 1))
            buf = jnp.zeros((e, c, d), tokens.dtype).at[flat_e, flat_s].set(rows, mode="drop")
        else:
            slot = _cumsum_plan(expert_index, e)
            keep = slot < c
            # [N, k, E] x [N, k, C] one-hots summed over k: the GShard dispatch tensor.
            place = jnp.einsum(
                "nke,nkc->nec",
                jax.nn.one_hot(expert_index, e, dtype=jnp.float32),
                jax.nn.one_hot(jnp.where(keep, slot, c), c, dtype=jnp.float32),
            )
            buf = jnp.einsum("nec,nd->ecd", place, tokens.astype(jnp.float32))
            buf = buf.astype(tokens.dtype)

        exchanged = bool(self.rules.expert_axes)
        if exchanged:
            buf = self._exchange(buf, 0, 1)  # [E/P, P·C, d]: my experts, every device's slots
        out = _swiglu(buf, *weights, self.dtype)
        if exchanged:
            out = self._exchange(out, 1, 0)  # [E, C, d] back home
        out = out.astype(jnp.float32)

        weight = jnp.where(keep, gate, 0.0)
        if self.dispatch == "sort":
            rows = out[expert_index, jnp.minimum(slot, c - 1)]  # [N, k, d]
            y = jnp.einsum("nk,nkd->nd", weight, rows)
        else:
            combine = jnp.einsum(
                "nke,nkc->nec",
                jax.nn.one_hot(expert_index, e, dtype=jnp.float32) * weight[..., None],
                jax.nn.one_hot(jnp.where(keep, slot, c), c, dtype=jnp.float32),
            )
            y = jnp.einsum("nec,ecd->nd", combine, out)
        return y, jnp.sum(~keep, dtype=jnp.int32)


def config_topology(config: Config) -> cost.Topology | None:
    """The cost-model topology a config names (``exchange.topology``), sized to its mesh.

    Args:
        config: a validated config.

    Returns:
        The preset (or topology file) sized to the config's node and device axes, or
        ``None`` (the default topology) when ``exchange.topology`` is null.

    Example:
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


def shard_model(model: M, mesh: jax.sharding.Mesh) -> M:
    """Place every parameter of ``model`` by its ``out_sharding`` metadata, in place.

    For a model built without a mesh (or on one device). Under ``jax.set_mesh(mesh)``,
    building the model inside ``nnx.jit`` already yields sharded parameters and this
    call is a no-op copy.

    Args:
        model: an NNX module (e.g. :class:`MoE` or :class:`meshkit.model.transformer.Transformer`).
        mesh: the concrete mesh whose axis names the metadata uses.

    Returns:
        ``model``, its variables now ``jax.Array`` s sharded over ``mesh``: expert
        weights split on dim 0 over the expert axes, everything else replicated.

    Example::

        model = MoE(16, 32, num_experts=8, rngs=nnx.Rngs(0))  # no mesh set
        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        model = shard_model(model, mesh)
        model.w_up[...].addressable_shards[0].data.shape  # [E/P, d, f]
        # (1, 16, 32)
    """
    state = nnx.state(model)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    nnx.update(model, jax.device_put(state, shardings))
    return model
