"""Decoder-only transformer language model with expert-parallel MoE feed-forward blocks.

``tokens [B, T] → embedding → num_layers × (RMSNorm → causal self-attention with rotary
positions → residual; RMSNorm → MoE → residual) → RMSNorm → output head → logits``.

Every parameter carries ``out_sharding`` metadata: expert weights are split over the
expert axes (see :mod:`meshkit.moe`), everything else is replicated. Build the model
under ``jax.set_mesh(mesh)`` inside ``nnx.jit`` and each device creates only its share
(or call :func:`meshkit.moe.shard_model` on a model built without a mesh). Call it under
the same ``jax.set_mesh(mesh)``: the MoE layers read the mesh from the context.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit._params import normal, param
from meshkit.moe import AxisNames, MoE

if TYPE_CHECKING:
    from meshkit.cost import Topology

__all__ = ["ModelStats", "Transformer", "rotary"]

_REPLICATED2 = (None, None)


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (RoFormer) over the sequence axis.

    Channel pairs ``(i, i + h/2)`` of each head are rotated by angle
    ``t · base^(−2i/h)`` at position ``t``, so query·key depends only on the offset.

    Args:
        x: ``[B, T, H, h]`` queries or keys; ``h`` even.
        base: frequency base.

    Returns:
        ``x`` rotated, same shape and dtype.

    Raises:
        ValueError: ``h`` odd.

    Example:
        >>> rotary(jnp.ones((1, 3, 2, 4))).shape
        (1, 3, 2, 4)
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"rotary needs an even head dimension, got {h}")
    freqs = base ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [T, h/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


class _RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        self.scale = param(jnp.ones((d,), jnp.float32), (None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...]).astype(x.dtype)


class _Attention(nnx.Module):
    def __init__(
        self, d_model: int, num_heads: int, rope_base: float, dtype: Any, rngs: nnx.Rngs
    ) -> None:
        h = d_model // num_heads
        self.qkv = param(normal(rngs, (d_model, 3, num_heads, h), d_model), (None,) * 4)
        self.out = param(normal(rngs, (num_heads, h, d_model), d_model), (None,) * 3)
        self.rope_base, self.dtype = rope_base, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        t = x.shape[1]
        qkv = jnp.einsum("btd,dshk->sbthk", x.astype(self.dtype), self.qkv[...].astype(self.dtype))
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = rotary(q, self.rope_base), rotary(k, self.rope_base)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)
        scores = scores * q.shape[-1] ** -0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        o = jnp.einsum("bhqs,bshk->bqhk", weights, v)
        return jnp.einsum("bqhk,hkd->bqd", o, self.out[...].astype(self.dtype)).astype(x.dtype)


class _Block(nnx.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope_base: float,
        dtype: Any,
        moe_args: dict[str, Any],
        rngs: nnx.Rngs,
    ) -> None:
        # The MoE first: its argument checks then fire before any parameter is drawn.
        self.moe = MoE(d_model, dtype=dtype, rngs=rngs, **moe_args)
        self.moe_norm = _RMSNorm(d_model)
        self.attn_norm = _RMSNorm(d_model)
        self.attn = _Attention(d_model, num_heads, rope_base, dtype, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Any]:
        x = x + self.attn(self.attn_norm(x))
        y, stats = self.moe(self.moe_norm(x))
        return x + y, stats


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

    A registered pytree, so it can be returned from ``jax.jit`` and ``nnx.jit``.

    Example:
        >>> stats = ModelStats(aux_loss=jnp.float32(2.0), z_loss=jnp.float32(10.0),
        ...                    router_loss=jnp.float32(0.01 * 2.0 + 0.001 * 10.0),
        ...                    dropped=jnp.int32(0), assignments=jnp.int32(64),
        ...                    expert_load=jnp.full((2, 4), 0.25))
        >>> round(float(stats.router_loss), 6), stats.expert_load.shape  # 2 layers, 4 experts
        (0.03, (2, 4))
        >>> len(jax.tree.leaves(stats))
        6
    """

    aux_loss: jax.Array
    z_loss: jax.Array
    router_loss: jax.Array
    dropped: jax.Array
    assignments: jax.Array
    expert_load: jax.Array


class Transformer(nnx.Module):
    """Decoder-only MoE transformer LM.

    Args:
        vocab_size: vocabulary size ``V``.
        d_model: model width, divisible by ``num_heads`` with an even head size.
        num_layers: number of blocks ``L``.
        num_heads: attention heads.
        d_ff: hidden width of each expert.
        num_experts: experts per MoE layer ``E``.
        top_k: 1 or 2.
        capacity_factor: per-device expert capacity factor (:func:`meshkit.moe.capacity`).
        aux_loss_weight: weight of the load-balancing loss in ``stats.router_loss``.
        z_loss_weight: weight of the router z-loss in ``stats.router_loss``.
        node_axes, device_axes, batch_axes: mesh axes, as in :class:`meshkit.moe.MoE`.
        exchange_method, exchange_order, topology: exchange settings, as in
            :class:`meshkit.moe.MoE`.
        dispatch: ``"sort"`` or ``"einsum"``.
        dtype: compute dtype (parameters, norms, softmax and logits stay float32).
        rope_base: rotary frequency base.
        rngs: ``nnx.Rngs`` for initialisation.

    Raises:
        ValueError: non-positive sizes, ``d_model`` not divisible by ``num_heads`` or an
            odd head size, and everything :class:`meshkit.moe.MoE` raises.

    Example::

        mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
        with jax.set_mesh(mesh):
            model = nnx.jit(lambda: Transformer(64, 32, 2, 4, 64, 8,
                                                rngs=nnx.Rngs(0)))()
            logits, stats = model(jnp.zeros((8, 16), jnp.int32))
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.001,
        node_axes: AxisNames = ("node",),
        device_axes: AxisNames = ("device",),
        batch_axes: AxisNames | None = None,
        *,
        exchange_method: str = "auto",
        exchange_order: str = "node_first",
        topology: Topology | None = None,
        dispatch: str = "sort",
        dtype: Any = jnp.float32,
        rope_base: float = 10000.0,
        rngs: nnx.Rngs,
    ) -> None:
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Transformer: {name} must be a positive integer, got {value!r}")
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(
                f"Transformer: d_model={d_model} must split into num_heads={num_heads} "
                "heads of even size (rotary positions rotate channel pairs)"
            )
        moe_args = dict(
            d_ff=d_ff,
            num_experts=num_experts,
            top_k=top_k,
            capacity_factor=capacity_factor,
            node_axes=node_axes,
            device_axes=device_axes,
            batch_axes=batch_axes,
            exchange_method=exchange_method,
            exchange_order=exchange_order,
            topology=topology,
            dispatch=dispatch,
        )
        self.vocab_size, self.num_layers = vocab_size, num_layers
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.dtype = dtype
        self.blocks = nnx.List(
            [
                _Block(d_model, num_heads, rope_base, dtype, moe_args, rngs)
                for _ in range(num_layers)
            ]
        )
        self.embed = param(normal(rngs, (vocab_size, d_model), 1), _REPLICATED2)
        self.final_norm = _RMSNorm(d_model)
        self.head = param(normal(rngs, (d_model, vocab_size), d_model), _REPLICATED2)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, ModelStats]:
        """Next-token logits.

        Args:
            tokens: ``[B, T]`` integer ids in ``[0, V)``; ``B`` divisible by the batch
                devices. Call under ``jax.set_mesh(mesh)``.

        Returns:
            ``(logits [B, T, V] float32, ModelStats)``.

        Raises:
            ValueError: ``tokens`` not 2-d or not integer; see :class:`meshkit.moe.MoE`.

        Example::

            mesh = meshkit.Strategy.from_axes({"node": 2, "device": 4}).mesh()
            with jax.set_mesh(mesh):
                model = nnx.jit(lambda: Transformer(64, 32, 2, 4, 64, 8,
                                                    rngs=nnx.Rngs(0)))()
                logits, stats = nnx.jit(lambda m, t: m(t))(model, jnp.zeros((8, 16), jnp.int32))
            logits.shape, stats.expert_load.shape, int(stats.assignments)
            # ((8, 16, 64), (2, 8), 512)
        """
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be a [B, T] integer array, got {tokens.dtype} {tokens.shape}"
            )
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        layer_stats = []
        for block in self.blocks:
            x, stats = block(x)
            layer_stats.append(stats)
        x = self.final_norm(x)
        logits = jnp.einsum("btd,dv->btv", x.astype(jnp.float32), self.head[...])
        aux = sum(s.aux_loss for s in layer_stats)
        z = sum(s.z_loss for s in layer_stats)
        return logits, ModelStats(
            aux_loss=aux,
            z_loss=z,
            router_loss=self.aux_loss_weight * aux + self.z_loss_weight * z,
            dropped=sum(s.dropped for s in layer_stats),
            assignments=sum(s.assignments for s in layer_stats),
            expert_load=jnp.stack([s.expert_load for s in layer_stats]),
        )
