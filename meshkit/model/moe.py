"""Expert-parallel mixture-of-experts layer: router → dispatcher → experts → combine.

One MoE forward pass, per device, inside ``jax.shard_map`` over the current mesh (the one
set by ``jax.set_mesh``; :meth:`MoE.local` is the per-device body the transformer calls
inside its own shard_map). The layer takes activations of any shape ``[..., d]`` and
splits their tokens over the batch axes:

0. **Split** the device's tokens over the tensor axes, if any: tensor ranks hold the same
   tokens after attention, and each routes and runs only its slice (gathered at the end).
1. **Route** the device's local tokens: the built-in softmax router
   (:mod:`meshkit.model.router`: top-``k`` experts, optionally limited to ``max_nodes``
   nodes per token) or one's own (``router=``, a :class:`meshkit.model.router.Router`).
2. **Dispatch**: the :class:`meshkit.exchange.dispatch.Dispatcher` that
   :func:`meshkit.model.dispatchers.make_dispatcher` picks (flat, two-stage,
   node-deduplicated or ragged) sends each token's rows to its experts' devices and
   returns an :class:`~meshkit.exchange.dispatch.ExpertBatch`: rows per local expert,
   padded to a capacity or grouped with sizes.
3. **Experts**: each device runs only its ``E/P`` local experts on the batch: gated FFNs
   (SwiGLU) by default, or any :class:`meshkit.model.experts.Experts` module
   (``experts=``: :class:`~meshkit.model.experts.MLPExperts` with GELU, a function of
   one's own through :class:`~meshkit.model.experts.FunctionExperts`, a subclass).
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
from meshkit.model.experts import Experts, SwiGLUExperts, gated_ffn
from meshkit.model.router import (
    Router,
    check_node_limit,
    check_router_output,
    load_balancing_loss,
    route,
    router_z_loss,
)
from meshkit.sharding import sequence
from meshkit.sharding.params import (
    field_specs,
    gather_fsdp,
    gather_fsdp_params,
    normal,
    param,
    shard_call,
)
from meshkit.sharding.rules import ShardingRules, entry_axes

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

    Examples:
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


class MoE(nnx.Module):
    """Expert-parallel top-k MoE feed-forward layer; SwiGLU experts unless told otherwise.

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
    cost model prefers it) or, dropless (``capacity_factor: 0``) on GPU/TPU with experts
    that run grouped rows, ragged.

    The default experts are SwiGLUs whose weights ``w_gate``, ``w_up``, ``w_down``
    (``[E, d, f]``, ``[E, d, f]``, ``[E, f, d]``) sit on the layer itself, as
    :class:`~meshkit.model.experts.SwiGLUExperts` draws them; ``experts=`` replaces them
    with any :class:`~meshkit.model.experts.Experts` module (then ``moe.experts``).

    Args:
        config: the ``model`` section: ``d_model``, ``d_ff``, ``num_experts``,
            ``top_k``, ``capacity_factor`` (0: dropless), ``num_shared_experts`` (one
            dense SwiGLU of width ``S · d_ff`` on every token, sharded like the router),
            ``max_nodes`` (:func:`route`; a ``router=`` of one's own must keep to it
            too), ``dispatch`` and the compute ``dtype`` of the default experts
            (parameters and the router stay float32).
        rules: the mesh axes of each role (default: experts over ``node`` × ``device``).
        experts: the routed experts, an :class:`~meshkit.model.experts.Experts` module
            built with the same ``rules`` (every parameter ``[E, ...]`` with the expert
            axes first in its ``out_sharding``; FSDP-gathered by that metadata before
            each call). ``None``: SwiGLU experts of width ``d_ff``.
        router: a :class:`~meshkit.model.router.Router` (an ``nnx.Module`` or a plain
            function) from this device's ``[n, d]`` tokens to ``(expert_index, gate,
            probs)``. ``None``: the built-in softmax top-``k`` router, a ``[d, E]``
            weight named ``router``. A router of one's own has no logits here, so
            ``stats.z_loss`` is 0.
        exchange: the ``exchange`` section: ``method``, ``order`` and ``dedup``
            (default: ``ExchangeConfig()``). Its axes are ``rules``' business.
        topology: :class:`meshkit.exchange.cost.Topology` for ``method: auto`` (``None``:
            the default; :func:`meshkit.model.dispatchers.config_topology` reads a
            config's).
        rngs: ``nnx.Rngs`` for initialisation.

    Raises:
        TypeError: ``experts`` not an :class:`~meshkit.model.experts.Experts` module, or
            ``router`` not callable.
        ValueError: an expert parameter not ``[E, ...]`` or not split over the expert
            axes (the message names it); ``exchange.dedup`` without node and device axes
            in ``rules`` or with ``dispatch: einsum``; and, when a mesh is set at
            construction or call, role axes missing from it, ``E`` not divisible by
            ``P`` or a bad ``max_nodes`` for its nodes (:func:`check_node_limit`); at
            call time, tokens not divisible by the batch devices or no mesh.

    Example::

        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        with jax.set_mesh(mesh):
            config = ModelConfig(d_model=16, d_ff=32, num_experts=8)
            moe = MoE(config, rngs=nnx.Rngs(0))
            y, stats = moe(jnp.ones((8, 4, 16)))
            gelu = MoE(config, experts=MLPExperts(num_experts=8, d_model=16, d_ff=32,
                                                  rngs=nnx.Rngs(1)), rngs=nnx.Rngs(0))
            y, stats = gelu(jnp.ones((32, 16)))  # [tokens, d] works as well
    """

    def __init__(
        self,
        config: ModelConfig,
        rules: ShardingRules | None = None,
        *,
        experts: Experts | None = None,
        router: Router | None = None,
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
        if experts is not None:
            self._check_experts(experts)
            self._check_ffn_split(experts)
        if router is not None and not callable(router):
            raise TypeError(f"MoE: router must be callable (a Router), got {type(router).__name__}")
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            self._check_mesh(mesh)

        e, d, f = self.num_experts, self.d_model, self.d_ff
        spec = self.rules.spec
        # The router is tiny and every device routes its own tokens: replicate it
        # (but for FSDP, which shards every matrix on the model width).
        self.router: nnx.Param | Router = (
            param(normal(rngs, (d, e), d), spec("embed", None)) if router is None else router
        )
        self.experts = experts
        if experts is None:
            # The default experts' weights live on the layer under the names they have
            # always had (and are drawn in the same order), so checkpoints keep matching.
            default = SwiGLUExperts(num_experts=e, d_model=d, d_ff=f, rules=self.rules,
                                    dtype=self.dtype, rngs=rngs)
            self.w_gate, self.w_up, self.w_down = default.w_gate, default.w_up, default.w_down
        if self.num_shared_experts:
            # Every device runs the shared expert on its own tokens, so like the router
            # it is replicated (FSDP-sharded on the model width).
            # Under moe_tensor "ffn" its width is split over the tensor axes too.
            s = self.num_shared_experts * f
            self.shared_gate = param(normal(rngs, (d, s), d), spec("embed", "expert_mlp"))
            self.shared_up = param(normal(rngs, (d, s), d), spec("embed", "expert_mlp"))
            self.shared_down = param(normal(rngs, (s, d), s), spec("expert_mlp", "embed"))

    @classmethod
    def from_config(cls, config: Config, *, rngs: nnx.Rngs) -> MoE:
        """The MoE layer of a whole config: its ``model`` and ``exchange`` sections, the
        sharding rules of its mesh, and the topology it names.

        Args:
            config: a validated :class:`meshkit.config.Config`.
            rngs: initialisation randomness.

        Returns:
            An unsharded layer (create it inside ``jax.jit`` under the mesh to shard it).

        Examples:
            >>> from meshkit.config import Config
            >>> MoE.from_config(Config(), rngs=nnx.Rngs(0)).w_up.shape  # [E, d, f]
            (8, 64, 128)
        """
        return cls(config.model, ShardingRules.from_config(config), exchange=config.exchange,
                   topology=config_topology(config), rngs=rngs)

    def _check_experts(self, experts: Experts) -> None:
        """Raise unless every parameter of ``experts`` is ``[E, ...]`` over the expert axes."""
        if not isinstance(experts, Experts):
            raise TypeError(
                "MoE: experts must be a meshkit.model.experts.Experts module (SwiGLUExperts, "
                f"MLPExperts, FunctionExperts or a subclass), got {type(experts).__name__}"
            )
        params = nnx.to_flat_state(nnx.state(experts, nnx.Param))
        if not params:
            raise ValueError(f"MoE: experts {type(experts).__name__} holds no nnx.Param")
        want = self.rules.expert_axes
        for path, variable in params:
            name = "/".join(map(str, path))
            shape = tuple(variable.get_value().shape)
            if not shape or shape[0] != self.num_experts:
                raise ValueError(
                    f"MoE: expert parameter {name!r} of shape {shape} is not stacked on a "
                    f"leading expert dimension of num_experts={self.num_experts}"
                )
            spec = variable.get_metadata().get("out_sharding")
            if entry_axes(spec[0] if spec else None) != want:
                raise ValueError(
                    f"MoE: expert parameter {name!r} has out_sharding {spec}; its first "
                    f"entry must be the expert axes {want} (meshkit.model.experts."
                    "expert_param with the layer's rules makes one)"
                )

    def _check_ffn_split(self, experts: Experts) -> None:
        """Under ``moe_tensor="ffn"``, raise unless some parameter of ``experts`` is split
        over the tensor axes: whole experts on every tensor rank would be summed ``t``
        times by the all-reduce that completes the split ones."""
        tensor = set(self.rules.tensor)
        if self.rules.moe_tensor != "ffn" or not tensor:
            return
        for _, variable in nnx.to_flat_state(nnx.state(experts, nnx.Param)):
            spec = variable.get_metadata().get("out_sharding") or ()
            names = {a for entry in spec for a in entry_axes(entry)}
            resolved = {a for n in names for a in (self.rules.axes(n) if n in
                        self.rules.logical_names() else (n,))}
            if resolved & tensor:
                return
        raise ValueError(
            f"MoE: moe_tensor='ffn' splits each expert's hidden width over the tensor axes "
            f"{self.rules.tensor}, but no parameter of experts {type(experts).__name__} is "
            "split over them; give the hidden dimension the logical name 'expert_mlp' "
            "(meshkit.model.experts.expert_param), or use moe_tensor='tokens'")

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
        """Apply the layer to every token of ``x``.

        Args:
            x: ``[..., d]`` activations, any leading shape (``[tokens, d]``,
                ``[B, T, d]``, ...): its tokens, flattened in row-major order, are split
                evenly over the batch devices, so their number must divide.

        Returns:
            ``(y [..., d] shaped and typed like x, MoEStats)``; stats are global over
            the mesh.

        Raises:
            ValueError: no mesh set, mesh/axis mismatch, ``x`` not ``[..., d_model]``, or
                its token count not divisible by the batch devices (naming the shape).

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
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: x must be [..., {self.d_model}], got shape {x.shape}")
        n = math.prod(x.shape[:-1])
        if n % batch_devices:
            raise ValueError(
                f"MoE: x of shape {x.shape} holds {n} tokens, which do not split evenly over "
                f"the {batch_devices} batch devices (axes {self.rules.batch_axes})"
            )
        # Row-major flattening keeps a [B, T, d] batch split over B exactly where it is:
        # device i gets the same tokens, in the same order, as from the batch split.
        spec = self.rules.spec("batch", None)
        stats_spec = field_specs(MoEStats)
        y, stats = shard_call(self, MoE.local, x.reshape(n, self.d_model), arg_specs=[spec],
                              out_specs=(spec, stats_spec))
        return y.reshape(x.shape), stats

    def local(self, x: jax.Array, *, split: bool = False) -> tuple[jax.Array, MoEStats]:
        """The per-device body (inside ``jax.shard_map``, parameters as local shards).

        Args:
            x: this device's ``[..., d]`` tokens (the transformer's ``[b, T, d]``), the
                same on every tensor rank, or (``split``) this tensor rank's own tokens.
            split: whether the tensor ranks hold different tokens (sequence
                parallelism): under ``moe_tensor="tokens"`` each routes its own as they
                are; under ``"ffn"`` they are gathered first and the output
                reduce-scattered back.

        Returns:
            ``(y [..., d] in x.dtype, MoEStats)``: ``y`` the same on every tensor rank,
            the stats reduced over every device holding tokens.

        Raises:
            ValueError: the token count not divisible by the tensor devices; a
                ``router=`` returning the wrong shapes.
        """
        d = x.shape[-1]
        tokens = x.reshape(-1, d)
        tensor = self.rules.tensor
        if tensor and self.rules.moe_tensor == "ffn":
            # Every tensor rank routes the same tokens and runs the same exchange with its
            # share of each expert's hidden width: partial sums, completed after the
            # combine (linear in the experts' rows, so k·c times fewer bytes than before).
            y, stats = self._route_and_run(sequence.gather(tokens, tensor, split=split, axis=0))
            y = sequence.reduce(y, tensor, split=split, axis=0)
            return y.reshape(x.shape).astype(x.dtype), jax.tree.map(
                lambda s: _mean_over(s, tensor), stats)
        if tensor and split:  # each tensor rank holds its own tokens already
            y, stats = self._route_and_run(tokens)
            return y.reshape(x.shape).astype(x.dtype), stats
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
        return y.reshape(x.shape).astype(x.dtype), stats

    def _shared(self, tokens: jax.Array) -> jax.Array:
        """The shared experts' output ``[n, d]`` (float32) for every token (a partial sum
        over the tensor axes under ``moe_tensor="ffn"``, like the routed experts')."""
        fsdp = self.rules.fsdp
        gate, up, down = (gather_fsdp(p[...], p.out_sharding, fsdp)[None]
                          for p in (self.shared_gate, self.shared_up, self.shared_down))
        return gated_ffn(tokens[None], gate, up, down, dtype=self.dtype)[0].astype(jnp.float32)

    def _num_nodes(self) -> int:
        return jax.lax.axis_size(self.rules.node) if self.rules.node else 1

    def _route(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(expert_index, gate, probs, z_loss)`` of this device's ``[n, d]`` tokens."""
        fsdp = self.rules.fsdp
        if isinstance(self.router, nnx.Param):  # the built-in router's weight
            w_router = gather_fsdp(self.router[...], self.router.out_sharding, fsdp)
            logits = tokens.astype(jnp.float32) @ w_router
            expert_index, gate, probs = route(logits, self.top_k, num_nodes=self._num_nodes(),
                                              max_nodes=self.max_nodes)
            return expert_index, gate, probs, router_z_loss(logits, self.rules.token_axes)
        router = self.router
        if isinstance(router, nnx.Module):
            router = gather_fsdp_params(router, fsdp)
        expert_index, gate, probs = check_router_output(
            router(tokens), num_tokens=tokens.shape[0], top_k=self.top_k,
            num_experts=self.num_experts)
        return expert_index, gate, probs, jnp.zeros((), jnp.float32)

    def _run_experts(self, batch: ExpertBatch) -> jax.Array:
        """This device's experts on a dispatched batch, in either of its layouts."""
        fsdp = self.rules.expert_fsdp  # an axis that is also expert splits the experts
        if self.experts is None:
            w_gate, w_up, w_down = (gather_fsdp(p[...], p.out_sharding, fsdp)
                                    for p in (self.w_gate, self.w_up, self.w_down))
            return gated_ffn(batch.rows, w_gate, w_up, w_down, group_sizes=batch.group_sizes,
                             dtype=self.dtype)
        return gather_fsdp_params(self.experts, fsdp)(batch)

    def _route_and_run(self, tokens: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Route, dispatch, run the local experts, combine."""
        e, k = self.num_experts, self.top_k
        n, d = tokens.shape
        expert_index, gate, probs, z_loss = self._route(tokens)
        dispatcher = make_dispatcher(
            rules=self.rules, num_experts=e, top_k=k, capacity_factor=self.capacity_factor,
            max_nodes=self.max_nodes, mode=self.dispatch, method=self.exchange_method,
            order=self.exchange_order, dedup=self.exchange_dedup, topology=self.topology,
            bytes_per_row=d * tokens.dtype.itemsize, num_tokens=n,
            ragged=self.experts is None or self.experts.supports_grouped(),
        )
        batch, context = dispatcher.dispatch(tokens, Routing(expert_index, gate))
        y = dispatcher.combine(self._run_experts(batch), context)
        if self.num_shared_experts:
            y = y + self._shared(tokens)

        axes = self.rules.token_axes
        nodes = self._num_nodes()
        counts = jnp.bincount(expert_index.reshape(-1), length=e)
        counts = jax.lax.psum(counts, axes)
        assignments = jax.lax.psum(jnp.int32(n * k), axes)
        reached = jnp.sum(distinct_nodes(expert_index, e // nodes), dtype=jnp.int32)
        stats = MoEStats(
            aux_loss=load_balancing_loss(probs, expert_index, axes),
            z_loss=z_loss,
            dropped=jax.lax.psum(context.dropped, axes),
            assignments=assignments,
            expert_load=counts.astype(jnp.float32) / assignments,
            nodes_per_token=(jax.lax.psum(reached, axes) * k).astype(jnp.float32)
            / assignments,
        )
        return y, stats


def _mean_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` averaged over those of ``axes`` it varies over (none: ``x`` itself).

    Under ``moe_tensor="ffn"`` every tensor rank routes the same tokens, so its statistics
    are equal; they vary over the tensor axes only formally, where FSDP's tie of the
    weights to the (sequence-split) activations marks the router so. Each rank's copy of
    the router then takes ``1/t`` of the statistics' gradient, which sum to the whole.
    """
    extra = tuple(a for a in axes if a in jax.typeof(x).manual_axis_type.varying)
    if not extra:
        return x
    total = jax.lax.psum(x, extra)
    ways = math.prod(jax.lax.axis_size(a) for a in extra)
    return total // ways if jnp.issubdtype(x.dtype, jnp.integer) else total / ways
