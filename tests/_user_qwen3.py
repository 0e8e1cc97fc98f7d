"""A bonsai-style Qwen3 written with plain Flax layers, as a user brings it.

RMSNorm, grouped-query attention with RoPE and q/k/v/o ``nnx.Einsum`` projections, a
SwiGLU MLP of ``nnx.Linear`` layers and an ``nnx.Embed``: no meshkit layer inside. Its
parameters carry logical names of its own; :class:`meshkit.FSDP` around each block, the
embedding and the head gives the ZeRO-3 pattern under an fsdp role.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshkit

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, SEQ = 64, 32, 4, 2, 8, 64, 2, 8

#: How this model's logical names map to meshkit's roles.
LOGICAL = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}


def _meta(*names: str | None) -> dict[str, tuple[str | None, ...]]:
    return {"out_sharding": names}


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding over ``x [B, T, N, H]``."""
    t, h = x.shape[1], x.shape[-1]
    freq = 1.0 / 10_000 ** (jnp.arange(0, h, 2) / h)
    angle = jnp.arange(t)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    a, b = x[..., : h // 2], x[..., h // 2 :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.q = nnx.Einsum("btd,dnh->btnh", (WIDTH, HEADS, HEAD_DIM),
                            kernel_metadata=_meta("embed", "q_heads", None), rngs=rngs)
        self.k = nnx.Einsum("btd,dnh->btnh", (WIDTH, KV_HEADS, HEAD_DIM),
                            kernel_metadata=_meta("embed", "kv_heads", None), rngs=rngs)
        self.v = nnx.Einsum("btd,dnh->btnh", (WIDTH, KV_HEADS, HEAD_DIM),
                            kernel_metadata=_meta("embed", "kv_heads", None), rngs=rngs)
        self.o = nnx.Einsum("btnh,nhd->btd", (HEADS, HEAD_DIM, WIDTH),
                            kernel_metadata=_meta("q_heads", None, "embed"), rngs=rngs)
        self.q_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)
        self.k_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = rope(self.q_norm(self.q(x))), rope(self.k_norm(self.k(x))), self.v(x)
        group = HEADS // KV_HEADS
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        t = x.shape[1]
        scores = jnp.einsum("bqnh,bsnh->bnqs", q, k) / np.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        return self.o(jnp.einsum("bnqs,bsnh->bqnh", jax.nn.softmax(scores, -1), v))


class SwiGLU(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.gate = nnx.Linear(WIDTH, MLP, use_bias=False,
                               kernel_metadata=_meta("embed", "mlp"), rngs=rngs)
        self.up = nnx.Linear(WIDTH, MLP, use_bias=False,
                             kernel_metadata=_meta("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(MLP, WIDTH, use_bias=False,
                               kernel_metadata=_meta("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.input_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.attn = Attention(rngs=rngs)
        self.post_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.mlp = SwiGLU(rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class Head(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.lm_head = nnx.Linear(WIDTH, VOCAB, use_bias=False,
                                  kernel_metadata=_meta("embed", "vocab"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(x))


class Qwen3(nnx.Module):
    """``stacked``: the blocks stacked (``nnx.vmap``) and run by ``nnx.scan``, the wrapper
    inside the scanned body; else a list of blocks."""

    def __init__(self, *, rngs: nnx.Rngs, fsdp: bool = True, stacked: bool = False) -> None:
        wrap = meshkit.FSDP if fsdp else (lambda m: m)
        self.embedder = wrap(nnx.Embed(VOCAB, WIDTH, embedding_metadata=_meta("vocab", "embed"),
                                       rngs=rngs))
        self.stacked = stacked
        if stacked:
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stack(rngs: nnx.Rngs) -> nnx.Module:
                return wrap(Block(rngs=rngs))

            self.layers = stack(rngs)
        else:
            self.layers = nnx.List([wrap(Block(rngs=rngs)) for _ in range(LAYERS)])
        self.head = wrap(Head(rngs=rngs))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedder(tokens)
        if self.stacked:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def body(layer: nnx.Module, x: jax.Array) -> jax.Array:
                return layer(x)

            x = body(self.layers, x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.head(x)


def make(rngs: nnx.Rngs, fsdp: bool = True, stacked: bool = False) -> Qwen3:
    """The user's factory: ``factory(rngs) -> nnx.Module``."""
    with nnx.use_eager_sharding(False):
        return Qwen3(rngs=rngs, fsdp=fsdp, stacked=stacked)


def loss(model: Qwen3, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return ce, {}


def batch(rows: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
