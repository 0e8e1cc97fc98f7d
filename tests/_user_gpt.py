"""A GPT that meshkit has never seen, written the way a user writes one.

GELU MLP, its own parameter names (``to_qkv``, ``fc_in``, ``wte``, ``lm_head``), its own
logical names (``width``, ``nheads``, ``ffn``, ``vocab_rows``) and, optionally, stacked
blocks run through :func:`meshkit.model.pipeline.pipeline`, or a mixture-of-experts
feed-forward of its own GELU experts behind :class:`meshkit.MoE`. Only meshkit's public
API.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshkit
from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.model.pipeline import pipeline

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 1, 16

#: How this model's logical names map to meshkit's roles.
LOGICAL = {"width": "fsdp", "nheads": "tensor", "ffn": "tensor", "vocab_rows": "tensor"}


class Attention(nnx.Module):
    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs,
                 context: meshkit.ShardingRules | None = None) -> None:
        self.context = context  # rules with context axes: meshkit's context attention
        head_dim = width // heads
        # Fused QKV declared as (3, heads, head_dim): the heads split cleanly over tensor.
        self.to_qkv = meshkit.ColumnParallelLinear(
            width, (3, heads, head_dim), in_axes="width", out_axes=(None, "nheads", None),
            rngs=rngs)
        self.to_out = meshkit.RowParallelLinear(
            (heads, head_dim), width, in_axes=("nheads", None), out_axes="width", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        qkv = self.to_qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.context is not None:
            return self.to_out(meshkit.context_attention(q, k, v, rules=self.context))
        t = x.shape[1]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        return self.to_out(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, -1), v))


class MLP(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.fc_in = meshkit.ColumnParallelLinear(width, 4 * width, in_axes="width",
                                                  out_axes="ffn", rngs=rngs)
        self.fc_out = meshkit.RowParallelLinear(4 * width, width, in_axes="ffn",
                                                out_axes="width", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class ExpertFFN(meshkit.Experts):
    """The user's own experts: a GELU MLP per expert, with their own weight names."""

    def __init__(self, num_experts: int, width: int, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.up = meshkit.expert_param(
            init(rngs.params(), (num_experts, width, 2 * width)), None, None, None)
        self.down = meshkit.expert_param(
            init(rngs.params(), (num_experts, 2 * width, width)), None, None, None)

    def padded(self, rows: jax.Array) -> jax.Array:
        hidden = jax.nn.gelu(jnp.einsum("esd,edf->esf", rows, self.up[...]))
        return jnp.einsum("esf,efd->esd", hidden, self.down[...])


class MoEFFN(nnx.Module):
    """meshkit's exchange around the user's experts; its load-balancing loss kept."""

    def __init__(self, width: int, num_experts: int, *, rngs: nnx.Rngs) -> None:
        config = ModelConfig(d_model=width, d_ff=2 * width, num_experts=num_experts, top_k=2,
                             capacity_factor=float(num_experts))  # nothing dropped
        self.moe = meshkit.MoE(config, experts=ExpertFFN(num_experts, width, rngs=rngs),
                               exchange=ExchangeConfig(method="hierarchical"), rngs=rngs)
        self.aux = nnx.Variable(jnp.zeros(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        y, stats = self.moe(x)
        self.aux[...] = stats.aux_loss
        return y


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, *, experts: int, rngs: nnx.Rngs,
                 context: meshkit.ShardingRules | None = None) -> None:
        self.ln_1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = Attention(width, heads, rngs=rngs, context=context)
        self.ln_2 = nnx.LayerNorm(width, rngs=rngs)
        self.mlp = MoEFFN(width, experts, rngs=rngs) if experts else MLP(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class UserGPT(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, vocab: int = VOCAB, width: int = WIDTH,
                 heads: int = HEADS, layers: int = LAYERS, microbatches: int = 0,
                 experts: int = 0, context: meshkit.ShardingRules | None = None) -> None:
        self.context = context
        self.wte = meshkit.ParallelEmbed(vocab, width, axes=("vocab_rows", "width"), rngs=rngs)
        self.microbatches = microbatches
        if microbatches:
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stack(rngs: nnx.Rngs) -> Block:
                return Block(width, heads, experts=0, rngs=rngs)

            self.h = stack(rngs)
        else:
            self.blocks = nnx.List([Block(width, heads, experts=experts, rngs=rngs,
                                          context=context) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)
        self.lm_head = meshkit.ColumnParallelLinear(width, vocab, in_axes="width",
                                                    out_axes="vocab_rows", use_bias=False,
                                                    rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.context is not None:  # each context device: an early and a late chunk
            tokens = meshkit.to_zigzag(tokens, self.context)
        x = self.wte(tokens)
        if self.microbatches:
            x = pipeline(self.h, x, microbatches=self.microbatches)
        else:
            for block in self.blocks:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if self.context is None else meshkit.from_zigzag(logits, self.context)


def make(rngs: nnx.Rngs, **kwargs: Any) -> UserGPT:
    """The user's factory: ``factory(rngs) -> nnx.Module``."""
    with nnx.use_eager_sharding(False):
        return UserGPT(rngs=rngs, **kwargs)


def loss(model: UserGPT, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The user's loss: next-token cross-entropy (plus the MoE's balancing loss), with
    metrics of its own: the cross-entropy, the balancing loss, the logits' mean square."""
    logits = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    aux = jnp.zeros(())
    if hasattr(model, "blocks") and isinstance(model.blocks[0].mlp, MoEFFN):
        aux = sum((block.mlp.aux[...] for block in model.blocks), jnp.zeros(()))
    return ce + 0.01 * aux, {"ce_loss": ce, "aux_loss": aux, "logit_ms": jnp.mean(logits**2)}


def batch(rows: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
