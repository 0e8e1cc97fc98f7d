"""Blockwise attention with explicit token indices: the kernel under every context method.

FlashAttention's algorithm in plain JAX, written for pieces of a sequence: the queries and
the keys/values each carry their tokens' global indices (and, for packed documents, their
segment ids), so a device can attend with its own queries to any block of keys it holds,
in any order, and the partial results merge exactly (:func:`merge`).

* :func:`forward` gives the output (float32, normalised) and the log-sum-exp of each query
  over the keys it was given; a query that sees no key gets a zero output and a
  log-sum-exp of ``-inf``, so it adds nothing to a merge.
* :func:`backward` gives the gradients of one (queries, keys) pair from the *final*
  log-sum-exp and the output's ``delta = Σ dO·O``, so a ring can sum them block by block.
* :func:`attend` is both under one custom VJP, for a single device's whole keys.

Queries are cut into blocks of ``chunk`` tokens and so are the keys; a block pair whose
every key lies after every query is skipped (``jax.lax.cond``) under ``causal``. Keys and
values may hold fewer heads than the queries (grouped-query attention): query head
``i`` reads kv head ``i // (H / Hk)``. Scores accumulate in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["attend", "backward", "forward", "merge"]

_F32 = jnp.float32
_MASKED = jnp.finfo(_F32).min  # finite: a fully masked row stays free of NaN


def _blocks(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """``x`` with dimension ``axis`` cut into ``n`` blocks, the block index first."""
    shape = x.shape
    x = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblock(x: jax.Array, axis: int = 1) -> jax.Array:
    """Inverse of :func:`_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, c, H, h]`` -> ``[B, c, Hk, g, h]``: query heads by the kv head they read."""
    b, c, nh, hd = q.shape
    return q.reshape(b, c, kv_heads, nh // kv_heads, hd)


def _mask(qi: jax.Array, ki: jax.Array, qs: jax.Array | None, ks: jax.Array | None,
          causal: bool) -> jax.Array | None:
    """Which (query, key) pairs attend: ``[B or 1, 1, 1, cq, ck]``, or ``None`` (all)."""
    keep = None
    if causal:
        keep = (qi[:, None] >= ki[None, :])[None]
    if qs is not None and ks is not None:
        same = qs[:, :, None] == ks[:, None, :]
        keep = same if keep is None else keep & same
    return None if keep is None else keep[:, None, None]


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scaled float32 scores ``[B, Hk, g, cq, ck]`` of a block pair, masked."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(q, k.shape[2]), k,
                   preferred_element_type=_F32) * q.shape[-1] ** -0.5
    return s if mask is None else jnp.where(mask, s, _MASKED)


def _needed(qi: jax.Array, ki: jax.Array, causal: bool) -> jax.Array | bool:
    """Whether a block pair has a key at or before some query (always, if not causal)."""
    return jnp.max(qi) >= jnp.min(ki) if causal else True


def _visit(needed: jax.Array | bool, update: Any, carry: Any) -> Any:
    if needed is True:
        return update(carry)
    return jax.lax.cond(needed, update, lambda c: c, carry)


def _zeros(shape: tuple[int, ...], like: jax.Array) -> jax.Array:
    """Float32 zeros varying over ``like``'s mesh axes (a loop carry keeps one type)."""
    return jnp.zeros_like(like, shape=shape, dtype=_F32)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> tuple[int, int]:
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: keys {k.shape} and values {v.shape} do not match "
                         f"queries {q.shape} ([B, T, heads, head_dim])")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {k.shape[2]} kv heads do not divide {q.shape[2]} "
                         "query heads")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"attention: chunk must be an integer >= 1, got {chunk!r}")
    cq, ck = min(chunk, q.shape[1]), min(chunk, k.shape[1])
    for name, t, c in (("query", q.shape[1], cq), ("key", k.shape[1], ck)):
        if t % c:
            raise ValueError(f"attention: chunk {c} does not divide the {name} length {t}")
    return q.shape[1] // cq, k.shape[1] // ck


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_index: jax.Array,
    kv_index: jax.Array,
    q_segment: jax.Array | None = None,
    kv_segment: jax.Array | None = None,
    causal: bool = True,
    chunk: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Attention of ``q`` over the keys given, with its log-sum-exp, for merging.

    Args:
        q: ``[B, Tq, H, h]`` queries.
        k: ``[B, Tk, Hk, h]`` keys (``Hk`` divides ``H``).
        v: ``[B, Tk, Hk, h]`` values.
        q_index: ``[Tq]`` the queries' global token indices (the causal order).
        kv_index: ``[Tk]`` the keys' global token indices.
        q_segment: ``[B, Tq]`` document ids, or ``None``: a query attends only to keys
            of its own document.
        kv_segment: ``[B, Tk]`` the keys' document ids (with ``q_segment``).
        causal: a query attends to keys of index ``<=`` its own only.
        chunk: block length (longer than a length: one block).

    Returns:
        ``(out [B, Tq, H, h] float32, lse [B, H, Tq] float32)``.

    Raises:
        ValueError: mismatched shapes, kv heads not dividing the query heads, or a chunk
            below 1 or not dividing a length.

    Examples:
        >>> q = jnp.ones((1, 8, 4, 2)); kv = jnp.ones((1, 8, 2, 2))
        >>> out, lse = forward(q, kv, kv, q_index=jnp.arange(8), kv_index=jnp.arange(8),
        ...                    chunk=4)
        >>> out.shape, lse.shape
        ((1, 8, 4, 2), (1, 4, 8))
    """
    nq, nk = _check(q, k, v, chunk)
    b, tq, nh, hd = q.shape
    kh = k.shape[2]
    cq = tq // nq
    qs, qis = _blocks(q, nq), _blocks(q_index, nq, axis=0)
    ks, vs, kis = _blocks(k, nk), _blocks(v, nk), _blocks(kv_index, nk, axis=0)
    qss = None if q_segment is None else _blocks(q_segment, nq)
    kss = None if kv_segment is None else _blocks(kv_segment, nk)

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        qi, qii = qs[i], qis[i]
        qsi = None if qss is None else qss[i]

        def kv_block(carry: Any, j: jax.Array) -> tuple[Any, None]:
            def update(carry: Any) -> Any:
                o, m, denom = carry
                s = _scores(qi, ks[j], _mask(qii, kis[j], qsi,
                                             None if kss is None else kss[j], causal))
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.exp(s - m_new[..., None])
                rescale = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vs[j],
                                preferred_element_type=_F32)
                return (o * rescale[..., None] + pv, m_new,
                        denom * rescale + jnp.sum(p, axis=-1))

            return _visit(_needed(qii, kis[j], causal), update, carry), None

        g = nh // kh
        init = (_zeros((b, kh, g, cq, hd), qi), _zeros((b, kh, g, cq), qi) - jnp.inf,
                _zeros((b, kh, g, cq), qi))
        (o, m, denom), _ = jax.lax.scan(kv_block, init, jnp.arange(nk))
        seen = denom > 0
        out = jnp.where(seen[..., None], o / jnp.where(seen, denom, 1)[..., None], 0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1)), -jnp.inf)
        out = jnp.einsum("bkgqd->bqkgd", out).reshape(b, cq, nh, hd)
        return out, lse.reshape(b, nh, cq)

    out, lse = jax.lax.map(query_block, jnp.arange(nq))
    return _unblock(out), _unblock(lse, axis=2)


def merge(out: jax.Array, lse: jax.Array, out_b: jax.Array, lse_b: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions of the same queries over disjoint keys, as one.

    Args:
        out: ``[B, T, H, h]`` float32, normalised over its keys.
        lse: ``[B, H, T]`` its log-sum-exp (``-inf``: no key).
        out_b: the other part's output.
        lse_b: the other part's log-sum-exp.

    Returns:
        ``(out, lse)`` over both key sets.

    Examples:
        >>> o, l = merge(jnp.ones((1, 1, 1, 2)), jnp.zeros((1, 1, 1)),
        ...              jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1)))
        >>> o.tolist(), round(float(l[0, 0, 0]), 4)
        ([[[[0.5, 0.5]]]], 0.6931)
    """
    total = jnp.logaddexp(lse, lse_b)
    safe = jnp.where(jnp.isfinite(total), total, 0)
    w_a = jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe), 0)
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0)
    def per_token(w: jax.Array) -> jax.Array:
        return jnp.einsum("bht->bth", w)[..., None]
    return out * per_token(w_a) + out_b * per_token(w_b), total


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    *,
    lse: jax.Array,
    delta: jax.Array,
    q_index: jax.Array,
    kv_index: jax.Array,
    q_segment: jax.Array | None = None,
    kv_segment: jax.Array | None = None,
    causal: bool = True,
    chunk: int = 128,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients through one (queries, keys) pair of a whole attention.

    Each block's probabilities are recomputed from the whole attention's ``lse``, so the
    gradients of the pairs a query takes part in sum to its gradient.

    Args:
        q, k, v: as in :func:`forward`.
        do: ``[B, Tq, H, h]`` the output's cotangent.
        lse: ``[B, H, Tq]`` the log-sum-exp over *all* keys.
        delta: ``[B, H, Tq]`` ``Σ_d dO·O`` of the whole output.
        q_index, kv_index, q_segment, kv_segment, causal, chunk: as in :func:`forward`.

    Returns:
        ``(dq, dk, dv)``, float32, shaped as ``q``, ``k`` and ``v``.

    Raises:
        ValueError: as :func:`forward`.

    Examples:
        >>> q = jnp.ones((1, 4, 2, 2)); i = jnp.arange(4)
        >>> out, lse = forward(q, q, q, q_index=i, kv_index=i)
        >>> delta = jnp.einsum("bthd,bthd->bht", q, out)
        >>> [g.shape for g in backward(q, q, q, q, lse=lse, delta=delta, q_index=i,
        ...                            kv_index=i)]
        [(1, 4, 2, 2), (1, 4, 2, 2), (1, 4, 2, 2)]
    """
    nq, nk = _check(q, k, v, chunk)
    kh = k.shape[2]
    scale = q.shape[-1] ** -0.5
    qs, dos, qis = _blocks(q, nq), _blocks(do, nq), _blocks(q_index, nq, axis=0)
    lses, deltas = _blocks(lse, nq, axis=2), _blocks(delta, nq, axis=2)
    ks, vs, kis = _blocks(k, nk), _blocks(v, nk), _blocks(kv_index, nk, axis=0)
    qss = None if q_segment is None else _blocks(q_segment, nq)
    kss = None if kv_segment is None else _blocks(kv_segment, nk)

    def by_group(x: jax.Array) -> jax.Array:  # [B, H, c] -> [B, Hk, g, c, 1]
        b, nh, c = x.shape
        return x.reshape(b, kh, nh // kh, c)[..., None]

    def grads(i: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Block (i, j)'s probabilities and score gradients, ``[B, Hk, g, cq, ck]``."""
        mask = _mask(qis[i], kis[j], None if qss is None else qss[i],
                     None if kss is None else kss[j], causal)
        p = jnp.exp(_scores(qs[i], ks[j], mask) - by_group(lses[i]))
        dp = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(dos[i], kh), vs[j],
                        preferred_element_type=_F32)
        return p, p * (dp - by_group(deltas[i]))

    def dq_block(i: jax.Array) -> jax.Array:
        def step(dq: jax.Array, j: jax.Array) -> tuple[jax.Array, None]:
            def update(dq: jax.Array) -> jax.Array:
                _, ds = grads(i, j)
                return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), ks[j],
                                       preferred_element_type=_F32)

            return _visit(_needed(qis[i], kis[j], causal), update, dq), None

        shape = _grouped(qs[i], kh).shape
        dq, _ = jax.lax.scan(step, _zeros(shape, q), jnp.arange(nk))
        return (dq * scale).reshape(qs[i].shape)

    def dkv_block(j: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(carry: Any, i: jax.Array) -> tuple[Any, None]:
            def update(carry: Any) -> Any:
                dk, dv = carry
                p, ds = grads(i, j)
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype),
                                     _grouped(dos[i], kh), preferred_element_type=_F32)
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype),
                                     _grouped(qs[i], kh), preferred_element_type=_F32)
                return dk, dv

            return _visit(_needed(qis[i], kis[j], causal), update, carry), None

        zeros = _zeros(ks.shape[1:], k)
        (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), jnp.arange(nq))
        return dk * scale, dv

    dq = jax.lax.map(dq_block, jnp.arange(nq))
    # Filled in place from buffers that depend on the cotangent: a lax.map's zero-filled
    # output buffers are hoisted by XLA to the step's start, every layer's live at once.
    start = jnp.zeros(ks.shape, _F32) + (do[0, 0, 0, 0] != do[0, 0, 0, 0]).astype(_F32) * 0

    def put(carry: Any, j: jax.Array) -> tuple[Any, None]:
        dk_j, dv_j = dkv_block(j)
        return (carry[0].at[j].set(dk_j), carry[1].at[j].set(dv_j)), None

    (dk, dv), _ = jax.lax.scan(put, (start, start), jnp.arange(nk))
    return _unblock(dq), _unblock(dk), _unblock(dv)


def delta_of(out: jax.Array, do: jax.Array) -> jax.Array:
    """``Σ_d dO·O`` ``[B, H, T]``: the softmax Jacobian's correction term, float32."""
    return jnp.einsum("bthd,bthd->bht", do.astype(_F32), out.astype(_F32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array,
           kv_index: jax.Array, q_segment: jax.Array | None, kv_segment: jax.Array | None,
           causal: bool, chunk: int) -> jax.Array:
    """:func:`forward`'s output in ``q``'s dtype, differentiated by :func:`backward`: only
    the inputs, the output and the log-sum-exp are kept for the backward pass.

    Examples:
        >>> q = jnp.ones((1, 4, 2, 2)); i = jnp.arange(4)
        >>> attend(q, q, q, i, i, None, None, True, 2).shape
        (1, 4, 2, 2)
    """
    return _attend_fwd(q, k, v, q_index, kv_index, q_segment, kv_segment, causal, chunk)[0]


def _attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array,
                kv_index: jax.Array, q_segment: jax.Array | None,
                kv_segment: jax.Array | None, causal: bool, chunk: int
                ) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lse = forward(q, k, v, q_index=q_index, kv_index=kv_index, q_segment=q_segment,
                       kv_segment=kv_segment, causal=causal, chunk=chunk)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_index, kv_index, q_segment, kv_segment, out, lse)


def _attend_bwd(causal: bool, chunk: int, res: tuple[Any, ...], do: jax.Array
                ) -> tuple[Any, ...]:
    q, k, v, q_index, kv_index, q_segment, kv_segment, out, lse = res
    dq, dk, dv = backward(q, k, v, do, lse=lse, delta=delta_of(out, do), q_index=q_index,
                          kv_index=kv_index, q_segment=q_segment, kv_segment=kv_segment,
                          causal=causal, chunk=chunk)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


attend.defvjp(_attend_fwd, _attend_bwd)
