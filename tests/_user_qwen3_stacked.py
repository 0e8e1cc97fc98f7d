"""A Qwen3-style decoder written the way a user writes one: plain ``nnx.Embed``,
``nnx.Linear``, ``nnx.Einsum`` and ``nnx.RMSNorm`` with logical names, no meshkit layers.

Grouped-query attention with q/k norms and rotary positions, a SwiGLU MLP, RMSNorm
before each; the decoder layers stacked on a leading ``layers`` dimension
(``nnx.vmap``), between an embedding and a head (final norm, output projection): the
pipeline protocol's ``embed``, ``layers`` and ``head``, so the trainer can pipeline it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN = 16, 16, 4, 2, 4, 32

#: How this model's own logical names map (``embed``, ``heads``, ``vocab`` are meshkit's).
LOGICAL = {"kv_heads": "heads", "mlp": "tensor", "norm": None}

_init = nnx.initializers.lecun_normal()


def _named(*names: str | None) -> nnx.Initializer:
    return nnx.with_partitioning(_init, names)


def _norm(width: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(width, epsilon=1e-6, rngs=rngs,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)))


def _rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary positions over ``x [B, T, H, D]``'s sequence, Qwen3's half-split pairs."""
    d = x.shape[-1]
    freqs = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2 / d)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Attention(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.q_proj = nnx.Einsum("btd,dhk->bthk", (WIDTH, HEADS, HEAD_DIM),
                                 kernel_init=_named("embed", "heads", None), rngs=rngs)
        self.k_proj = nnx.Einsum("btd,dhk->bthk", (WIDTH, KV_HEADS, HEAD_DIM),
                                 kernel_init=_named("embed", "kv_heads", None), rngs=rngs)
        self.v_proj = nnx.Einsum("btd,dhk->bthk", (WIDTH, KV_HEADS, HEAD_DIM),
                                 kernel_init=_named("embed", "kv_heads", None), rngs=rngs)
        self.o_proj = nnx.Einsum("bthk,hkd->btd", (HEADS, HEAD_DIM, WIDTH),
                                 kernel_init=_named("heads", None, "embed"), rngs=rngs)
        self.q_norm, self.k_norm = _norm(HEAD_DIM, rngs), _norm(HEAD_DIM, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q = _rope(self.q_norm(self.q_proj(x)))
        k = _rope(self.k_norm(self.k_proj(x)))
        v = self.v_proj(x)
        group = HEADS // KV_HEADS
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        t = x.shape[1]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        return self.o_proj(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, -1), v))


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.gate = nnx.Linear(WIDTH, FFN, use_bias=False, kernel_init=_named("embed", "mlp"),
                               rngs=rngs)
        self.up = nnx.Linear(WIDTH, FFN, use_bias=False, kernel_init=_named("embed", "mlp"),
                             rngs=rngs)
        self.down = nnx.Linear(FFN, WIDTH, use_bias=False, kernel_init=_named("mlp", "embed"),
                               rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.input_norm, self.attn = _norm(WIDTH, rngs), Attention(rngs=rngs)
        self.post_norm, self.mlp = _norm(WIDTH, rngs), MLP(rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class Head(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.norm = _norm(WIDTH, rngs)
        self.lm_head = nnx.Linear(WIDTH, VOCAB, use_bias=False,
                                  kernel_init=_named("embed", "vocab"), rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(h))


class Qwen3(nnx.Module):
    """``embed``, ``layers`` (stacked) and ``head``: the pipeline protocol."""

    def __init__(self, *, rngs: nnx.Rngs, layers: int = 2) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=_named("vocab", "embed"),
                               rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(rngs=rngs)

        self.layers = stack(rngs)
        self.head = Head(rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        graphdef, state = nnx.split(self.layers)
        for i in range(jax.tree.leaves(state)[0].shape[0]):
            h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h)
        return self.head(h)


class Flat(nnx.Module):
    """The same decoder with its layers in a list: no pipeline protocol."""

    def __init__(self, *, rngs: nnx.Rngs, layers: int = 2) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=_named("vocab", "embed"),
                               rngs=rngs)
        self.layers = nnx.List([DecoderLayer(rngs=rngs) for _ in range(layers)])
        self.head = Head(rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make(rngs: nnx.Rngs, layers: int = 2) -> Qwen3:
    """The factory: ``factory(rngs=..., **model.factory_kwargs)``."""
    with nnx.use_eager_sharding(False):
        return Qwen3(rngs=rngs, layers=layers)


def make_flat(rngs: nnx.Rngs, layers: int = 2) -> Flat:
    with nnx.use_eager_sharding(False):
        return Flat(rngs=rngs, layers=layers)


def loss(model: Qwen3, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross-entropy, with the logits' mean square as a metric of its own."""
    logits = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return ce, {"ce_loss": ce, "logit_ms": jnp.mean(logits**2)}
