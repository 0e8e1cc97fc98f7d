"""Context parallelism: attention over a sequence split across the context axes.

The sequence is cut into ``2c`` chunks for ``c`` context devices and device ``r`` holds
chunks ``r`` and ``2c − 1 − r`` (:func:`zigzag_order`): under a causal mask the early
chunks attend to little and the late ones to much, so pairing them evens the work
(:func:`meshkit.config.context_method.causal_blocks` counts it). Every method attends
with the device's own queries and masks by *global* token indices
(:func:`local_index`), so the chunks' order on a device never matters:

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
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from meshkit.choices import CONTEXT_METHODS
from meshkit.config.context_method import choose
from meshkit.exchange import cost
from meshkit.model import flash
from meshkit.sharding.rules import ShardingRules, axes_entry, entry_axes

__all__ = ["context_attention", "from_zigzag", "kv_for_local_heads",
           "local_attention", "local_index", "to_zigzag", "zigzag_order"]


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


def to_zigzag(x: jax.Array, devices: int | ShardingRules | None = None, *, axis: int = 1
              ) -> jax.Array:
    """``x`` with its sequence dimension in :func:`zigzag_order` (a global array).

    Args:
        x: an array with the sequence on ``axis``.
        devices: the context devices ``c``, or sharding rules whose context axes' sizes
            on the mesh in force give it (``None``: the logical rules in effect, as
            :func:`meshkit.constrain` reads them).
        axis: the sequence dimension.

    Returns:
        ``x`` reordered; split it over the context axes (logical name ``sequence``).

    Raises:
        ValueError: as :func:`zigzag_order`.

    Examples:
        >>> to_zigzag(jnp.arange(8)[None], 2).tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    c = _devices(devices)
    if c == 1:
        return x
    return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], c)), axis=axis)


def from_zigzag(x: jax.Array, devices: int | ShardingRules | None = None, *, axis: int = 1
                ) -> jax.Array:
    """Inverse of :func:`to_zigzag`: the sequence back in token order.

    Args:
        x: an array with the sequence on ``axis``, in zigzag order.
        devices: as :func:`to_zigzag`.
        axis: the sequence dimension.

    Returns:
        ``x`` in token order.

    Raises:
        ValueError: as :func:`zigzag_order`.

    Examples:
        >>> x = jnp.arange(8)[None]
        >>> bool((from_zigzag(to_zigzag(x, 2), 2) == x).all())
        True
    """
    c = _devices(devices)
    if c == 1:
        return x
    inverse = np.argsort(zigzag_order(x.shape[axis], c)).astype(np.int32)
    return jnp.take(x, jnp.asarray(inverse), axis=axis)


def _devices(devices: int | ShardingRules | None) -> int:
    if isinstance(devices, int):
        return devices
    context = _roles(devices)[1]
    if not context:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("to_zigzag: sharding rules give the context devices under "
                         "`with jax.set_mesh(mesh):` only")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in context)


Axes = tuple[str, ...]


def _roles(rules: ShardingRules | None) -> tuple[Axes, Axes, Axes]:
    """``(batch, context, tensor)`` axes: of ``rules``, or of the logical rules in effect
    (``nnx.logical_axis_rules(rules.flax_rules())``, which meshkit's trainer sets around
    a model's step), read through the names ``batch``, ``sequence`` and ``heads``."""
    if rules is not None:
        return rules.batch_axes, rules.context, rules.tensor
    table = dict(flax_spmd.get_logical_axis_rules())
    if not table:
        raise ValueError("context_attention: no sharding rules: pass rules=, or run under "
                         "nnx.logical_axis_rules(rules.flax_rules())")
    return tuple(entry_axes(table.get(n)) for n in ("batch", "sequence", "heads"))  # type: ignore[return-value]


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


def local_attention(
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
    :func:`zigzag_order` (:func:`to_zigzag`); :func:`context_attention` is the same on
    global arrays, inside ``jax.jit``.

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

        o = local_attention(q, k, v, axes=("cp",), method="ring")  # in shard_map
    """
    if method not in CONTEXT_METHODS[1:]:
        raise ValueError(f"local_attention: method must be one of "
                         f"{', '.join(CONTEXT_METHODS[1:])}, got {method!r}")
    axes = tuple(axes)
    if index is None:
        index = local_index(q.shape[1], axes)
    if not axes:
        return flash.attend(q, k, v, index, index, segment_ids, segment_ids, causal,
                            min(chunk, q.shape[1]))
    if method == "hierarchical" and len(axes) < 2:
        raise ValueError(f"local_attention: hierarchical needs an outer and an inner "
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
        o = _gathered(q, k, v, index, segment_ids, axes, causal, chunk)
    elif outer:
        o = _ring(q, k, v, index, segment_ids, outer, causal, chunk)
    else:
        o = flash.attend(q, k, v, index, index, segment_ids, segment_ids, causal, chunk)
    return _heads_to_seq(o, inner) if inner else o


def _check_heads(q: jax.Array, k: jax.Array, inner: tuple[str, ...], method: str) -> None:
    size = math.prod(jax.lax.axis_size(a) for a in inner)
    for name, heads in (("query", q.shape[2]), ("kv", k.shape[2])):
        if heads % size:
            raise ValueError(f"local_attention: {method} splits the {heads} local {name} "
                             f"heads over {size} devices ({', '.join(inner)}); they must "
                             "divide")


def _seq_to_heads(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[b, T/c, H, h]`` -> ``[b, T, H/c, h]``: Ulysses's first all-to-all."""
    return jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Inverse of :func:`_seq_to_heads`."""
    return jax.lax.all_to_all(x, axes, split_axis=1, concat_axis=2, tiled=True)


# ---------------------------------------------------------------------- all_gather
def _gather_kv(k: jax.Array, v: jax.Array, index: jax.Array, segment: jax.Array | None,
               axes: tuple[str, ...]) -> tuple[Any, ...]:
    """The whole sequence's K, V, indices and document ids."""
    def gather(x: jax.Array, axis: int) -> jax.Array:
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True)

    return (gather(k, 1), gather(v, 1), gather(index, 0),
            None if segment is None else gather(segment, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gathered(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
              segment: jax.Array | None, axes: tuple[str, ...], causal: bool,
              chunk: int) -> jax.Array:
    return _gathered_fwd(q, k, v, index, segment, axes, causal, chunk)[0]


def _gathered_fwd(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
                  segment: jax.Array | None, axes: tuple[str, ...], causal: bool,
                  chunk: int) -> tuple[jax.Array, tuple[Any, ...]]:
    k_all, v_all, kv_index, kv_segment = _gather_kv(k, v, index, segment, axes)
    out, lse = flash.forward(q, k_all, v_all, q_index=index, kv_index=kv_index,
                             q_segment=segment, kv_segment=kv_segment, causal=causal,
                             chunk=chunk)
    out = out.astype(q.dtype)
    # The local K and V are kept, not the gathered ones: the backward pass gathers them
    # again, so a layer keeps T/c of them, as the ring does.
    return out, (q, k, v, index, segment, out, lse)


def _gathered_bwd(axes: tuple[str, ...], causal: bool, chunk: int, res: tuple[Any, ...],
                  do: jax.Array) -> tuple[Any, ...]:
    q, k, v, index, segment, out, lse = res
    # XLA (CPU) merges an all-gather of the same K with the forward's and keeps its result
    # to here; a dependence on the cotangent (0, NaN-free) makes this gather a new one.
    zero = (do[0, 0, 0, 0] != do[0, 0, 0, 0]).astype(k.dtype) * 0
    k, v = k + zero, v + zero
    k_all, v_all, kv_index, kv_segment = _gather_kv(k, v, index, segment, axes)
    dq, dk, dv = flash.backward(q, k_all, v_all, do, lse=lse, delta=flash.delta_of(out, do),
                                q_index=index, kv_index=kv_index, q_segment=segment,
                                kv_segment=kv_segment, causal=causal, chunk=chunk)

    def home(g: jax.Array) -> jax.Array:  # every device's part of each block, summed
        return jax.lax.psum_scatter(g, axes, scatter_dimension=1, tiled=True)

    return (dq.astype(q.dtype), home(dk).astype(k.dtype), home(dv).astype(v.dtype),
            None, None)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


# ---------------------------------------------------------------------- ring
def _vary_like(tree: Any, like: jax.Array) -> Any:
    """``tree``'s arrays marked varying over ``like``'s mesh axes too: the barrier that
    orders a ring step joins them, and a loop carry keeps one type."""
    want = set(jax.typeof(like).manual_axis_type.varying)

    def cast(a: jax.Array) -> jax.Array:
        extra = tuple(sorted(want - set(jax.typeof(a).manual_axis_type.varying)))
        return jax.lax.pcast(a, extra, to="varying") if extra else a

    return jax.tree.map(cast, tree)


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

    def attend(block: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
        kb, vb, ib, sb = block
        return flash.forward(q, kb, vb, q_index=index, kv_index=ib, q_segment=segment,
                             kv_segment=sb, causal=causal, chunk=chunk)

    def step(carry: tuple[Any, ...], _: None) -> tuple[tuple[Any, ...], None]:
        block, out, lse = carry
        # The block in hand goes on to the next device while this one attends to it (a
        # backend that runs the two at once hides the transfer), sent once the previous
        # step's attention is done: a device holds the block in hand and the one
        # arriving, never more.
        ahead = _shift(jax.lax.optimization_barrier((block, lse))[0], axes)
        return (ahead, *flash.merge(out, lse, *attend(block))), None

    own = (k, v, index, segment)
    ahead = _shift(own, axes)
    out, lse = attend(own)
    (block, out, lse), _ = jax.lax.scan(step, (_vary_like(ahead, lse), out, lse), None,
                                        length=c - 2)
    out, lse = flash.merge(out, lse, *attend(block))
    result = out.astype(q.dtype)
    return result, (q, k, v, index, segment, result, lse)


def _ring_bwd(axes: tuple[str, ...], causal: bool, chunk: int, res: tuple[Any, ...],
              do: jax.Array) -> tuple[Any, ...]:
    q, k, v, index, segment, out, lse = res
    c = math.prod(jax.lax.axis_size(a) for a in axes)
    delta = flash.delta_of(out, do)

    def grads(block: tuple[Any, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
        kb, vb, ib, sb = block
        return flash.backward(q, kb, vb, do, lse=lse, delta=delta, q_index=index,
                              kv_index=ib, q_segment=segment, kv_segment=sb, causal=causal,
                              chunk=chunk)

    def step(carry: tuple[Any, ...], _: None) -> tuple[tuple[Any, ...], None]:
        block, dq, dkv = carry
        # dK and dV travel with their block; the last shift below brings them home.
        block, dkv = _shift(jax.lax.optimization_barrier((block, dkv)), axes)
        dq_s, dk_s, dv_s = grads(block)
        return (block, dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)), None

    own = (k, v, index, segment)
    dq, dk, dv = grads(own)
    dkv = _vary_like((dk, dv), dq)
    (_, dq, dkv), _ = jax.lax.scan(step, (_vary_like(own, dk), dq, dkv), None, length=c - 1)
    dk, dv = _shift(dkv, axes)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def kv_for_local_heads(k: jax.Array, *, num_heads: int, local_heads: int,
                       tensor: Sequence[str]) -> jax.Array:
    """Keys (or values) of every kv head, narrowed to those this tensor rank's query
    heads read (inside ``jax.shard_map``): where the tensor axes do not divide the kv
    heads, each rank computes them all and keeps its own.

    Args:
        k: ``[b, T, Hk, h]`` all kv heads.
        num_heads: ``H``, all query heads.
        local_heads: the query heads this rank holds (``H/t``).
        tensor: the tensor axes.

    Returns:
        ``[b, T, H/t, h]``: the kv head of each local query head.

    Examples:
        >>> kv_for_local_heads(jnp.ones((1, 2, 2, 4)), num_heads=4, local_heads=4,
        ...                    tensor=()).shape
        (1, 2, 4, 4)
    """
    first = jax.lax.axis_index(tuple(tensor)) * local_heads if tensor else 0
    pick = (first + jnp.arange(local_heads)) // (num_heads // k.shape[2])
    return jnp.take(k, pick, axis=2)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    rules: ShardingRules | None = None,
    method: str = "auto",
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    chunk: int = 128,
) -> jax.Array:
    """Causal attention of global arrays whose sequence is split over the context axes.

    For a user's own model, inside ``jax.jit`` under ``jax.set_mesh``: the batch is split
    over ``rules``' batch axes (logical ``batch``), the sequence over its context axes
    (``sequence``, in :func:`zigzag_order`: put the tokens in it with :func:`to_zigzag`
    before the embedding and take the outputs out with :func:`from_zigzag`), and the heads
    over its tensor axes where they divide (``heads``, ``kv_heads``). Without context axes
    it is plain blockwise attention.

    Args:
        q: ``[B, T, H, h]`` queries, rotated by their positions in the sequence.
        k: ``[B, T, Hk, h]`` keys (``Hk`` divides ``H``: grouped-query attention).
        v: ``[B, T, Hk, h]`` values.
        rules: the sharding rules (``rules.context``: the context axes, outer first), or
            ``None``: the logical rules in effect (``batch``, ``sequence`` and ``heads``
            give the batch, context and tensor axes), as :func:`meshkit.constrain` reads
            them; meshkit's trainer sets them around a ``model.factory`` model's step.
        method: one of :data:`meshkit.choices.CONTEXT_METHODS`; ``auto`` asks the cost
            model (:func:`meshkit.config.context_method.choose`, all links taken as one
            node's; a config's ``parallel.context_method`` knows the topology).
        causal: a token attends to tokens at or before its index only.
        segment_ids: ``[B, T]`` document ids of packed rows (in the same order as the
            sequence), or ``None``.
        positions: ``[T]`` each position's global token index (the causal order), or
            ``None``: the zigzag order's.
        chunk: the kernel's block length.

    Returns:
        ``[B, T, H, h]``, sharded as ``q``.

    Raises:
        ValueError: an unknown method; ``T`` not cut into ``2c`` chunks; heads that the
            method cannot split (naming them).

    Example::

        with jax.set_mesh(mesh):  # rules = ShardingRules(data="dp", context="cp")
            o = jax.jit(lambda q, k, v: context_attention(q, k, v, rules=rules))(q, k, v)
    """
    if method not in CONTEXT_METHODS:
        raise ValueError(f"context_attention: method must be one of "
                         f"{', '.join(CONTEXT_METHODS)}, got {method!r}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("context_attention must be called under `with jax.set_mesh(mesh):`")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    batch_axes, axes, tensor = _roles(rules)
    c = math.prod(sizes[a] for a in axes)
    if c > 1 and q.shape[1] % (2 * c):
        raise ValueError(f"context_attention: a sequence of {q.shape[1]} tokens does not "
                         f"cut into 2·{c} equal chunks for the context axes {axes}")
    t = math.prod(sizes[a] for a in tensor)
    kv_split = k.shape[2] % t == 0
    if method == "auto":
        method = _auto(q.shape, k.shape[2] // t if kv_split else k.shape[2], t=t,
                       context_sizes=tuple(sizes[a] for a in axes), dtype=q.dtype)
    batch, heads = axes_entry(batch_axes), axes_entry(tensor)
    q_spec = P(batch, axes or None, heads, None)
    kv_spec = P(batch, axes or None, heads if kv_split else None, None)
    row_spec = P(batch, axes or None)

    def local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None,
              index: jax.Array | None) -> jax.Array:
        if tensor and not kv_split:
            k, v = (kv_for_local_heads(x, num_heads=t * q.shape[2], local_heads=q.shape[2],
                                       tensor=tensor) for x in (k, v))
        return local_attention(q, k, v, axes=axes, method=method, causal=causal,
                               index=index, segment_ids=seg, chunk=chunk)

    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, row_spec, P(axes or None)),
                         out_specs=q_spec)(q, k, v, segment_ids, positions)


def _auto(q_shape: tuple[int, ...], kv_heads: int, *, t: int, context_sizes: tuple[int, ...],
          dtype: Any) -> str:
    """``auto`` for :func:`context_attention`: the cost model's pick, every context axis
    on one node's links."""
    if not context_sizes:
        return CONTEXT_METHODS[1]
    topology = cost.default_topology(1, math.prod(context_sizes))
    return choose(seq_len=q_shape[1], batch=q_shape[0], heads=q_shape[2], kv_heads=kv_heads,
                  head_dim=q_shape[3], dtype_bytes=jnp.dtype(dtype).itemsize,
                  context_sizes=context_sizes, links=(topology.intra,) * len(context_sizes),
                  flops_per_s=topology.flops_per_s).method
