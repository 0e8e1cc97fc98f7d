"""Attention kernels over local heads: materialised scores, jax.nn's, and a chunked one.

Every kind takes ``[B, T, H, h]`` queries, keys and values (the heads this device holds)
and returns ``[B, T, H, h]``; scores are scaled by ``h^-1/2`` and always accumulate in
float32, whatever the compute dtype.

* ``xla``: the ``[B, H, T, T]`` float32 scores, masked and soft-maxed in one piece, the
  softmax's division applied to the output (the backward pass keeps one ``[B, H, T, T]``
  array a layer, the exponentials).
* ``dot_product``: :func:`jax.nn.dot_product_attention`, which picks cuDNN's fused
  kernel on a GPU that has it and XLA elsewhere.
* ``chunked``: blockwise attention (FlashAttention's algorithm in plain JAX): queries
  and keys/values are cut into blocks of ``chunk``; each query block runs an online
  softmax over the key/value blocks, and a custom VJP keeps only the output and the
  log-sum-exp for the backward pass, which recomputes each block's scores. Memory is
  ``O(B·H·T·chunk)``, linear in ``T``, on every backend; with ``causal`` the blocks
  above the diagonal are skipped (``jax.lax.cond``), about half of the work.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from meshkit.choices import ATTENTION_KINDS

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
    return _chunked(q, k, v, chunk, causal)


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


# ---------------------------------------------------------------------- chunked
def _blocks(x: jax.Array, n: int) -> jax.Array:
    """``[B, T, ...]`` -> ``[n, B, T/n, ...]``: the sequence cut into ``n`` blocks."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, n, t // n, *x.shape[2:]), 1, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """Inverse of :func:`_blocks`."""
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])


def _scores(qi: jax.Array, kj: jax.Array, i: jax.Array, j: jax.Array, causal: bool) -> jax.Array:
    """Block ``(i, j)``'s scaled float32 scores ``[B, H, c, c]``, masked if causal."""
    s = jnp.einsum("bqhd,bkhd->bhqk", qi, kj, preferred_element_type=_F32)
    s = s * qi.shape[-1] ** -0.5
    if causal:
        c = qi.shape[1]
        pos = jnp.arange(c)
        # Only the diagonal block (i == j) is partly masked; the loops skip j > i.
        keep = (i * c + pos[:, None]) >= (j * c + pos[None, :])
        s = jnp.where(keep, s, jnp.finfo(_F32).min)
    return s


def _visit(causal: bool, needed: jax.Array, update: Any, carry: Any) -> Any:
    """``update(carry)`` where the block has unmasked entries; skip it where not."""
    if not causal:
        return update(carry)
    return jax.lax.cond(needed, update, lambda c: c, carry)


def _zeros(shape: tuple[int, ...], like: jax.Array) -> jax.Array:
    """Float32 zeros that vary over the same mesh axes as ``like`` (inside shard_map
    a loop carry must keep one type, and the values it accumulates vary)."""
    return jnp.zeros_like(like, shape=shape, dtype=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int, causal: bool) -> jax.Array:
    return _forward(q, k, v, chunk, causal)[0]


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int,
             causal: bool) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, h], lse [n, B, H, c])``: one online softmax per query block."""
    b, t, nh, hd = q.shape
    n = t // chunk
    qs, ks, vs = _blocks(q, n), _blocks(k, n), _blocks(v, n)

    def query_block(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, qi = args

        def kv_block(carry: Any, j: jax.Array) -> tuple[Any, None]:
            def update(carry: Any) -> Any:
                o, m, denom = carry
                s = _scores(qi, ks[j], i, j, causal)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.exp(s - m_new[..., None])
                rescale = jnp.exp(m - m_new)
                denom = denom * rescale + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), vs[j],
                                preferred_element_type=_F32)
                return o * rescale[..., None] + pv, m_new, denom

            return _visit(causal, j <= i, update, carry), None

        init = (_zeros((b, nh, chunk, hd), qi), _zeros((b, nh, chunk), qi) - jnp.inf,
                _zeros((b, nh, chunk), qi))
        (o, m, denom), _ = jax.lax.scan(kv_block, init, jnp.arange(n))
        out = jnp.einsum("bhqd->bqhd", o / denom[..., None]).astype(q.dtype)
        return out, m + jnp.log(denom)

    out, lse = jax.lax.map(query_block, (jnp.arange(n), qs))
    return _unblock(out), lse


def _chunked_fwd(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int,
                 causal: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _forward(q, k, v, chunk, causal)
    return out, (q, k, v, out, lse)


def _chunked_bwd(chunk: int, causal: bool, res: tuple[jax.Array, ...],
                 do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FlashAttention's backward pass: each block's probabilities recomputed from the
    saved log-sum-exp; ``dq`` in a pass over query blocks, ``dk, dv`` over key blocks."""
    q, k, v, out, lse = res
    t, hd = q.shape[1], q.shape[-1]
    n = t // chunk
    scale = hd**-0.5
    # D_q = Σ_d dO·O: the softmax Jacobian's correction term, [n, B, H, c].
    delta = jnp.einsum("nbqhd,nbqhd->nbhq", _blocks(do, n).astype(_F32),
                       _blocks(out, n).astype(_F32))
    qs, ks, vs, dos = _blocks(q, n), _blocks(k, n), _blocks(v, n), _blocks(do, n)

    def grads(i: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Block (i, j)'s probabilities and score gradients, both ``[B, H, c, c]``."""
        p = jnp.exp(_scores(qs[i], ks[j], i, j, causal) - lse[i][..., None])
        dp = jnp.einsum("bqhd,bkhd->bhqk", dos[i], vs[j], preferred_element_type=_F32)
        return p, p * (dp - delta[i][..., None])

    def dq_block(i: jax.Array) -> jax.Array:
        def step(dq: jax.Array, j: jax.Array) -> tuple[jax.Array, None]:
            def update(dq: jax.Array) -> jax.Array:
                _, ds = grads(i, j)
                return dq + jnp.einsum("bhqk,bkhd->bqhd", ds.astype(k.dtype), ks[j],
                                       preferred_element_type=_F32)

            return _visit(causal, j <= i, update, dq), None

        dq, _ = jax.lax.scan(step, _zeros(qs.shape[1:], q), jnp.arange(n))
        return dq * scale

    def dkv_block(j: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(carry: Any, i: jax.Array) -> tuple[Any, None]:
            def update(carry: Any) -> Any:
                dk, dv = carry
                p, ds = grads(i, j)
                dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p.astype(v.dtype), dos[i],
                                     preferred_element_type=_F32)
                dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), qs[i],
                                     preferred_element_type=_F32)
                return dk, dv

            return _visit(causal, j <= i, update, carry), None

        zeros = _zeros(ks.shape[1:], k)
        (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), jnp.arange(n))
        return dk * scale, dv

    dq = jax.lax.map(dq_block, jnp.arange(n))
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
    return (_unblock(dq).astype(q.dtype), _unblock(dk).astype(k.dtype),
            _unblock(dv).astype(v.dtype))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
