"""Attention kernels over local heads: materialised scores, jax.nn's, and a chunked one.

Every kind takes ``[B, T, H, h]`` queries, keys and values (the heads this device holds)
and returns ``[B, T, H, h]``; scores are scaled by ``h^-1/2`` and always accumulate in
float32, whatever the compute dtype.

* ``xla``: the ``[B, H, T, T]`` float32 scores, masked and soft-maxed in one piece, the
  softmax's division applied to the output (the backward pass keeps one ``[B, H, T, T]``
  array a layer, the exponentials).
* ``dot_product``: :func:`jax.nn.dot_product_attention`, which picks cuDNN's fused
  kernel on a GPU that has it and XLA elsewhere.
* ``chunked``: blockwise attention (FlashAttention's algorithm in plain JAX,
  :mod:`meshkit.model.flash`): queries and keys/values are cut into blocks of ``chunk``;
  each query block runs an online softmax over the key/value blocks, and a custom VJP
  keeps only the output and the log-sum-exp for the backward pass, which recomputes
  each block's scores. Memory is ``O(B·H·T·chunk)``, linear in ``T``, on every backend;
  with ``causal`` the blocks above the diagonal are skipped (``jax.lax.cond``), about
  half of the work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshkit.choices import ATTENTION_KINDS
from meshkit.model import flash

__all__ = ["attention"]

_F32 = jnp.float32


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kind: str = "xla",
    chunk: int = 128,
    causal: bool = True,
) -> jax.Array:
    """Scaled dot-product attention of local heads, by one of the kernels above.

    Args:
        q: ``[B, T, H, h]`` queries.
        k: ``[B, T, H, h]`` keys, of ``q``'s dtype.
        v: ``[B, T, H, h]`` values, of ``q``'s dtype.
        kind: one of :data:`meshkit.choices.ATTENTION_KINDS`.
        chunk: block length of ``chunked`` (a chunk longer than ``T`` is one block).
        causal: position ``t`` attends to positions ``<= t`` only.

    Returns:
        ``[B, T, H, h]`` in ``q``'s dtype.

    Raises:
        ValueError: an unknown ``kind``, or a ``chunk`` below 1 or not dividing ``T``.

    Examples:
        >>> q = jnp.ones((1, 8, 2, 4))
        >>> attention(q, q, q, kind="chunked", chunk=4).shape
        (1, 8, 2, 4)
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention: unknown kind {kind!r}; valid: {', '.join(ATTENTION_KINDS)}")
    if kind == "xla":
        return _xla(q, k, v, causal=causal)
    if kind == "dot_product":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    t = q.shape[1]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"attention: chunk must be an integer >= 1, got {chunk!r}")
    chunk = min(chunk, t)
    if t % chunk:
        raise ValueError(f"attention: chunk {chunk} does not divide the sequence length {t}")
    index = jnp.arange(t, dtype=jnp.int32)
    return flash.attend(q, k, v, index, index, None, None, causal, chunk)


def _xla(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
    t = q.shape[1]
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=_F32)
    scores = scores * q.shape[-1] ** -0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(_F32).min)
    # The softmax's division after the product with v, as MaxText's attention does: the
    # backward pass keeps exp(scores - max) only, one [B, H, T, T] array. Normalised
    # first (jax.nn.softmax), it would keep the probabilities too (XLA's CPU fusion
    # recomputes them from the exponentials, and the v product's transpose reads them).
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    unnormalized = jnp.exp(scores - top)
    out = jnp.einsum("bhqs,bshk->bqhk", unnormalized.astype(v.dtype), v,
                     preferred_element_type=_F32)
    total = jnp.einsum("bhq->bqh", jnp.sum(unnormalized, axis=-1))
    return (out / total[..., None]).astype(q.dtype)
