"""Context parallelism: attention over a sequence split across the context axes.

The sequence is cut into ``2c`` chunks for ``c`` context devices and device ``r`` holds
chunks ``r`` and ``2c − 1 − r`` (:func:`zigzag_order`): under a causal mask the early
chunks attend to little and the late ones to much, so pairing them evens the work
(:func:`causal_blocks` counts it). Every method attends with the device's own queries
and masks by *global* token indices (:func:`local_index`), so the chunks' order on a
device never matters:

* ``all_gather``: K and V (with their indices and document ids) all-gathered over the
  context axes; each device attends to the whole sequence (the backward pass
  reduce-scatters dK and dV).
* ``ring``: K/V blocks travel round the context group by ``jax.lax.ppermute``, one step
  a block, the partial attentions merged by their log-sum-exps; the backward pass is a
  ring too (a custom VJP), dK and dV travelling with their blocks and arriving home
  after the last step. A device holds its own K/V block and the one arriving.
* ``ulysses``: an all-to-all turns sequence shards into head shards, each device
  attends over the whole sequence with ``H/c`` of the heads, and an all-to-all turns
  the output back (the heads, query and kv, must divide among the group).
* ``hierarchical``: Ulysses over the last (inner) context axis and a ring over the
  others (outer): all-to-alls inside a node, permutes across nodes.

Everything here runs per device, inside ``jax.shard_map``; :func:`to_zigzag` and
:func:`from_zigzag` put a global batch into that order and take it out again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.choices import CONTEXT_METHODS
from meshkit.model import flash

__all__ = ["causal_blocks", "context_attention", "from_zigzag", "local_index",
           "to_zigzag", "zigzag_order"]


def zigzag_order(seq_len: int, devices: int) -> np.ndarray:
    """The token order that gives context device ``r`` chunks ``r`` and ``2c − 1 − r``.

    Args:
        seq_len: ``T``, divisible by ``2·devices``.
        devices: ``c``, the context devices.

    Returns:
        ``[T]`` int32 global indices: position ``p`` of the reordered sequence holds
        token ``order[p]``; device ``r``'s slice is ``[r·T/c, (r+1)·T/c)``.

    Raises:
        ValueError: ``devices`` below 1 or ``2·devices`` not dividing ``seq_len``.

    Examples:
        >>> zigzag_order(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if devices < 1 or seq_len % (2 * devices):
        raise ValueError(f"context: a sequence of {seq_len} tokens does not cut into "
                         f"2·{devices} equal chunks")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * devices, -1)
    pairs = [np.concatenate([chunks[r], chunks[2 * devices - 1 - r]]) for r in range(devices)]
    return np.concatenate(pairs)


def to_zigzag(x: jax.Array, devices: int, *, axis: int = 1) -> jax.Array:
    """``x`` with its sequence dimension in :func:`zigzag_order` (a global array).

    Args:
        x: an array with the sequence on ``axis``.
        devices: the context devices ``c``.
        axis: the sequence dimension.

    Returns:
        ``x`` reordered; split it over the context axes (logical name ``sequence``).

    Raises:
        ValueError: as :func:`zigzag_order`.

    Examples:
        >>> to_zigzag(jnp.arange(8)[None], 2).tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    if devices == 1:
        return x
    return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], devices)), axis=axis)


def from_zigzag(x: jax.Array, devices: int, *, axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_zigzag`: the sequence back in token order.

    Examples:
        >>> x = jnp.arange(8)[None]
        >>> bool((from_zigzag(to_zigzag(x, 2), 2) == x).all())
        True
    """
    if devices == 1:
        return x
    inverse = np.argsort(zigzag_order(x.shape[axis], devices)).astype(np.int32)
    return jnp.take(x, jnp.asarray(inverse), axis=axis)


def local_index(length: int, axes: Sequence[str]) -> jax.Array:
    """This device's ``[T/c]`` global token indices under :func:`zigzag_order` (inside
    ``jax.shard_map``; the context devices numbered over ``axes``, outer first).

    Examples:
        >>> local_index(4, ()).tolist()
        [0, 1, 2, 3]
    """
    if not axes:
        return jnp.arange(length, dtype=jnp.int32)
    c = math.prod(jax.lax.axis_size(a) for a in axes)
    r = jax.lax.axis_index(tuple(axes))
    half = length // 2
    pos = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([r * half + pos, (2 * c - 1 - r) * half + pos])


def causal_blocks(seq_len: int, devices: int, *, block: int, zigzag: bool = True
                  ) -> list[int]:
    """The causal (query block, key block) pairs each context device computes.

    Args:
        seq_len: ``T``.
        devices: ``c``.
        block: the attention block length (divides ``T/(2c)``).
        zigzag: chunks in :func:`zigzag_order`, else contiguous (device ``r`` holds
            ``[r·T/c, (r+1)·T/c)``).

    Returns:
        Per device, the number of block pairs with a key at or before a query.

    Examples:
        >>> causal_blocks(16, 2, block=2), causal_blocks(16, 2, block=2, zigzag=False)
        ([36, 36], [10, 26])
    """
    order = zigzag_order(seq_len, devices) if zigzag else np.arange(seq_len)
    if seq_len % (2 * devices) or (seq_len // (2 * devices)) % block:
        raise ValueError(f"causal_blocks: block {block} does not divide a chunk of "
                         f"{seq_len}/(2·{devices}) tokens")
    starts = np.arange(0, seq_len, block)  # every key block, in token order
    counts = []
    for r in range(devices):
        mine = order[r * seq_len // devices:(r + 1) * seq_len // devices]
        q_last = mine.reshape(-1, block).max(axis=1)
        counts.append(int(sum((starts <= t).sum() for t in q_last)))
    return counts


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axes: Sequence[str],
    method: str = "ring",
    causal: bool = True,
    index: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk: int = 128,
) -> jax.Array:
    """Attention of this device's queries over the whole, context-split sequence.

    Call inside ``jax.shard_map`` with the sequence split over ``axes`` in
    :func:`zigzag_order` (:func:`to_zigzag`). ``meshkit.context_attention`` takes the
    axes from the sharding rules.

    Args:
        q: ``[b, T/c, H, h]`` this device's queries (rotated by their global positions).
        k: ``[b, T/c, Hk, h]`` keys, ``Hk`` dividing ``H`` (grouped-query attention).
        v: ``[b, T/c, Hk, h]`` values.
        axes: the context axes, outer first (none: plain blockwise attention).
        method: one of :data:`meshkit.choices.CONTEXT_METHODS` but ``auto`` (resolved
            by the cost model before the step, :mod:`meshkit.config.context_method`).
        causal: a token attends to tokens of lower or equal global index only.
        index: ``[T/c]`` the local tokens' global indices (default
            :func:`local_index`).
        segment_ids: ``[b, T/c]`` document ids of packed rows, or ``None``: a token
            attends only within its document.
        chunk: the kernel's block length (:mod:`meshkit.model.flash`).

    Returns:
        ``[b, T/c, H, h]`` in ``q``'s dtype.

    Raises:
        ValueError: an unknown method, ``hierarchical`` with fewer than two axes, or
            ``ulysses``/``hierarchical`` with heads (query or kv) not divisible by their
            group, naming the counts.

    Example::

        o = context_attention(q, k, v, axes=("cp",), method="ring")  # in shard_map
    """
    if method not in CONTEXT_METHODS[1:]:
        raise ValueError(f"context_attention: method must be one of "
                         f"{', '.join(CONTEXT_METHODS[1:])}, got {method!r}")
    axes = tuple(axes)
    if index is None:
        index = local_index(q.shape[1], axes)
    if not axes:
        return flash.attend(q, k, v, index, index, segment_ids, segment_ids, causal,
                            min(chunk, q.shape[1]))
    if method == "hierarchical" and len(axes) < 2:
        raise ValueError(f"context_attention: hierarchical needs an outer and an inner "
                         f"context axis, got {axes}")
    inner = {"all_gather": (), "ring": (), "ulysses": axes, "hierarchical": axes[-1:]}[method]
    outer = axes[:len(axes) - len(inner)]
    if inner:
        _check_heads(q, k, inner, method)
        q, k, v = (_seq_to_heads(x, inner) for x in (q, k, v))
        index = jax.lax.all_gather(index, inner, axis=0, tiled=True)
        if segment_ids is not None:
            segment_ids = jax.lax.all_gather(segment_ids, inner, axis=1, tiled=True)
    chunk = min(chunk, q.shape[1])
    if method == "all_gather":
        k_all, v_all = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v))
        kv_index = jax.lax.all_gather(index, axes, axis=0, tiled=True)
        kv_segment = (None if segment_ids is None
                      else jax.lax.all_gather(segment_ids, axes, axis=1, tiled=True))
        o = flash.attend(q, k_all, v_all, index, kv_index, segment_ids, kv_segment, causal,
                         chunk)
    elif outer:
        o = _ring(q, k, v, index, segment_ids, outer, causal, chunk)
    else:
        o = flash.attend(q, k, v, index, index, segment_ids, segment_ids, causal, chunk)
    return _heads_to_seq(o, inner) if inner else o


def _check_heads(q: jax.Array, k: jax.Array, inner: tuple[str, ...], method: str) -> None:
    size = math.prod(jax.lax.axis_size(a) for a in inner)
    for name, heads in (("query", q.shape[2]), ("kv", k.shape[2])):
        if heads % size:
            raise ValueError(f"context_attention: {method} splits the {heads} local {name} "
                             f"heads over {size} devices ({', '.join(inner)}); they must "
                             "divide")


def _seq_to_heads(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[b, T/c, H, h]`` -> ``[b, T, H/c, h]``: Ulysses's first all-to-all."""
    return jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Inverse of :func:`_seq_to_heads`."""
    return jax.lax.all_to_all(x, axes, split_axis=1, concat_axis=2, tiled=True)


# ---------------------------------------------------------------------- ring
def _shift(x: Any, axes: tuple[str, ...]) -> Any:
    """Each device's ``x`` to the next device of its context group (a ring)."""
    c = math.prod(jax.lax.axis_size(a) for a in axes)
    perm = [(r, (r + 1) % c) for r in range(c)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
          segment: jax.Array | None, axes: tuple[str, ...], causal: bool,
          chunk: int) -> jax.Array:
    return _ring_fwd(q, k, v, index, segment, axes, causal, chunk)[0]


def _ring_fwd(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
              segment: jax.Array | None, axes: tuple[str, ...], causal: bool,
              chunk: int) -> tuple[jax.Array, tuple[Any, ...]]:
    c = math.prod(jax.lax.axis_size(a) for a in axes)
    block = (k, v, index, segment)
    out: jax.Array | None = None
    lse: jax.Array | None = None
    for step in range(c):
        if step:
            # Sent once the previous step's attention is done: a device then holds the
            # block in hand and the one arriving, never more.
            block = _shift(jax.lax.optimization_barrier((block, lse))[0], axes)
        kb, vb, ib, sb = block
        o_s, l_s = flash.forward(q, kb, vb, q_index=index, kv_index=ib, q_segment=segment,
                                 kv_segment=sb, causal=causal, chunk=chunk)
        out, lse = ((o_s, l_s) if out is None or lse is None
                    else flash.merge(out, lse, o_s, l_s))
    assert out is not None and lse is not None
    result = out.astype(q.dtype)
    return result, (q, k, v, index, segment, result, lse)


def _ring_bwd(axes: tuple[str, ...], causal: bool, chunk: int, res: tuple[Any, ...],
              do: jax.Array) -> tuple[Any, ...]:
    q, k, v, index, segment, out, lse = res
    c = math.prod(jax.lax.axis_size(a) for a in axes)
    delta = flash.delta_of(out, do)
    block = (k, v, index, segment)
    dq = dk = dv = None
    for step in range(c):
        if step:
            # dK and dV travel with their block; the last shift below brings them home.
            block, (dk, dv) = _shift(jax.lax.optimization_barrier((block, (dk, dv))), axes)
        kb, vb, ib, sb = block
        dq_s, dk_s, dv_s = flash.backward(q, kb, vb, do, lse=lse, delta=delta,
                                          q_index=index, kv_index=ib, q_segment=segment,
                                          kv_segment=sb, causal=causal, chunk=chunk)
        dq = dq_s if dq is None else dq + dq_s
        dk = dk_s if dk is None else dk + dk_s
        dv = dv_s if dv is None else dv + dv_s
    if c > 1:
        dk, dv = _shift((dk, dv), axes)
    assert dq is not None and dk is not None and dv is not None
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
