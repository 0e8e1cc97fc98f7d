"""Expert-parallel mixture-of-experts layer: router → dispatcher → experts → combine.

One MoE forward pass, per device, inside ``jax.shard_map`` over the current mesh (the one
set by ``jax.set_mesh``; :meth:`MoE.local` is the per-device body the transformer calls
inside its own shard_map):

0. **Split** the device's tokens over the tensor axes, if any: tensor ranks hold the same
   tokens after attention, and each routes and runs only its slice (gathered at the end).
1. **Route** the device's local tokens (:mod:`meshkit.model.router`): softmax router,
   top-``k`` experts, optionally limited to ``max_nodes`` nodes per token.
2. **Dispatch**: the :class:`meshkit.exchange.dispatch.Dispatcher` that
   :func:`meshkit.model.dispatchers.make_dispatcher` picks (flat, two-stage,
   node-deduplicated or ragged) sends each token's rows to its experts' devices and
   returns an :class:`~meshkit.exchange.dispatch.ExpertBatch`: rows per local expert,
   padded to a capacity or grouped with sizes.
3. **Experts**: each device runs only its ``E/P`` local gated FFNs (SwiGLU) on the batch.
4. **Combine**: the same dispatcher brings the outputs home; every token sums its kept
   assignments' outputs weighted by their gates. Dropped assignments add nothing; a token
   with all choices dropped gets 0 here and is carried by the residual connection.
5. **Shared experts** (``num_shared_experts > 0``, DeepSeekMoE): one dense SwiGLU of
   width ``num_shared_experts · d_ff`` runs on every token and adds to the output.

Expert weights carry ``out_sharding`` metadata from
:class:`meshkit.sharding.rules.ShardingRules` (``P(expert_axes, fsdp_axes, None)``), so
``nnx.get_partition_spec`` (or creating the module under ``jax.set_mesh``) places on each
device exactly its ``E/P`` experts; :func:`meshkit.sharding.place.shard_model` applies it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit.choices import DISPATCH_MODES
from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange import cost
from meshkit.exchange.dedup import distinct_nodes
from meshkit.exchange.dispatch import ExpertBatch, Routing
from meshkit.model.dispatchers import config_topology, make_dispatcher
from meshkit.model.router import (
    check_node_limit,
    load_balancing_loss,
    route,
    router_z_loss,
)
from meshkit.sharding.params import field_specs, gather_fsdp, normal, param, shard_call
from meshkit.sharding.rules import ShardingRules

if TYPE_CHECKING:
    from meshkit.config import Config

# DISPATCH_MODES: the layer's accepted ``model.dispatch`` values (one list, in choices).
__all__ = ["DISPATCH_MODES", "MoE", "MoEStats"]

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

    Every size and choice comes from the config sections, whose defaults and field
    checks live there (:class:`meshkit.config.ModelConfig`,
    :class:`meshkit.config.ExchangeConfig`); the layer checks only what depends on the
    rules and the mesh. The exchange behind the layer is one
    :class:`meshkit.exchange.dispatch.Dispatcher`, chosen per call by
    :func:`meshkit.model.dispatchers.make_dispatcher` from ``exchange`` and the mesh:
    flat, two-stage, node-deduplicated (``exchange.dedup``, or ``method: auto`` when the
    cost model prefers it) or, dropless (``capacity_factor: 0``) on GPU/TPU, ragged.

    Args:
        config: the ``model`` section: ``d_model``, ``d_ff``, ``num_experts``,
            ``top_k``, ``capacity_factor`` (0: dropless), ``num_shared_experts`` (one
            dense SwiGLU of width ``S · d_ff`` on every token, sharded like the router),
            ``max_nodes`` (:func:`route`), ``dispatch`` and the compute ``dtype``
            (parameters and the router stay float32).
        rules: the mesh axes of each role (default: experts over ``node`` × ``device``).
        exchange: the ``exchange`` section: ``method``, ``order`` and ``dedup``
            (default: ``ExchangeConfig()``). Its axes are ``rules``' business.
        topology: :class:`meshkit.exchange.cost.Topology` for ``method: auto`` (``None``:
            the default; :func:`meshkit.model.dispatchers.config_topology` reads a
            config's).
        rngs: ``nnx.Rngs`` for initialisation.

    Raises:
        ValueError: ``exchange.dedup`` without node and device axes in ``rules`` or with
            ``dispatch: einsum``; and, when a mesh is set at construction or call, role
            axes missing from it, ``E`` not divisible by ``P`` or a bad ``max_nodes``
            for its nodes (:func:`check_node_limit`); at call time, a batch not
            divisible by the batch devices or no mesh.

    Example::

        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        with jax.set_mesh(mesh):
            moe = MoE(ModelConfig(d_model=16, d_ff=32, num_experts=8), rngs=nnx.Rngs(0))
            y, stats = moe(jnp.ones((8, 4, 16)))
    """

    def __init__(
        self,
        config: ModelConfig,
        rules: ShardingRules | None = None,
        *,
        exchange: ExchangeConfig | None = None,
        topology: cost.Topology | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        exchange = ExchangeConfig() if exchange is None else exchange
        self.rules = ShardingRules(node="node", device="device") if rules is None else rules
        # Both combinations span sections (or the rules), so no one section checks them.
        if exchange.dedup and not (self.rules.node and self.rules.device):
            raise ValueError(
                "MoE: exchange.dedup needs both node and device axes, got node="
                f"{self.rules.node}, device={self.rules.device}"
            )
        if exchange.dedup and config.dispatch != "sort":
            raise ValueError(f"MoE: exchange.dedup needs dispatch='sort', got {config.dispatch!r}")
        # Plain attributes, not the sections: nnx keeps them as static graph data, and a
        # clone may change one (tests compare exchanges on the same weights).
        self.d_model, self.d_ff, self.num_experts = config.d_model, config.d_ff, config.num_experts
        self.top_k, self.capacity_factor = config.top_k, float(config.capacity_factor)
        self.num_shared_experts, self.max_nodes = config.num_shared_experts, config.max_nodes
        self.dispatch, self.dtype = config.dispatch, jnp.dtype(config.dtype)
        self.exchange_method, self.exchange_order = exchange.method, exchange.order
        self.exchange_dedup, self.topology = exchange.dedup, topology
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            self._check_mesh(mesh)

        e, d, f = self.num_experts, self.d_model, self.d_ff
        spec = self.rules.spec
        # The router is tiny and every device routes its own tokens: replicate it
        # (but for FSDP, which shards every matrix on the model width).
        self.router = param(normal(rngs, (d, e), d), spec("embed", None))
        self.w_gate = param(normal(rngs, (e, d, f), d), spec("experts", "embed", None))
        self.w_up = param(normal(rngs, (e, d, f), d), spec("experts", "embed", None))
        self.w_down = param(normal(rngs, (e, f, d), f), spec("experts", None, "embed"))
        if self.num_shared_experts:
            # Every device runs the shared expert on its own tokens, so like the router
            # it is replicated (FSDP-sharded on the model width).
            s = self.num_shared_experts * f
            self.shared_gate = param(normal(rngs, (d, s), d), spec("embed", None))
            self.shared_up = param(normal(rngs, (d, s), d), spec("embed", None))
            self.shared_down = param(normal(rngs, (s, d), s), spec(None, "embed"))

    @classmethod
    def from_config(cls, config: Config, *, rngs: nnx.Rngs) -> MoE:
        """The MoE layer of a whole config: its ``model`` and ``exchange`` sections, the
        sharding rules of its mesh, and the topology it names.

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
        return cls(config.model, ShardingRules.from_config(config), exchange=config.exchange,
                   topology=config_topology(config), rngs=rngs)

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
                config = ModelConfig(d_model=16, d_ff=32, num_experts=8)
                moe = nnx.jit(lambda: MoE(config, rngs=nnx.Rngs(0)))()
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

    def _experts(self, batch: ExpertBatch, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array) -> jax.Array:
        """This device's experts on a dispatched batch, in either of its layouts."""
        if batch.group_sizes is None:
            return _swiglu(batch.rows, w_gate, w_up, w_down, self.dtype)
        return _ragged_swiglu(batch.rows, batch.group_sizes, w_gate, w_up, w_down, self.dtype)

    def _route_and_run(self, tokens: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Route, dispatch, run the local experts, combine."""
        w_router, w_gate, w_up, w_down = self._weights()
        e, k = self.num_experts, self.top_k
        n, d = tokens.shape
        nodes = self._num_nodes()
        logits = tokens.astype(jnp.float32) @ w_router
        expert_index, gate, probs = route(logits, k, num_nodes=nodes, max_nodes=self.max_nodes)
        dispatcher = make_dispatcher(
            rules=self.rules, num_experts=e, top_k=k, capacity_factor=self.capacity_factor,
            max_nodes=self.max_nodes, mode=self.dispatch, method=self.exchange_method,
            order=self.exchange_order, dedup=self.exchange_dedup, topology=self.topology,
            bytes_per_row=d * tokens.dtype.itemsize, num_tokens=n,
        )
        batch, context = dispatcher.dispatch(tokens, Routing(expert_index, gate))
        y = dispatcher.combine(self._experts(batch, w_gate, w_up, w_down), context)
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
            dropped=jax.lax.psum(context.dropped, axes),
            assignments=assignments,
            expert_load=counts.astype(jnp.float32) / assignments,
            nodes_per_token=(jax.lax.psum(reached, axes) * k).astype(jnp.float32)
            / assignments,
        )
        return y, stats
