"""Decoder-only transformer language model with expert-parallel MoE feed-forward blocks.

``tokens [B, T] → embedding → num_layers × (RMSNorm → causal self-attention with rotary
positions → residual; RMSNorm → MoE → residual) → RMSNorm → output head → logits``.

Every parameter carries ``out_sharding`` metadata from :class:`meshkit.sharding.rules.ShardingRules`
(blocks stacked and split over the pipeline axis, heads and vocabulary over the tensor
axes, the model width over the fsdp axes, experts over the expert axes). Create the model
inside ``jax.jit`` with those shardings (:func:`meshkit.training.init_state`) and each
device creates only its share, or call :func:`meshkit.sharding.place.shard_model` on a model built
without a mesh. Call it under the same ``jax.set_mesh(mesh)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshkit.choices import CONTEXT_METHODS, PIPELINE_SCHEDULES, PIPELINE_SCHEDULES_BUILT
from meshkit.config import ExchangeConfig, ModelConfig, context_method
from meshkit.model.attention import attention
from meshkit.model.context import from_zigzag, kv_for_local_heads, local_attention
from meshkit.model.dispatchers import config_topology
from meshkit.model.mlp import MLP
from meshkit.model.moe import MoE, MoEStats
from meshkit.model.pipeline import (
    check_counts,
    gpipe,
    interleaved,
    layer_slots,
    one_f_one_b,
)
from meshkit.model.positions import Batch, Positions, layout
from meshkit.model.remat import remat
from meshkit.sharding import sequence
from meshkit.sharding.params import field_specs, gather_fsdp, normal, param, shard_call
from meshkit.sharding.rules import ShardingRules

if TYPE_CHECKING:
    from meshkit.config import Config
    from meshkit.exchange.cost import Topology

__all__ = ["ModelStats", "Transformer", "rotary"]

def rotary(x: jax.Array, base: float = 10000.0, positions: jax.Array | None = None
           ) -> jax.Array:
    """Rotary position embedding (RoFormer) over the sequence axis.

    Channel pairs ``(i, i + h/2)`` of each head are rotated by angle
    ``t · base^(−2i/h)`` at position ``t``, so query·key depends only on the offset.

    Args:
        x: ``[B, T, H, h]`` queries or keys; ``h`` even.
        base: frequency base.
        positions: ``[T]`` or ``[B, T]`` each token's position (default ``0..T-1``): the
            global ones under context parallelism, restarting at each packed document.

    Returns:
        ``x`` rotated, same shape and dtype.

    Raises:
        ValueError: ``h`` odd.

    Examples:
        >>> rotary(jnp.ones((1, 3, 2, 4))).shape
        (1, 3, 2, 4)
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"rotary needs an even head dimension, got {h}")
    freqs = base ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    if positions is None:
        positions = jnp.arange(x.shape[1])
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [(B,) T, h/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


class _RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        # A vector: replicated everywhere (sharding it would save nothing worth a gather).
        self.scale = param(jnp.ones((d,), jnp.float32), (None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return _rms_norm(x, self.scale[...], self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) · scale``, computed in float32; the backward pass keeps only ``x``.

    Differentiated plainly, it keeps the normalised ``x`` beside its input and output,
    one more ``[b, T, d]`` array a norm (2.5 of the 15.3 MiB of the matched dp2·tp4 dense
    step); ``x`` is kept anyway (the residual stream), and the backward pass recomputes
    the rest from it, elementwise.
    """
    return _rms_norm_fwd(x, scale, eps)[0]


def _normalized(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    # x * x, not x**2: the power's derivative would be one more [b, T, d] array.
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * r, r


def _rms_norm_fwd(x: jax.Array, scale: jax.Array, eps: float
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    normalized, _ = _normalized(x, eps)
    return (normalized * scale).astype(x.dtype), (x, scale)


def _rms_norm_bwd(eps: float, res: tuple[jax.Array, jax.Array], dy: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    x, scale = res
    # Tied to dy, as in meshkit.model.experts: otherwise XLA:CPU recomputes this in the
    # forward pass and keeps it, the very array the custom VJP is there to drop.
    x = x + dy.reshape(-1)[0].astype(x.dtype) * 0
    normalized, r = _normalized(x, eps)
    dy32 = dy.astype(jnp.float32)
    g = dy32 * scale
    # d(x·r)/dx applied to g: r·(g − x̂·mean(g·x̂)), r = rsqrt(mean(x²) + eps).
    dx = r * (g - normalized * jnp.mean(g * normalized, axis=-1, keepdims=True))
    dscale = jnp.sum((dy32 * normalized).reshape(-1, x.shape[-1]), axis=0)
    # A scale the same on every device of an axis the tokens are split over gets its
    # gradient summed over that axis here, as autodiff would where it meets the tokens.
    spread = sorted(set(jax.typeof(dscale).manual_axis_type.varying)
                    - set(jax.typeof(scale).manual_axis_type.varying))
    if spread:
        dscale = jax.lax.psum(dscale, tuple(spread))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class _Layer(nnx.Module):
    """One block, written per device: attention (heads split over the tensor axes, one
    all-reduce after the output projection), then the MoE feed-forward, or in a dense
    layer (``dense``) an MLP (hidden width split over the tensor axes, one all-reduce)."""

    def __init__(
        self,
        config: ModelConfig,
        rules: ShardingRules,
        *,
        dense: bool,
        exchange: ExchangeConfig | None,
        topology: Topology | None,
        rope_base: float,
        context_method: str,
        rngs: nnx.Rngs,
    ) -> None:
        d_model, num_heads = config.d_model, config.num_heads
        self.num_experts = config.num_experts
        if dense:
            self.mlp = MLP(d_model=d_model, d_ff=config.d_ff, kind=config.mlp, rules=rules,
                           dtype=config.dtype, rngs=rngs)
            self.mlp_norm = _RMSNorm(d_model)
        else:
            # The MoE first: its checks then fire before any parameter is drawn.
            self.moe = MoE(config, rules, exchange=exchange, topology=topology, rngs=rngs)
            self.moe_norm = _RMSNorm(d_model)
        self.attn_norm = _RMSNorm(d_model)
        h = d_model // num_heads
        spec = rules.spec
        kv_heads = config.num_kv_heads or num_heads
        if kv_heads == num_heads:
            self.qkv = param(normal(rngs, (d_model, 3, num_heads, h), d_model),
                             spec("embed", None, "heads", None))
        else:  # grouped-query attention: fewer K/V heads, split where the tensor axes divide
            self.q = param(normal(rngs, (d_model, num_heads, h), d_model),
                           spec("embed", "heads", None))
            split = _divides(kv_heads, rules.tensor)
            self.kv = param(normal(rngs, (d_model, 2, kv_heads, h), d_model),
                            spec("embed", None, "kv_heads" if split else None, None))
        self.out = param(normal(rngs, (num_heads, h, d_model), d_model),
                         spec("heads", None, "embed"))
        self.rope_base, self.dtype, self.rules = rope_base, jnp.dtype(config.dtype), rules
        self.num_heads, self.kv_heads = num_heads, kv_heads
        self.attention_kind, self.attention_chunk = config.attention, config.attention_chunk
        self.context_method = context_method

    def local(self, x: jax.Array, where: Positions) -> tuple[jax.Array, MoEStats]:
        """The block on ``x [b, T, d]`` (the tokens at ``where``), or on this tensor
        rank's ``[b, T/t, d]`` under sequence parallelism (``rules.sequence_parallel``)."""
        split = self.rules.sequence_parallel
        x = x + self._attention(self.attn_norm(x), where)
        if hasattr(self, "mlp"):
            return (x + self.mlp.local(self.mlp_norm(x), split=split),
                    _no_routing(self.num_experts, self.rules))
        y, stats = self.moe.local(self.moe_norm(x), split=split)
        return x + y, stats


    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This rank's queries ``[b, T, H/t, h]`` and keys and values: ``[b, T, Hk/t,
        h]`` where the tensor axes split the kv heads, else the kv head of each local
        query head (``[b, T, H/t, h]``)."""
        fsdp, x = self.rules.fsdp, x.astype(self.dtype)
        if hasattr(self, "qkv"):
            w = gather_fsdp(self.qkv[...], self.qkv.out_sharding, fsdp).astype(self.dtype)
            qkv = jnp.einsum("btd,dshk->sbthk", x, w)  # local heads
            return qkv[0], qkv[1], qkv[2]
        w_q = gather_fsdp(self.q[...], self.q.out_sharding, fsdp).astype(self.dtype)
        w_kv = gather_fsdp(self.kv[...], self.kv.out_sharding, fsdp).astype(self.dtype)
        q = jnp.einsum("btd,dhk->bthk", x, w_q)
        kv = jnp.einsum("btd,dshk->sbthk", x, w_kv)
        k, v = kv[0], kv[1]
        tensor = self.rules.tensor
        if tensor and k.shape[2] == self.kv_heads:  # replicated: keep the heads read here
            k, v = (kv_for_local_heads(x, num_heads=self.num_heads, local_heads=q.shape[2],
                                       tensor=tensor) for x in (k, v))
        return q, k, v

    def _attention(self, x: jax.Array, where: Positions) -> jax.Array:
        fsdp, tensor = self.rules.fsdp, self.rules.tensor
        w_out = gather_fsdp(self.out[...], self.out.out_sharding, fsdp).astype(self.dtype)
        split = self.rules.sequence_parallel
        whole = sequence.gather(x, tensor, split=split)  # every position, for attention
        q, k, v = self._project(whole)
        q = rotary(q, self.rope_base, where.positions)
        k = rotary(k, self.rope_base, where.positions)
        if self.rules.context or where.segments is not None:
            # The whole local sequence is one block unless the kernel is the chunked one.
            chunk = self.attention_chunk if self.attention_kind == "chunked" else 1 << 30
            o = local_attention(q, k, v, axes=self.rules.context, method=self.context_method,
                                  index=where.index, segment_ids=where.segments, chunk=chunk)
        else:
            group = q.shape[2] // k.shape[2]
            if group > 1:
                k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            o = attention(q, k, v, kind=self.attention_kind, chunk=self.attention_chunk,
                          causal=True)
        # Each tensor rank holds some heads' rows of the output projection: a partial sum.
        y = jnp.einsum("bqhk,hkd->bqd", o, w_out).astype(x.dtype)
        return sequence.reduce(y, tensor, split=split)


def _divides(count: int, axes: tuple[str, ...]) -> bool:
    """Whether the devices of ``axes`` on the mesh in force divide ``count`` (no axes:
    yes; no mesh: no, so what is sized by it stays whole)."""
    if not axes:
        return True
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return count % math.prod(sizes[a] for a in axes) == 0


def _no_routing(num_experts: int, rules: ShardingRules) -> MoEStats:
    """A dense layer's statistics: nothing routed (so it adds nothing to the sums).

    Marked varying over the pipeline axis, as an MoE layer's are (each stage routes its
    own layers): a schedule differentiates them with a cotangent that is the stage's.
    """
    zero, none = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    stats = MoEStats(aux_loss=zero, z_loss=zero, dropped=none, assignments=none,
                     expert_load=jnp.zeros((num_experts,), jnp.float32), nodes_per_token=zero)
    pipeline = () if rules.pipeline is None else (rules.pipeline,)
    return jax.tree.map(lambda s: _vary_over(s, pipeline), stats)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelStats:
    """Router statistics of a forward pass, over all tokens on the mesh.

    Attributes:
        aux_loss: load-balancing losses summed over layers.
        z_loss: router z-losses summed over layers.
        router_loss: ``aux_loss_weight · aux_loss + z_loss_weight · z_loss``: add it to
            the cross-entropy.
        dropped: dropped assignments summed over layers (int32).
        assignments: assignments summed over layers, ``layers · tokens · k`` (int32).
        expert_load: ``[L, E]`` fraction of each layer's assignments per expert.
        nodes_per_token: distinct nodes a token's experts live on, averaged over tokens
            and layers (:class:`meshkit.model.moe.MoEStats`).

    A registered pytree, so it can be returned from ``jax.jit`` and ``nnx.jit``.

    Examples:
        >>> stats = ModelStats(aux_loss=jnp.float32(2.0), z_loss=jnp.float32(10.0),
        ...                    router_loss=jnp.float32(0.01 * 2.0 + 0.001 * 10.0),
        ...                    dropped=jnp.int32(0), assignments=jnp.int32(64),
        ...                    expert_load=jnp.full((2, 4), 0.25),
        ...                    nodes_per_token=jnp.float32(1.0))
        >>> round(float(stats.router_loss), 6), stats.expert_load.shape  # 2 layers, 4 experts
        (0.03, (2, 4))
        >>> len(jax.tree.leaves(stats))
        7
    """

    aux_loss: jax.Array
    z_loss: jax.Array
    router_loss: jax.Array
    dropped: jax.Array
    assignments: jax.Array
    expert_load: jax.Array
    nodes_per_token: jax.Array


class Transformer(nnx.Module):
    """Decoder-only MoE transformer LM, every mesh axis doing its role's job.

    The parameters follow :class:`meshkit.sharding.rules.ShardingRules`: the ``L`` blocks are
    stacked on a leading ``layers`` dimension split over the pipeline axis (stage ``s``
    holds blocks ``[s·L/S, (s+1)·L/S)``); attention heads and the vocabulary (embedding
    rows, head columns) are split over the tensor axes; every matrix is split over the
    fsdp axes on the model width; experts over the expert axes. The forward pass runs
    per device inside one ``jax.shard_map`` (:meth:`loss`, :meth:`__call__`):

    * the embedding is vocab-parallel (a lookup of the local rows, all-reduced over the
      tensor axes);
    * each block: attention on the local heads, one all-reduce over the tensor axes;
      the MoE on the tensor rank's slice of the tokens (gathered after the combine);
      FSDP weights all-gathered per block (their gradients reduce-scattered);
    * the blocks of a stage run in a ``jax.lax.scan`` over the stacked layers when
      ``model.remat`` is not ``none`` or under FSDP, each block wrapped in
      :func:`meshkit.model.remat.remat`: one layer's weights are gathered at a time,
      inside the loop, never kept for the backward pass (gathered again there), and
      each layer's gradients are reduce-scattered as its backward pass ends;
    * the pipeline: the local batch is cut into ``microbatches``; in a GPipe schedule
      (:func:`meshkit.model.pipeline.gpipe`) of ``M + S − 1`` ticks each stage runs its blocks
      on the microbatch in hand and sends the result to the next stage with
      ``jax.lax.ppermute`` (``schedule="1f1b"``: :func:`meshkit.model.pipeline.one_f_one_b`,
      one forward and one backward microbatch per tick);
    * the head and the vocab-parallel cross-entropy on the last stage's outputs, shared
      out over the stages (each takes ``1/S`` of the tokens), as is the embedding.
    * context axes (``rules.context``) split each sequence: the batch is laid out in
      load-balanced chunks (:mod:`meshkit.model.positions`), each device runs every
      block on its ``T/c`` tokens, and attention crosses the group by ``context_method``
      (:func:`meshkit.model.context.local_attention`), masked by global token index and,
      with ``eos_id``, by document.

    The backward pass is autodiff through the same collectives; gradients of replicated
    parameters are all-reduced over the axes they are replicated on.

    Every size and choice comes from the config's ``model`` section, where its default
    and its field checks live (:class:`meshkit.config.ModelConfig`): ``vocab_size``
    (divisible by the tensor devices), ``d_model`` (divisible by the fsdp devices),
    ``num_layers`` (divisible by the pipeline stages), ``num_heads`` (divisible by the
    tensor devices), the MoE's settings (:class:`meshkit.model.moe.MoE`), the router
    loss weights in ``stats.router_loss``, the compute ``dtype``, and ``remat``,
    ``attention`` and ``attention_chunk`` (:func:`meshkit.model.attention.attention`).

    Args:
        config: the ``model`` section.
        rules: the mesh axes of each role (default: experts over ``node`` × ``device``,
            no other roles).
        exchange: the ``exchange`` section, as in :class:`meshkit.model.moe.MoE`
            (default: ``ExchangeConfig()``).
        topology: the cost model's hardware, as in :class:`meshkit.model.moe.MoE`.
        microbatches: pipeline microbatches per step (``parallel.microbatches``; divides
            the per-device batch).
        schedule: the pipeline schedule of :meth:`loss` (``parallel.schedule``, one of
            :data:`meshkit.choices.PIPELINE_SCHEDULES`): ``gpipe``
            (:func:`meshkit.model.pipeline.gpipe`, autodiff through it) or ``1f1b``
            (:func:`meshkit.model.pipeline.one_f_one_b`: the head and the loss run inside
            the schedule) or ``interleaved`` (:func:`meshkit.model.pipeline.interleaved`,
            autodiff through it). Logits (:meth:`__call__`) take the GPipe forward pass
            under ``1f1b``.
        stage_layers: layers per pipeline stage (``parallel.stage_layers``, summing to
            ``num_layers``; one entry per stage of the pipeline axis), or ``None`` for an
            even split. The stacked ``layers`` dimension then holds ``S · max(stage_layers)``
            slots, stage ``s``'s first ``stage_layers[s]`` of its slots holding its layers
            (the same values as without the option) and the rest unused zeros. A stage
            skips its unused slots with a ``jax.lax.cond``; on XLA:CPU, which does not
            order a cond's collectives against the others (a 1F1B step deadlocked), it
            computes them on zeroed weights and selects them away (same results, more
            FLOPs; :func:`skip_slots_by_cond` compiles the cond there, to measure).
        virtual_stages: chunks of layers per stage under ``schedule="interleaved"``
            (``parallel.virtual_stages``): the stacked ``layers`` dimension then holds the
            layers in the circular order (slot ``s·v·k + c·k + j`` holds layer
            ``(c·S + s)·k + j``, ``k = L/(S·v)``; :func:`meshkit.model.pipeline.interleaved`).
        stages: the pipeline stages ``S`` that order is made for (the size of the
            pipeline axis; checked when called). Only ``interleaved`` uses it.
        rope_base: rotary frequency base.
        context_method: how attention crosses the context axes, one of
            :data:`meshkit.choices.CONTEXT_METHODS` but ``auto``
            (:func:`meshkit.config.context_method.resolve` decides that one).
        eos_id: the id ending each packed document (``data.eos_id``), or ``None``.
        rngs: ``nnx.Rngs`` for initialisation.

    Raises:
        ValueError: ``microbatches`` below 1, an unknown ``schedule`` or
            ``context_method``, ``eos_id`` with a pipeline or microbatches, ``virtual_stages``
            without ``interleaved``, not dividing ``num_layers/stages``, or with
            ``stage_layers``, and everything
            :class:`meshkit.model.moe.MoE` raises.

    Example::

        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        config = ModelConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64)
        with jax.set_mesh(mesh):
            model = nnx.jit(lambda: Transformer(config, rngs=nnx.Rngs(0)))()
            logits, stats = model(jnp.zeros((8, 16), jnp.int32))
    """

    def __init__(
        self,
        config: ModelConfig,
        rules: ShardingRules | None = None,
        *,
        exchange: ExchangeConfig | None = None,
        topology: Topology | None = None,
        microbatches: int = 1,
        schedule: str = "gpipe",
        stage_layers: Sequence[int] | None = None,
        virtual_stages: int = 1,
        stages: int = 1,
        rope_base: float = 10000.0,
        context_method: str = "ring",
        eos_id: int | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        # Not model fields: the config checks them in its parallel section.
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"Transformer: microbatches must be an integer >= 1, got "
                             f"{microbatches!r}")
        if schedule not in PIPELINE_SCHEDULES_BUILT:
            known = schedule in PIPELINE_SCHEDULES
            raise ValueError(f"Transformer: schedule {schedule!r} is "
                             + ("not built yet" if known else "unknown; valid: "
                                + ", ".join(PIPELINE_SCHEDULES)))
        self.schedule = schedule
        self.stage_layers = None if stage_layers is None else tuple(stage_layers)
        check_counts("Transformer", schedule, virtual_stages=virtual_stages, stages=stages)
        if schedule == "interleaved" and self.stage_layers is not None:
            raise ValueError("Transformer: stage_layers cannot be combined with schedule "
                             "'interleaved'")
        if schedule == "interleaved" and config.num_layers % (stages * virtual_stages):
            raise ValueError(f"Transformer: virtual_stages={virtual_stages} does not divide "
                             f"the layers per stage (num_layers={config.num_layers} over "
                             f"{stages} stages)")
        self.virtual_stages, self.stages = virtual_stages, stages
        if self.stage_layers is not None and (
                sum(self.stage_layers) != config.num_layers or min(self.stage_layers) < 1):
            raise ValueError(f"Transformer: stage_layers {list(self.stage_layers)} must be "
                             f">= 1 each and sum to num_layers={config.num_layers}")
        rules = ShardingRules(node="node", device="device") if rules is None else rules
        if eos_id is not None and (rules.pipeline is not None or microbatches > 1):
            # A microbatch's rows would need their document ids carried through the
            # schedule beside the activations; not built.
            raise ValueError("Transformer: packed documents (eos_id) cannot be combined "
                             "with a pipeline axis or microbatches > 1")
        if context_method not in CONTEXT_METHODS[1:]:
            raise ValueError(f"Transformer: context_method must be one of "
                             f"{', '.join(CONTEXT_METHODS[1:])}, got {context_method!r}")
        self.eos_id = eos_id
        num_layers = config.num_layers
        self.vocab_size, self.num_layers, self.microbatches = (
            config.vocab_size, num_layers, microbatches)
        self.aux_loss_weight, self.z_loss_weight = config.aux_loss_weight, config.z_loss_weight
        self.dtype, self.rules = jnp.dtype(config.dtype), rules
        self.remat = config.remat

        # The first `dense_layers` layers of an MoE model are a stack of their own, run
        # first: a stack's layers must all have the same parameters.
        dense = config.dense_layers if config.num_experts else 0
        if dense and rules.pipeline is not None:
            raise ValueError(f"Transformer: dense_layers={dense} with a pipeline axis "
                             f"({rules.pipeline!r}) is not supported")
        #: MoE layers (their statistics are the model's).
        self.moe_layers = num_layers - dense if config.num_experts else 0

        # One set of per-layer parameters stacked on a leading `layers` dimension (the
        # pipeline axis splits it): the same values whatever the strategy.
        def make_stack(count: int, *, dense: bool) -> _Layer:
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: rules.pipeline})
            def make_layers(rngs: nnx.Rngs) -> _Layer:
                return _Layer(config, rules, dense=dense, exchange=exchange,
                              topology=topology, rope_base=rope_base,
                              context_method=context_method, rngs=rngs)

            return make_layers(rngs)

        self.dense_layers = make_stack(dense, dense=True) if dense else None
        self.layers = make_stack(num_layers - dense, dense=not config.num_experts)
        if self.stage_layers is not None:
            total = len(self.stage_layers) * max(self.stage_layers)
            slots = jnp.asarray(self._layer_slots())
            graphdef, state = nnx.split(self.layers)
            state = jax.tree.map(
                lambda v: jnp.zeros((total, *v.shape[1:]), v.dtype).at[slots].set(v), state)
            self.layers = nnx.merge(graphdef, state)
        elif schedule == "interleaved":
            # Stored in the schedule's order: slot _layer_slots()[l] holds layer l, so the
            # pipeline axis's even split gives each stage its chunks.
            slots = jnp.asarray(self._layer_slots())
            graphdef, state = nnx.split(self.layers)
            state = jax.tree.map(lambda v: jnp.zeros_like(v).at[slots].set(v), state)
            self.layers = nnx.merge(graphdef, state)
        d_model, vocab_size = config.d_model, config.vocab_size
        self.embed = param(normal(rngs, (vocab_size, d_model), 1), rules.spec("vocab", "embed"))
        self.final_norm = _RMSNorm(d_model)
        self.head = param(normal(rngs, (d_model, vocab_size), d_model),
                          rules.spec("embed", "vocab"))

    @classmethod
    def from_config(cls, config: Config, *, rngs: nnx.Rngs | None = None) -> Transformer:
        """The model a whole config describes (``model``, ``parallel``, ``exchange`` and
        the sharding rules and topology of its mesh).

        Args:
            config: a validated :class:`meshkit.config.Config`.
            rngs: initialisation randomness (default ``nnx.Rngs(config.train.seed)``).

        Returns:
            An unsharded model; :func:`meshkit.training.init_state` creates it sharded.

        Examples:
            >>> from meshkit.config import Config
            >>> Transformer.from_config(Config()).layers.qkv.shape  # [L, d, 3, H, h]
            (2, 64, 3, 4, 16)
        """
        return cls(
            config.model,
            ShardingRules.from_config(config),
            exchange=config.exchange,
            topology=config_topology(config),
            microbatches=config.parallel.microbatches,
            schedule=config.parallel.schedule,
            stage_layers=config.parallel.stage_layers,
            virtual_stages=config.parallel.virtual_stages,
            stages=(1 if config.parallel.pipeline is None
                    else config.mesh.strategy().shape[config.parallel.pipeline]),
            context_method=context_method.resolve(config),
            eos_id=config.data.eos_id,
            rngs=rngs or nnx.Rngs(config.train.seed),
        )

    # ------------------------------------------------------------------ global calls
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, ModelStats]:
        """Next-token logits.

        Args:
            tokens: ``[B, T]`` integer ids in ``[0, V)``; ``B`` divisible by the batch
                devices times ``microbatches``. Call under ``jax.set_mesh(mesh)``.

        Returns:
            ``(logits [B, T, V] float32, ModelStats)``.

        Raises:
            ValueError: ``tokens`` not 2-d or not integer, no mesh set, a batch that does
                not split; see :class:`meshkit.model.moe.MoE`.

        Example::

            with jax.set_mesh(mesh):
                logits, stats = nnx.jit(lambda m, t: m(t))(model, jnp.zeros((8, 16), jnp.int32))
            logits.shape, stats.expert_load.shape, int(stats.assignments)
            # ((8, 16, 64), (2, 8), 512)
        """
        self._check_batch(tokens)
        c = self._context_devices()
        rows = layout(jnp.pad(tokens, ((0, 0), (0, 1))), context_devices=c, eos_id=self.eos_id)
        logits, stats = shard_call(
            self, Transformer._local_logits, rows,  # type: ignore[arg-type]  # a pytree
            arg_specs=[self.rules.spec("batch", "sequence")],
            out_specs=(self.rules.spec("batch", "sequence", None), self._stats_specs()),
        )
        return from_zigzag(logits, c), self._real_layers(stats)

    def loss(self, batch: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ModelStats]]:
        """The training loss of a batch: mean next-token cross-entropy + router losses.

        Args:
            batch: ``[B, T+1]`` integer tokens; position ``t+1`` is the target of ``t``.

        Returns:
            ``(loss, (cross_entropy, ModelStats))``, scalars over the whole batch.

        Raises:
            ValueError: as :meth:`__call__`.

        Example::

            with jax.set_mesh(mesh):
                loss, (ce, stats) = nnx.jit(lambda m, b: m.loss(b))(model, batch)
        """
        self._check_batch(batch, targets=True)
        rows = layout(batch, context_devices=self._context_devices(), eos_id=self.eos_id)
        loss, ce, stats = shard_call(
            self, Transformer._local_loss, rows,  # type: ignore[arg-type]  # a pytree
            arg_specs=[self.rules.spec("batch", "sequence")],
            out_specs=(P(), P(), self._stats_specs()),
        )
        return loss, (ce, self._real_layers(stats))

    def _layer_slots(self) -> list[int]:
        """The slot of the stacked ``layers`` dimension that holds each layer, in order.

        See :func:`meshkit.model.pipeline.layer_slots`."""
        return layer_slots(self.num_layers, schedule=self.schedule, stages=self.stages,
                           virtual_stages=self.virtual_stages,
                           stage_layers=self.stage_layers)[0]

    def _real_layers(self, stats: ModelStats) -> ModelStats:
        """``stats`` with the expert load of the layers only (no unused slots), in layer
        order."""
        if self.stage_layers is None and self.schedule != "interleaved":
            return stats
        load = stats.expert_load[jnp.asarray(self._layer_slots())]
        return dataclasses.replace(stats, expert_load=load)

    def _run_stage(self, graphdef: nnx.GraphDef[_Layer], state: nnx.State, h: jax.Array,
                   where: Positions) -> tuple[jax.Array, MoEStats]:
        """This stage's layers on ``h``, each under its remat policy, and their statistics
        stacked ``[layers, ...]``; with ``stage_layers``, the slots past this stage's
        count run nothing (``jax.lax.cond``), leave ``h`` as it is and count no statistics."""
        local = jax.tree.leaves(state)[0].shape[0]
        count = None
        if self.stage_layers is not None and self.rules.pipeline is not None:
            count = jnp.asarray(self.stage_layers)[jax.lax.axis_index(self.rules.pipeline)]
        fsdp = bool(self.rules.fsdp)

        def block(layer_state: nnx.State, h: jax.Array) -> tuple[jax.Array, MoEStats]:
            if fsdp:
                # Tie the weights to the carry: a layer's gathers then depend on `h`, so
                # JAX's scan partial evaluation cannot hoist them (their inputs are loop
                # invariant in the pipeline's tick loop) into one scan that gathers and
                # keeps every layer's full weights at once. The remat policy recomputes
                # the barrier, so the backward pass regathers from the shards. Only the
                # weights come out of it: `h` keeps the mesh axes it varies over. One
                # barrier per weight: a barrier's outputs vary over every mesh axis any
                # of its inputs does, and a weight replicated over the tensor axes (the
                # router under moe_tensor "ffn") must not come out varying over them.
                layer_state = jax.tree.map(
                    lambda w: jax.lax.optimization_barrier((w, h))[0], layer_state)
            return nnx.merge(graphdef, layer_state).local(h, where)

        plain = block
        block = remat(block, self.remat, regather=fsdp)

        def one_layer(h: jax.Array, i: jax.Array | int, layer_state: nnx.State
                      ) -> tuple[jax.Array, MoEStats]:
            if count is None:
                return block(layer_state, h)
            want = jax.eval_shape(block, layer_state, h)

            def skip(layer_state: nnx.State, h: jax.Array) -> tuple[jax.Array, MoEStats]:
                zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), want[1])
                return jax.tree.map(_vary_like, (h, zeros), want)

            def slot(layer_state: nnx.State, h: jax.Array) -> tuple[jax.Array, MoEStats]:
                if not _cond_orders_collectives():
                    # XLA:CPU's thunk executor runs the collectives nested in a cond
                    # unordered against the ones outside it, so two devices can wait
                    # in different collectives for good: a 1F1B step on pp2·tp2·node2
                    # with stage_layers [2, 1] deadlocked within 400 steps, and ran
                    # 2×400 clean with this select. CPU computes the unused slot on
                    # zeroed weights and drops it: whatever the slot holds, its block
                    # stays finite and gets exact zeros for gradients.
                    use = i < count
                    safe = jax.tree.map(lambda w: jnp.where(use, w, jnp.zeros_like(w)),
                                        layer_state)
                    return jax.tree.map(lambda a, b: jnp.where(use, a, b),
                                        plain(safe, h), skip(layer_state, h))
                # An unused slot runs nothing (a select would compute the block, then
                # drop it): each stage pays for its own layers only. The predicate is
                # the stage's, the same on every device of a tensor, fsdp or expert
                # group, so the block's collectives run on all of a group or on none.
                return jax.lax.cond(i < count, plain, skip, layer_state, h)

            # The remat policy around the slot, not inside it: what a checkpoint keeps
            # would otherwise come out of the cond as new buffers (copies of the weights
            # under `full`), stacked by the loops around it.
            return remat(slot, self.remat, regather=fsdp)(layer_state, h)

        if self.remat != "none" or fsdp:
            # One program for all layers: what a layer keeps for the backward pass is
            # exactly what its remat policy saves, nothing more.
            return jax.lax.scan(lambda h, xs: one_layer(h, *xs), h,
                                (jnp.arange(local), state))
        stats = []
        for i in range(local):
            h, s = one_layer(h, i, jax.tree.map(lambda a, i=i: a[i], state))
            stats.append(s)
        return h, jax.tree.map(lambda *v: jnp.stack(v), *stats)

    def _check_batch(self, tokens: jax.Array, *, targets: bool = False) -> None:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be a [B, T] integer array, got {tokens.dtype} {tokens.shape}"
            )
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("Transformer must be called under `with jax.set_mesh(mesh):`")
        try:
            self.rules.check_mesh(mesh.axis_names)
        except ValueError as e:
            raise ValueError(f"Transformer: {e}") from None
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        ways = math.prod(sizes[a] for a in self.rules.batch_axes) * self.microbatches
        if tokens.shape[0] % ways:
            raise ValueError(
                f"Transformer: batch size {tokens.shape[0]} is not divisible by the batch "
                f"devices {self.rules.batch_axes} times {self.microbatches} microbatches"
            )
        c = math.prod(sizes[a] for a in self.rules.context)
        length = tokens.shape[1] - int(targets)
        if c > 1 and length % (2 * c):
            raise ValueError(
                f"Transformer: a sequence of {length} tokens does not cut into 2·{c} equal "
                f"chunks for the context devices {self.rules.context}")

    def _context_devices(self) -> int:
        """The devices each sequence is split over (the context axes' sizes)."""
        mesh = jax.sharding.get_abstract_mesh()
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        return math.prod(sizes[a] for a in self.rules.context)

    def _stats_specs(self) -> ModelStats:
        return field_specs(ModelStats, expert_load=self.rules.spec("layers", None))

    # ------------------------------------------------------------------ per device
    def _where(self, rows: Batch) -> Positions:
        return Positions.local(rows.inputs.shape[1], self.rules.context,
                               positions=rows.positions, segments=rows.segments)

    def _local_loss(self, rows: Batch) -> tuple[jax.Array, jax.Array, ModelStats]:
        """``(loss, cross-entropy, stats)`` of the local rows, the loss differentiable."""
        targets, split = rows.targets, self.rules.batch_context_axes
        if self.eos_id is None:
            tokens: jax.Array | int = targets.size * math.prod(
                jax.lax.axis_size(a) for a in split)
        else:  # the targets that count: a document's last token predicts nothing
            tokens = jax.lax.psum(jnp.sum(targets >= 0), split) if split else jnp.sum(
                targets >= 0)
        if self.schedule == "1f1b":
            return self._local_loss_1f1b(rows.inputs, targets, tokens, self._where(rows))
        h, stats = self._local_trunk(rows.inputs, self._where(rows))
        ce = _head_cross_entropy(h, targets, w=self.head[...], scale=self.final_norm.scale[...],
                                 eps=self.final_norm.eps, spec=self.head.out_sharding,
                                 rules=self.rules)
        axes = (*split, *self._pipeline_axes())
        ce = (jax.lax.psum(ce, axes) if axes else ce) / tokens
        return ce + stats.router_loss, ce, stats

    def _local_loss_1f1b(self, tokens: jax.Array, targets: jax.Array,
                         count: jax.Array | int, where: Positions
                         ) -> tuple[jax.Array, jax.Array, ModelStats]:
        """The loss through :func:`meshkit.model.pipeline.one_f_one_b`: the head and the
        cross-entropy of each microbatch run on the last stage inside the schedule."""
        x = self._shared_embed(tokens)
        b, t, d = x.shape
        m = self.microbatches
        graphdef, layer_state = nnx.split(self.layers)
        rules, head_spec = self.rules, self.head.out_sharding
        eps, pipeline = self.final_norm.eps, self.rules.pipeline
        aux_w, z_w = self.aux_loss_weight, self.z_loss_weight

        def stage(state: nnx.State, h: jax.Array) -> tuple[jax.Array, MoEStats]:
            return self._run_stage(graphdef, state, h, where)

        def head_loss(params: tuple[jax.Array, jax.Array], h: jax.Array, y: jax.Array
                      ) -> jax.Array:
            w, scale = params
            return _head_cross_entropy(h, y, w=w, scale=scale, eps=eps, spec=head_spec,
                                       rules=rules) / count

        def router_loss(stats: MoEStats) -> jax.Array:
            return jnp.sum(aux_w * stats.aux_loss + z_w * stats.z_loss,
                           dtype=jnp.float32) / m

        # The head's weights, like the layers' (_sum_after_ticks), over the batch axes
        # and the stages too: each stage's loss is its own.
        layer_state = self._sum_after_ticks(layer_state)
        head_params = tuple(_vary_over(v, (*rules.batch_context_axes, *self._pipeline_axes()))
                            for v in (self.head[...], self.final_norm.scale[...]))

        loss, (ce, stats) = one_f_one_b(
            stage, layer_state, x.reshape(m, b // m, t, d), loss=head_loss,
            loss_params=head_params,
            targets=targets.reshape(m, b // m, t), axis=pipeline, stats_loss=router_loss)
        return loss, ce, self._model_stats(stats, m)

    def _sum_after_ticks(self, layer_state: nnx.State) -> nnx.State:
        """``layer_state`` marked varying over the mesh axes whose devices see different
        data, so that a schedule's ticks add their local gradients and autodiff sums them
        once, after the loop.

        A weight the same on every device of such an axis gets its gradient summed over it
        by autodiff where it meets the split data: inside each tick's backward pass, one
        all-reduce per tick (M× the traffic), its input and output live beside the
        gradient accumulator (in pp2·tp4, 3 copies of the expert weights). Marked here,
        outside the schedule, the sum moves after the loop. Only where every use sees split
        data: every weight over the batch axes, the MoE's over the tensor axes too (each
        tensor rank routes its own tokens, under ``moe_tensor="tokens"``).
        """
        rules = self.rules
        split_tokens = rules.tensor if rules.moe_tensor == "tokens" else ()
        return jax.tree_util.tree_map_with_path(
            lambda path, v: _vary_over(
                v, (*rules.batch_context_axes, *(split_tokens if _in_moe(path) else ()))),
            layer_state)

    def _local_logits(self, rows: Batch) -> tuple[jax.Array, ModelStats]:
        h, stats = self._local_trunk(rows.inputs, self._where(rows))
        logits = self._local_head(h)
        if self.rules.tensor:
            logits = jax.lax.all_gather(logits, self.rules.tensor, axis=-1, tiled=True,
                                        to="invarying")
        logits = jnp.where(self._is_last_stage(), logits, 0.0)
        pipeline = self._pipeline_axes()
        return (jax.lax.psum(logits, pipeline) if pipeline else logits), stats

    def _pipeline_axes(self) -> tuple[str, ...]:
        return () if self.rules.pipeline is None else (self.rules.pipeline,)

    def _is_last_stage(self) -> jax.Array:
        pipeline = self.rules.pipeline
        if pipeline is None:
            return jnp.bool_(True)
        return jax.lax.axis_index(pipeline) == jax.lax.axis_size(pipeline) - 1

    def _shared_embed(self, tokens: jax.Array) -> jax.Array:
        """:meth:`_local_embed` of ``tokens [b, T]``, each pipeline stage looking up its
        share of the tokens (then all-gathered over the stages), so no stage repeats
        another's lookup (or its vocab-parallel all-reduce)."""
        pipeline = self.rules.pipeline
        if (pipeline is None or tokens.size % jax.lax.axis_size(pipeline)
                or self.rules.sequence_parallel):  # each rank keeps its positions instead
            return self._local_embed(tokens)
        n = tokens.size // jax.lax.axis_size(pipeline)
        mine = jax.lax.dynamic_slice_in_dim(tokens.reshape(-1), jax.lax.axis_index(pipeline) * n,
                                            n)
        x = jax.lax.all_gather(self._local_embed(mine), pipeline, tiled=True, to="invarying")
        return x.reshape(*tokens.shape, x.shape[-1])

    def _local_embed(self, tokens: jax.Array) -> jax.Array:
        rules = self.rules
        table = gather_fsdp(self.embed[...], self.embed.out_sharding, rules.fsdp)
        if not rules.tensor:
            return jnp.take(table, tokens, axis=0).astype(self.dtype)
        # Vocab-parallel: each tensor rank looks up the ids in its rows, the rest add 0.
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(rules.tensor) * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
        # Under sequence parallelism each tensor rank keeps its positions of the sum.
        return sequence.reduce(x, rules.tensor, split=rules.sequence_parallel).astype(self.dtype)

    def _local_head(self, h: jax.Array) -> jax.Array:
        head = gather_fsdp(self.head[...], self.head.out_sharding, self.rules.fsdp)
        h = sequence.gather(self.final_norm(h), self.rules.tensor,
                            split=self.rules.sequence_parallel)
        return jnp.einsum("btd,dv->btv", h.astype(jnp.float32), head)  # local vocab columns

    def _local_trunk(self, tokens: jax.Array, where: Positions
                     ) -> tuple[jax.Array, ModelStats]:
        """Embedding and every block, pipelined over stages: ``[b, T, d]`` last-stage
        outputs (other stages hold intermediate values) and the router statistics."""
        x = self._shared_embed(tokens)
        dense_stats = None
        if self.dense_layers is not None:  # no pipeline: checked at construction
            x, dense_stats = self._run_stage(*nnx.split(self.dense_layers), x, where)
        b, t, d = x.shape
        m = self.microbatches
        graphdef, layer_state = nnx.split(self.layers)
        if self.rules.pipeline is not None or m > 1:
            # Without ticks (no pipeline, one microbatch) the sums stay in the layers'
            # backward passes, where each overlaps the layers still to go.
            layer_state = self._sum_after_ticks(layer_state)

        def run_stage(h: jax.Array) -> tuple[jax.Array, MoEStats]:
            return self._run_stage(graphdef, layer_state, h, where)

        xs = x.reshape(m, b // m, t, d)
        if self.schedule == "interleaved":
            outputs, stats = self._interleaved(graphdef, layer_state, xs, where)
        else:
            outputs, stats = gpipe(run_stage, xs, self.rules.pipeline)
        if dense_stats is not None:  # zero rows first: expert_load is [L, E] in layer order
            stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), dense_stats, stats)
        return outputs.reshape(b, t, d), self._model_stats(stats, m)

    def _interleaved(self, graphdef: nnx.GraphDef[_Layer], layer_state: nnx.State,
                     xs: jax.Array, where: Positions) -> tuple[jax.Array, MoEStats]:
        """The blocks through :func:`meshkit.model.pipeline.interleaved`: chunk ``c`` of
        a stage is its slots ``[c·k, (c+1)·k)``; the statistics of a chunk's layers land
        in those slots' rows."""
        pipeline, v = self.rules.pipeline, self.virtual_stages
        stages = 1 if pipeline is None else jax.lax.axis_size(pipeline)
        if stages != self.stages:
            raise ValueError(f"Transformer: built for {self.stages} pipeline stages (the "
                             f"interleaved layer order), called with {stages}")
        local = jax.tree.leaves(layer_state)[0].shape[0]
        k = local // v

        # A chunk's weights are sliced from the stage's at each tick (the chunk index is
        # the tick's), so autodiff would keep them, and every value made from them, once
        # per tick: memory growing with the v·M + S − 1 ticks. Checkpointed, only the
        # matmul outputs are kept (nothing under remat `full`) and the weights are sliced
        # again in the backward pass: flat in M.
        policy = (jax.checkpoint_policies.nothing_saveable if self.remat == "full"
                  else jax.checkpoint_policies.dots_saveable)

        @functools.partial(jax.checkpoint, policy=policy)
        def run_chunk(state: nnx.State, c: jax.Array, h: jax.Array
                      ) -> tuple[jax.Array, MoEStats]:
            params = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * k, k), state)
            h, stats = self._run_stage(graphdef, params, h, where)
            rows = jax.tree.map(
                lambda a: jax.lax.dynamic_update_slice_in_dim(
                    jnp.zeros((local, *a.shape[1:]), a.dtype), a, c * k, 0), stats)
            return h, rows

        return interleaved(lambda c, h: run_chunk(layer_state, c, h), xs, pipeline,
                           virtual_stages=v)

    def _model_stats(self, per_layer: MoEStats, microbatches: int) -> ModelStats:
        """Sum a stage's per-layer statistics (stacked ``[layers, ...]``) over its layers
        and the pipeline."""
        pipeline = self._pipeline_axes()

        def total(field: str) -> jax.Array:
            v = jnp.sum(getattr(per_layer, field), axis=0)
            return jax.lax.psum(v, pipeline) if pipeline else v

        aux = total("aux_loss") / microbatches
        z = total("z_loss") / microbatches
        return ModelStats(
            aux_loss=aux,
            z_loss=z,
            router_loss=self.aux_loss_weight * aux + self.z_loss_weight * z,
            dropped=total("dropped"),
            assignments=total("assignments"),
            expert_load=per_layer.expert_load / microbatches,
            nodes_per_token=total("nodes_per_token") / (microbatches * max(self.moe_layers, 1)),
        )


def _vary_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` marked varying over those of ``axes`` it does not vary over yet."""
    extra = tuple(sorted(set(axes) - set(jax.typeof(x).manual_axis_type.varying)))
    return jax.lax.pcast(x, extra, to="varying") if extra else x


def _in_moe(path: tuple[Any, ...]) -> bool:
    """Whether a layer-state leaf's path lies in the layer's MoE (``_Layer.moe``)."""
    return bool(path) and getattr(path[0], "key", None) == "moe"


_slots_by_cond: list[bool] = []  # the innermost skip_slots_by_cond() in force


@contextlib.contextmanager
def skip_slots_by_cond() -> Iterator[None]:
    """Trace uneven stages' unused slots as accelerators run them, skipped by a
    ``jax.lax.cond``, on XLA:CPU too (which otherwise computes them and selects them
    away, see :class:`Transformer`): for a step compiled to be measured, its bytes and
    FLOPs then an accelerator's, and never run here. ``jax.jit`` keeps a function's
    trace, so trace a new function inside it (as :func:`meshkit.training.compile_step`
    does).

    Example::

        with skip_slots_by_cond():
            bytes_ = compile_step(config).memory_analysis()
    """
    _slots_by_cond.append(True)
    try:
        yield
    finally:
        _slots_by_cond.pop()


def _cond_orders_collectives() -> bool:
    """Whether unused slots are skipped by a cond: where the backend runs the collectives
    inside a ``jax.lax.cond`` in program order with the others (every backend but
    XLA:CPU), or under :func:`skip_slots_by_cond`."""
    return bool(_slots_by_cond) or jax.default_backend() != "cpu"


def _vary_like(x: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
    """``x`` marked varying over the mesh axes ``like`` varies over and it does not, so
    both branches of a ``jax.lax.cond`` inside shard_map have one type."""
    return _vary_over(x, tuple(like.manual_axis_type.varying))


def _head_cross_entropy(
    h: jax.Array,
    targets: jax.Array,
    *,
    w: jax.Array,
    scale: jax.Array,
    eps: float,
    spec: Sequence[Any],
    rules: ShardingRules,
) -> jax.Array:
    """This device's part of the cross-entropy sum of the last stage's outputs.

    With a pipeline, the last stage's ``[b, T, d]`` outputs are reduce-scattered over the
    stages (the others contribute zeros), so each stage runs the final norm, the head and
    the loss on ``1/S`` of the tokens, as MaxText runs its head data-parallel over the
    pipeline group: sum the result over the pipeline and batch axes. Where the stages do
    not divide the tokens, the last stage does it all and the others return 0.
    """
    d = h.shape[-1]
    # Vocab-parallel: every tensor rank needs every position's hidden state.
    h = sequence.gather(h, rules.tensor, split=rules.sequence_parallel)
    h, targets = h.reshape(-1, d), targets.reshape(-1)
    last: jax.Array | None = None
    pipeline = rules.pipeline
    if pipeline is not None:
        stages = jax.lax.axis_size(pipeline)
        index = jax.lax.axis_index(pipeline)
        last = index == stages - 1
        if h.shape[0] % stages == 0:
            n = h.shape[0] // stages
            h = jax.lax.psum_scatter(jnp.where(last, h, 0), pipeline, scatter_dimension=0,
                                     tiled=True)
            targets = jax.lax.dynamic_slice_in_dim(targets, index * n, n)
            last = None  # every stage's share counts
    head = gather_fsdp(w, spec, rules.fsdp)
    logits = jnp.einsum("nd,dv->nv", _rms_norm(h, scale, eps).astype(jnp.float32), head)
    counted = targets >= 0  # -1: a packed document's last token, which predicts nothing
    ce = jnp.sum(jnp.where(counted, _vocab_parallel_cross_entropy(
        logits, jnp.where(counted, targets, 0), rules.tensor), 0.0))
    return ce if last is None else jnp.where(last, ce, 0.0)


def _vocab_parallel_cross_entropy(
    logits: jax.Array, targets: jax.Array, tensor: tuple[str, ...]
) -> jax.Array:
    """Per-token cross-entropy of logits whose vocabulary is split over ``tensor``.

    Megatron's recipe: the max and the sum of exponentials are all-reduced over the
    tensor ranks, and the target's logit comes from the one rank that holds it.
    """
    if not tensor:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    cols = logits.shape[-1]
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), tensor)
    shifted = logits - top[..., None]
    lse = jnp.log(jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=-1), tensor))
    local = targets - jax.lax.axis_index(tensor) * cols
    mine = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, cols - 1)[..., None], -1)[..., 0]
    target = jax.lax.psum(jnp.where(mine, picked, 0.0), tensor)
    return lse - target
