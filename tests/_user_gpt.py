"""A user's own tiny GPT, built from meshkit's parallel layers: what `train(model=...)` and
`meshkit train model.factory=...` train in the tests.

Its parameters carry logical names: ``vocab`` and ``heads`` (meshkit's), ``embed``
(the fsdp role's), and its own ``mlp``, which a run maps with ``parallel.logical_axes:
{mlp: tensor}`` or ``ShardingRules.extend(mlp="tensor")``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshkit.sharding.linear import ColumnParallelLinear, ParallelEmbed, RowParallelLinear


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = ColumnParallelLinear(d, (3, heads, d // heads), out_axes=(None, "heads", None),
                                        rngs=rngs)
        self.out = RowParallelLinear((heads, d // heads), d, in_axes=("heads", None), rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = ColumnParallelLinear(d, 4 * d, out_axes="mlp", rngs=rngs)
        self.down = RowParallelLinear(4 * d, d, in_axes="mlp", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        qkv = self.qkv(self.ln1(x))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * q.shape[-1] ** -0.5
        t = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        x = x + self.out(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, -1), v))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, vocab: int = 16, d: int = 16, heads: int = 4,
                 layers: int = 1) -> None:
        self.embed = ParallelEmbed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.head = ColumnParallelLinear(d, vocab, out_axes="vocab", use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(rngs: nnx.Rngs, **kwargs: int) -> GPT:
    return GPT(rngs, **kwargs)


def loss(model: GPT, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy, with metrics of the user's own: the same loss as ``ce_loss`` and the
    logits' mean square."""
    logits = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return ce, {"ce_loss": ce, "logit_ms": jnp.mean(logits**2)}
