"""How the sequence's K/V travel between context devices: the cost of each method, and ``auto``.

``parallel.context_method`` (``meshkit.choices.CONTEXT_METHODS``) over context axes of sizes
``c_1, …, c_k`` (outer first), ``c = ∏ c_i`` devices, each holding ``n = T/c`` tokens of
every sequence. Per device, with ``b`` local sequences, ``H`` query heads and ``Hk`` kv
heads per tensor rank of width ``h`` and ``d`` bytes a value::

    Q = b·n·H·h·d      (its queries, its output, and their gradients)
    KV = b·n·Hk·h·d    (its K, or its V, and their gradients)

One attention layer's forward and backward, per device:

* ``all_gather``: K and V are all-gathered over the group (each device receives the
  ``c−1`` others' blocks: ``KV·(c−1)`` bytes each), and the backward reduce-scatters
  dK and dV (the same bytes)::

      T = 4·G(KV) + F_fwd + F_bwd

* ``ring``: ``c−1`` forward steps, each sending this device's current K and V block
  (``2·KV``) to the next device of the ring while it computes the block it has; the
  backward has ``c−1`` steps moving K, V, dK and dV (``4·KV``) and one step taking dK and
  dV home (``2·KV``). A step costs the link's latency plus its bytes; it overlaps the
  block's compute (``max``) where FLOP/s are known::

      T = (c−1)·max(f, S(2·KV)) + f + (c−1)·max(2.5f, S(4·KV)) + 2.5f + S(2·KV)

* ``ulysses``: all-to-alls turn q, k and v from sequence shards into head shards over
  the group, attention runs on the whole sequence, and one turns o back; the backward
  runs the transposes (dO in; dq, dk, dv out). Each moves ``(c−1)/c`` of its tensor::

      T = 2·(2·A(Q) + 2·A(KV)) + F_fwd + F_bwd

* ``hierarchical``: Ulysses over the last (inner) axis of size ``u``, then a ring over the
  outer axes (``r = c/u`` devices) with the inner all-to-all's K/V (``KV`` bytes a device
  again: ``u`` times the tokens, ``1/u`` of the heads).

``G(x)`` (an all-gather of ``x`` a device, or a reduce-scatter of ``c·x``) and ``A(x)``
(an all-to-all of ``x`` a device) send one piece to each peer: the latency of every
message one after another, and the bytes over each kind of link at the same time, the
exchange's flat all-to-all (:mod:`meshkit.exchange.cost`). A peer is reached over the
slowest link among the axes its position differs in. ``S(x)`` is one ring step: the
latency and bandwidth of the slowest link the ring's axes use. ``F_fwd`` is the causal
attention's ``2·b·T²·H·h/c`` FLOPs (half of ``4·b·T²·H·h``) over ``flops_per_s``, ``f =
F_fwd/r`` one ring step's share, and the backward costs 2.5 times the forward (it
recomputes the scores and runs four matmuls to the forward's two).

``auto`` (:func:`choose`) keeps the simplest method within ``CHOOSE_MARGIN`` (5 %) of the
fastest, as the exchange does, and never picks a method the heads rule out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from meshkit.exchange import cost
from meshkit.strategy.axes import axis_names

if TYPE_CHECKING:
    from meshkit.config import Config
    from meshkit.strategy.ranks import Strategy

__all__ = ["BACKWARD_FLOPS", "SIMPLICITY", "Choice", "axis_links", "causal_blocks", "choose",
           "picked", "predict", "resolve"]

#: The context methods, simplest first: ``auto`` keeps the first that is within the
#: margin of the fastest. ``all_gather`` is two collectives around the unchanged local
#: kernel (XLA's own transpose gives the backward); ``ring`` needs its own online-softmax
#: loop and custom VJP but no condition on the heads; ``ulysses`` re-lays four tensors
#: out (sequence ↔ heads) and needs the heads to divide among the group; ``hierarchical``
#: is both of the last two at once, and needs two context axes as well.
SIMPLICITY: tuple[str, ...] = ("all_gather", "ring", "ulysses", "hierarchical")
#: The backward's attention FLOPs over the forward's: recomputed scores plus four
#: matmuls (dV, dP, dQ, dK) against the forward's two (QKᵀ, PV).
BACKWARD_FLOPS = 2.5
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check(method: str, *, seq_len: int, batch: int, heads: int, kv_heads: int,
           head_dim: int, dtype_bytes: int, context_sizes: Sequence[int],
           links: Sequence[cost.Link], flops_per_s: float | None) -> None:
    if method not in SIMPLICITY:
        raise ValueError(f"method must be one of {', '.join(SIMPLICITY)}, got {method!r}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("heads", heads),
                        ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)):
        _positive(value, name)
    sizes = tuple(context_sizes)
    if not sizes:
        raise ValueError("context_sizes must name at least one context axis, got ()")
    for size in sizes:
        _positive(size, "context_sizes")
    if len(links) != len(sizes) or not all(isinstance(x, cost.Link) for x in links):
        raise ValueError(f"links must hold one Link per context axis ({len(sizes)}), got "
                         f"{links!r}")
    c = math.prod(sizes)
    if seq_len % (2 * c):
        raise ValueError(f"seq_len {seq_len} must divide into 2·c = {2 * c} zigzag chunks")
    if flops_per_s is not None and not (math.isfinite(flops_per_s) and flops_per_s > 0):
        raise ValueError(f"flops_per_s must be finite and > 0 or None, got {flops_per_s!r}")
    if method in ("ulysses", "hierarchical"):
        reason = _ruled_out(method, heads, kv_heads, sizes)
        if reason:
            raise ValueError(f"method {method!r}: {reason}")


def _ruled_out(method: str, heads: int, kv_heads: int, sizes: Sequence[int]) -> str | None:
    """Why the heads or the axes rule ``method`` out, or ``None``."""
    if method == "hierarchical" and len(sizes) < 2:
        return "needs 2 or more context axes"
    if method not in ("ulysses", "hierarchical"):
        return None
    u = math.prod(sizes) if method == "ulysses" else sizes[-1]
    if heads % u or kv_heads % u:
        return (f"heads {heads} and kv_heads {kv_heads} per tensor rank must divide by its "
                f"all-to-all group of {u}")
    return None


def _peers(sizes: Sequence[int], links: Sequence[cost.Link]) -> list[tuple[int, cost.Link]]:
    """``(peers, link)``: a device's group peers by the link that reaches them, the
    slowest among the axes where their positions differ."""
    order = sorted(range(len(sizes)), key=lambda i: links[i].bandwidth_Bps)  # slowest first
    out = []
    for k, i in enumerate(order):
        # Peers whose slowest differing axis is i: any position on the faster axes,
        # another on i, the same on the slower ones.
        count = (sizes[i] - 1) * math.prod(sizes[j] for j in order[k + 1:])
        if count:
            out.append((count, links[i]))
    return out


def _spread(piece: float, sizes: Sequence[int], links: Sequence[cost.Link]) -> float:
    """One piece to every peer of the group (an all-gather's block, an all-to-all's
    piece): the messages one after another, each link's bytes at the same time."""
    peers = _peers(sizes, links)
    if not peers:
        return 0.0
    return (sum(n * link.latency_s for n, link in peers)
            + max(n * piece / link.bandwidth_Bps for n, link in peers))


def _ring_step(nbytes: float, sizes: Sequence[int], links: Sequence[cost.Link]) -> float:
    """One ring step: every device sends ``nbytes`` to its neighbour at once, so the
    step waits for the slowest link the ring crosses."""
    used = [link for size, link in zip(sizes, links, strict=True) if size > 1]
    if not used:
        return 0.0
    slow = min(used, key=lambda link: link.bandwidth_Bps)
    return slow.latency_s + nbytes / slow.bandwidth_Bps


def _ring(steps: int, kv: float, compute: float, sizes: Sequence[int],
          links: Sequence[cost.Link]) -> float:
    """A ring's forward and backward over ``steps`` devices: ``compute`` the forward's
    FLOP time for the whole ring (0 when unknown), each step overlapping its share."""
    f, fb = compute / steps, BACKWARD_FLOPS * compute / steps
    forward = (steps - 1) * max(f, _ring_step(2 * kv, sizes, links)) + f
    backward = ((steps - 1) * max(fb, _ring_step(4 * kv, sizes, links)) + fb
                + _ring_step(2 * kv, sizes, links))
    return forward + backward


def predict(method: str, *, seq_len: int, batch: int, heads: int, kv_heads: int,
            head_dim: int, dtype_bytes: int, context_sizes: Sequence[int],
            links: Sequence[cost.Link], flops_per_s: float | None = None,
            causal: bool = True) -> float:
    """Predicted seconds of one attention layer's forward and backward, per device.

    The formulas are in this module's docstring: the communication of ``method``, plus
    the attention's compute where ``flops_per_s`` is given (a ring overlaps it).

    Args:
        method: one of :data:`SIMPLICITY`.
        seq_len: tokens per sequence ``T`` (divisible by ``2c``: the zigzag chunks).
        batch: sequences per device ``b``.
        heads: query heads per tensor rank ``H``.
        kv_heads: kv heads per tensor rank ``Hk``.
        head_dim: features per head ``h``.
        dtype_bytes: bytes per value of q, k, v (4 for float32, 2 for bfloat16).
        context_sizes: the context axes' sizes, outer first.
        links: the :class:`~meshkit.exchange.cost.Link` each context axis's groups use
            (:func:`axis_links`).
        flops_per_s: FLOP/s a device sustains on the attention, or ``None`` (the
            communication alone).
        causal: a causal mask (half the score blocks); ``False`` counts all of them.

    Returns:
        Seconds.

    Raises:
        ValueError: an unknown method, a size not an int >= 1, ``links`` not one Link per
            axis, ``seq_len`` not divisible by ``2c``, or heads the method cannot split
            (the message names the parameter).

    Examples:
        >>> fast, slow = cost.Link(2e-6, 400e9), cost.Link(4e-6, 50e9)
        >>> shape = dict(seq_len=131072, batch=1, heads=8, kv_heads=1, head_dim=128,
        ...              dtype_bytes=2, context_sizes=(2, 8), links=(slow, fast))
        >>> round(predict("all_gather", **shape) * 1e3, 3)
        1.526
        >>> predict("ring", **shape) > predict("all_gather", **shape)
        True
    """
    sizes, links = tuple(context_sizes), tuple(links)
    _check(method, seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads,
           head_dim=head_dim, dtype_bytes=dtype_bytes, context_sizes=sizes, links=links,
           flops_per_s=flops_per_s)
    c = math.prod(sizes)
    n = seq_len // c
    q = batch * n * heads * head_dim * dtype_bytes
    kv = batch * n * kv_heads * head_dim * dtype_bytes
    flops = 4 * batch * seq_len**2 * heads * head_dim / c * (0.5 if causal else 1.0)
    compute = flops / flops_per_s if flops_per_s else 0.0
    whole = (1 + BACKWARD_FLOPS) * compute
    if method == "all_gather":
        return 4 * _spread(kv, sizes, links) + whole
    if method == "ring":
        return _ring(c, kv, compute, sizes, links)
    if method == "ulysses":
        return 4 * _spread(q / c, sizes, links) + 4 * _spread(kv / c, sizes, links) + whole
    # hierarchical: the inner all-to-alls, then a ring over the outer axes.
    u, inner = sizes[-1], (sizes[-1:], links[-1:])
    a2a = 4 * _spread(q / u, *inner) + 4 * _spread(kv / u, *inner)
    return a2a + _ring(c // u, kv, compute, sizes[:-1], links[:-1])


@dataclasses.dataclass(frozen=True)
class Choice:
    """The methods' predicted seconds, the ones ruled out, and the pick.

    Attributes:
        method: the method picked.
        seconds: method → predicted seconds of one layer's forward and backward, for
            each method not ruled out.
        refused: method → why it is ruled out.
    """

    method: str
    seconds: Mapping[str, float]
    refused: Mapping[str, str]

    def describe(self) -> str:
        """``<method> (<why>)``, for the start-up line.

        Examples:
            >>> Choice("ring", {"all_gather": 2e-3, "ring": 1e-3}, {"ulysses": "x"}).describe()
            'ring (cost model, one layer fwd+bwd: all_gather 2 ms, ring 1 ms; ulysses ruled out: x)'
        """
        times = ", ".join(f"{m} {s * 1e3:.3g} ms" for m, s in self.seconds.items())
        fastest = min(self.seconds.values())
        why = "" if self.seconds[self.method] == fastest else (
            f"; the simplest within {cost.CHOOSE_MARGIN:.0%} of the fastest")
        out = "".join(f"; {m} ruled out: {r}" for m, r in self.refused.items())
        return f"{self.method} (cost model, one layer fwd+bwd: {times}{why}{out})"


def choose(*, seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int,
           dtype_bytes: int, context_sizes: Sequence[int], links: Sequence[cost.Link],
           flops_per_s: float | None = None, causal: bool = True) -> Choice:
    """The simplest method (in :data:`SIMPLICITY`'s order) that :func:`predict` puts within
    :data:`meshkit.exchange.cost.CHOOSE_MARGIN` (5 %) of the fastest; never one the heads
    or the axes rule out (Ulysses: heads and kv heads per tensor rank divisible by its
    group; hierarchical: two or more context axes as well).

    Args:
        seq_len: as :func:`predict`, and the rest of the arguments too.
        batch: sequences per device.
        heads: query heads per tensor rank.
        kv_heads: kv heads per tensor rank.
        head_dim: features per head.
        dtype_bytes: bytes per value.
        context_sizes: the context axes' sizes, outer first.
        links: one Link per context axis.
        flops_per_s: FLOP/s a device sustains, or ``None``.
        causal: a causal mask.

    Returns:
        The :class:`Choice`.

    Raises:
        ValueError: as :func:`predict`.

    Examples:
        >>> slow, fast = cost.Link(4e-6, 50e9), cost.Link(2e-6, 400e9)
        >>> shape = dict(seq_len=131072, batch=1, head_dim=128, dtype_bytes=2,
        ...              context_sizes=(2, 8), links=(slow, fast))
        >>> choose(heads=8, kv_heads=8, **shape).method
        'hierarchical'
        >>> choose(heads=8, kv_heads=1, **shape).method  # 1 kv head: no Ulysses
        'all_gather'
    """
    sizes = tuple(context_sizes)
    args = dict(seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, dtype_bytes=dtype_bytes, links=tuple(links),
                flops_per_s=flops_per_s, causal=causal)
    # The shared arguments are checked once, by the simplest method (no head condition).
    predict("all_gather", context_sizes=sizes, **args)  # type: ignore[arg-type]
    refused = {m: r for m in SIMPLICITY if (r := _ruled_out(m, heads, kv_heads, sizes))}
    seconds = {m: predict(m, context_sizes=sizes, **args)  # type: ignore[arg-type]
               for m in SIMPLICITY if m not in refused}
    fastest = min(seconds.values())
    method = next(m for m, s in seconds.items() if s <= fastest * (1 + cost.CHOOSE_MARGIN))
    return Choice(method, seconds, refused)


def axis_links(strategy: Strategy, axes: Sequence[str] | str,
               topology: cost.Topology) -> tuple[cost.Link, ...]:
    """The link each axis's groups use: the inter-node one where a group's ranks lie in
    more than one node (rank ``r`` is on node ``r // topology.devices_per_node``), the
    intra-node one otherwise.

    Args:
        strategy: the strategy.
        axes: context axes (one name or several).
        topology: the hardware.

    Returns:
        One Link per axis, in the order given.

    Raises:
        ValueError: an axis the strategy lacks.

    Examples:
        >>> from meshkit.strategy.ranks import Strategy
        >>> s = Strategy.from_axes({"cpn": 2, "cpd": 4})
        >>> t = cost.preset("h100-8x400g", nodes=2, devices_per_node=4)
        >>> axis_links(s, ("cpn", "cpd"), t) == (t.inter, t.intra)
        True
    """
    out = []
    for axis in axis_names(axes, "context axes"):
        nodes = strategy.groups(axis) // topology.devices_per_node
        spans = bool((nodes != nodes[:, :1]).any())
        out.append(topology.inter if spans else topology.intra)
    return tuple(out)


def _choose_config(config: Config) -> Choice:
    """:func:`choose` with a config's shapes, heads per tensor rank and topology."""
    m, strategy = config.model, config.strategy()
    shape = strategy.shape
    axes = config.context_axes
    t = math.prod(shape[a] for a in config.axes_with_role("tensor"))
    kv = getattr(m, "num_kv_heads", None) or m.num_heads
    # Tensor ranks split the kv heads where they divide and replicate them otherwise.
    kv_local = kv // t if kv % t == 0 else kv
    nodes = math.prod(shape[a] for a in config.node_axes if a in shape)
    # Node axes lead the mesh (outer axes follow process boundaries), so a node holds the
    # rest of the devices: rank r is on node r // (size / nodes).
    per_node = strategy.size // nodes
    topology = (cost.default_topology(nodes, per_node) if config.exchange.topology is None
                else cost.load_topology(config.exchange.topology, nodes=nodes,
                                        devices_per_node=per_node))
    local = max(config.train.batch_size // config.batch_devices // config.parallel.microbatches,
                1)
    return choose(seq_len=config.train.seq_len, batch=local, heads=m.num_heads // t,
                  kv_heads=kv_local, head_dim=m.head_dim,
                  dtype_bytes=_DTYPE_BYTES.get(m.dtype, 4),
                  context_sizes=tuple(shape[a] for a in axes),
                  links=axis_links(strategy, axes, topology), flops_per_s=topology.flops_per_s)


def resolve(config: Config) -> str:
    """``parallel.context_method`` as the model runs it.

    ``auto`` asks :func:`choose` where there are context axes; with none every method is
    the same local attention, and ``all_gather`` (the simplest) is returned.

    Args:
        config: a validated config.

    Returns:
        One of :data:`SIMPLICITY`.

    Examples:
        >>> from meshkit.config import Config
        >>> resolve(Config())
        'all_gather'
    """
    method = config.parallel.context_method
    if method != "auto":
        return method
    if not config.context_axes:
        return SIMPLICITY[0]
    return _choose_config(config).method


def picked(config: Config) -> str | None:
    """What ``auto`` picked and why (``<method> (<why>)``), for the start-up line;
    ``None`` where the config names the method or there are no context axes.

    Args:
        config: a validated config.

    Returns:
        :meth:`Choice.describe`'s line, or ``None``.

    Examples:
        >>> from meshkit.config import Config
        >>> picked(Config()) is None
        True
    """
    if config.parallel.context_method != "auto" or not config.context_axes:
        return None
    return _choose_config(config).describe()


def causal_blocks(seq_len: int, c: int, block: int, *, zigzag: bool = True) -> tuple[int, ...]:
    """The causal attention blocks each of ``c`` context devices computes.

    The sequence is cut into ``block``-token blocks; a device computes, for each of its
    query blocks, every key block not wholly in the future (``key block <= query
    block``). Zigzag: ``2c`` chunks, device ``i`` holding chunks ``i`` and ``2c−1−i``;
    contiguous: ``c`` chunks, device ``i`` holding chunk ``i``.

    Args:
        seq_len: tokens ``T``.
        c: context devices.
        block: tokens per block; divides ``T/(2c)``.
        zigzag: the load-balanced order (``False``: contiguous chunks).

    Returns:
        Blocks per device, device 0 first.

    Raises:
        ValueError: a size not an int >= 1, or ``block`` not dividing ``T/(2c)``.

    Examples:
        >>> causal_blocks(16, 2, 4), causal_blocks(16, 2, 4, zigzag=False)
        ((5, 5), (3, 7))
    """
    for name, value in (("seq_len", seq_len), ("c", c), ("block", block)):
        _positive(value, name)
    if seq_len % (2 * c) or (seq_len // (2 * c)) % block:
        raise ValueError(f"block {block} must divide the zigzag chunk seq_len / (2·c) = "
                         f"{seq_len} / {2 * c}")
    m = seq_len // (2 * c) // block  # blocks per zigzag chunk

    def chunk(k: int, blocks: int) -> int:  # Σ (qb + 1) over the chunk's query blocks
        first = k * blocks
        return blocks * first + blocks * (blocks + 1) // 2

    if zigzag:
        return tuple(chunk(i, m) + chunk(2 * c - 1 - i, m) for i in range(c))
    return tuple(chunk(i, 2 * m) for i in range(c))
