"""The layouts ``meshkit plan`` ranks: enumerate them, check them against a config's
rules, place their groups on a topology (numpy only).

A :class:`Layout` gives each role a size — ``pipeline``, ``data``, ``fsdp``, ``expert``,
``context`` and ``tensor`` ways, the exchange plan, the context method and the
microbatch count — and lays the mesh out outer → inner as ``pp, dp, fsdp, node, device,
cp, tp`` (slowest links first: tensor groups are neighbouring ranks, context groups the
next nearest, pipeline neighbours the farthest apart). Rank ``r`` sits
on node ``r // devices_per_node`` of the :class:`meshkit.exchange.cost.Topology`, so whether a
role's groups cross nodes follows from the layout, and the expert ways split into a node
part and a device part accordingly.

The step model and the memory model are :mod:`meshkit.plan.model_plan`'s, the one pair
behind ``meshkit plan CONFIG`` (:mod:`meshkit.plan.config_plan`) and ``meshkit plan
--model FILE``.

Examples:
    >>> candidates = list(candidate_layouts(8, per_node=8))
    >>> Layout(data=8) in candidates
    True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from meshkit._yamlfile import load_yaml
from meshkit.choices import CONTEXT_METHODS
from meshkit.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    read_config_file,
    with_overrides,
)
from meshkit.errors import UsageError
from meshkit.exchange import cost

__all__ = [
    "AXIS_ORDER",
    "CONTEXT_METHODS_PLANNED",
    "EXCHANGES",
    "MAX_DEVICES",
    "MAX_FACTORISATIONS",
    "MICROBATCHES",
    "Layout",
    "PlanError",
    "candidate_layouts",
    "check_device_count",
    "check_layout",
    "enumerate_layouts",
    "layout_of",
    "planning_config",
    "rejection",
    "resolve_topology",
    "sized_topology",
]

#: Mesh axis names, outer → inner, and the role each one has. The context ways sit
#: between the expert and tensor axes (Megatron's order, ``tp-cp-ep-dp-pp`` inner
#: first): one axis ``cp``, or under ``hierarchical`` two, ``cpo`` across nodes (a
#: ring) and ``cpi`` inside one (Ulysses), outer first as ``parallel.context`` lists them.
AXIS_ORDER = (("pp", "pipeline"), ("dp", "data"), ("fsdp", "fsdp"), ("node", "expert"),
              ("device", "expert"), ("cpo", "context"), ("cpi", "context"), ("tp", "tensor"))
#: The context methods the planner tries for a layout with context ways: every one the
#: config names but ``auto`` (``ulysses`` and ``hierarchical`` only where the heads a
#: tensor rank holds divide among the Ulysses group).
CONTEXT_METHODS_PLANNED = CONTEXT_METHODS[1:]
#: Exchange plans: ``none`` (no expert axes), ``flat``, ``hierarchical`` (two-stage),
#: ``dedup`` (two-stage, one row per token and node).
EXCHANGES = ("none", *cost.COST_METHODS)
#: The most devices the planner lays out: 2**20 (1,048,576), far beyond today's largest
#: training clusters (some 10**5 GPUs), yet small enough that the enumeration of a
#: power of two stays near a second. A larger ``--devices`` or ``--nodes`` is refused at
#: once instead of enumerating for hours.
MAX_DEVICES = 2**20
#: The most ways to split the devices into the five roles (ordered factorisations into
#: five factors) the planner enumerates. 2**20 devices have 10,626; a count with many
#: small prime factors has far more (720,720: 656,250, each with up to 15 exchange plans
#: and microbatch counts, a quarter of a minute), so it is refused with the count named.
MAX_FACTORISATIONS = 20_000
# The factors a layout splits the devices into: pipeline, data, fsdp, expert, tensor.
_SPLITS = 5
#: Microbatch counts tried for a pipelined layout (one without a pipeline uses 1).
MICROBATCHES = (2, 4, 8, 16, 32)
class PlanError(UsageError):
    """No layout to offer: none satisfies the config's rules, or none fits in memory.

    Examples:
        >>> issubclass(PlanError, ValueError)
        True
    """


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many ways each role splits, the exchange plan and the microbatches.

    Attributes:
        pipeline, data, fsdp, tensor: ways of each role.
        expert_nodes, expert_devices: the expert ways across nodes and inside a node
            (the exchange's node and device axes); experts split ``expert`` ways.
        microbatches: pipeline microbatches (1 without a pipeline).
        exchange: one of :data:`EXCHANGES`.
        moe_tensor: what the tensor ways split in an MoE layer
            (``parallel.moe_tensor``, :data:`meshkit.choices.MOE_TENSOR_MODES`):
            ``tokens`` or ``ffn`` where there are tensor ways and MoE layers, else
            ``auto`` (the planner's own layouts never leave it ``auto`` where it
            matters; the models charge ``auto`` as ``tokens``).
        expert_fsdp: the expert axes are named in ``parallel.fsdp`` too: they shard every
            non-expert weight (and its AdamW moments) on the model width, ZeRO-3 style,
            besides splitting the experts.
        context: ways the sequence is split (``parallel.context``): each device holds
            ``seq_len / context`` tokens of each of its sequences.
        context_method: ``parallel.context_method`` (one of
            :data:`CONTEXT_METHODS_PLANNED`) where there are context ways, else ``none``.
        context_inner: ``hierarchical``'s Ulysses ways inside a node (``cpi``); the
            other ``context / context_inner`` ways are its ring across nodes (``cpo``).
            1 for the other methods.

    Examples:
        >>> Layout(data=2, expert_devices=4, exchange="flat").axes()
        {'dp': 2, 'ep': 4}
    """

    pipeline: int = 1
    data: int = 1
    fsdp: int = 1
    expert_nodes: int = 1
    expert_devices: int = 1
    tensor: int = 1
    microbatches: int = 1
    exchange: str = "none"
    moe_tensor: str = "auto"
    expert_fsdp: bool = False
    context: int = 1
    context_method: str = "none"
    context_inner: int = 1

    @property
    def expert(self) -> int:
        """Ways the experts are split."""
        return self.expert_nodes * self.expert_devices

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        return (self.pipeline * self.data * self.fsdp * self.expert * self.context
                * self.tensor)

    @property
    def batch_ways(self) -> int:
        """Ways the batch is split: data, fsdp and expert."""
        return self.data * self.fsdp * self.expert

    @property
    def weight_shards(self) -> int:
        """Ways a non-expert weight is sharded on the model width (ZeRO-3): the fsdp
        ways, times the expert ways where those are fsdp too (:attr:`expert_fsdp`)."""
        return self.fsdp * (self.expert if self.expert_fsdp else 1)

    @property
    def ffn_split(self) -> bool:
        """Whether the tensor ways split each expert's hidden width
        (``moe_tensor: ffn``) rather than the tokens."""
        return self.moe_tensor == "ffn" and self.tensor > 1

    def _sizes(self) -> list[tuple[str, int]]:
        inner = self.context_inner if self.context_method == "hierarchical" else self.context
        sizes = dict(pp=self.pipeline, dp=self.data, fsdp=self.fsdp, node=self.expert_nodes,
                     device=self.expert_devices, cpo=self.context // inner, cpi=inner,
                     tp=self.tensor)
        return [(name, sizes[name]) for name, _ in AXIS_ORDER]

    def _expert_axes(self) -> tuple[list[str], list[str]]:
        """The exchange's node and device axes: a one-level exchange runs over ``ep``."""
        if self.expert_nodes > 1 and self.expert_devices > 1:
            return ["node"], ["device"]
        return (["ep"], []) if self.expert > 1 else ([], [])

    def axes(self) -> dict[str, int]:
        """The mesh axes, outer → inner, leaving out those of size 1.

        Returns:
            ``name -> size``; a one-level expert split is one axis ``ep``; ``{dp: 1}``
            for a single device.
        """
        out: dict[str, int] = {}
        single_expert = not (self.expert_nodes > 1 and self.expert_devices > 1)
        two_level = self.context_method == "hierarchical"
        for name, size in self._sizes():
            if size > 1:
                if single_expert and name in ("node", "device"):
                    name = "ep"
                elif name == "cpi" and not two_level:
                    name = "cp"
                out[name] = size
        return out or {"dp": 1}

    def context_axes(self) -> list[str]:
        """The mesh axes of ``parallel.context``, outer first (none without context ways).

        Examples:
            >>> Layout(context=8, context_method="hierarchical", context_inner=4).context_axes()
            ['cpo', 'cpi']
        """
        return [a for a in ("cpo", "cpi", "cp") if a in self.axes()]

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides that select this layout for ``meshkit train``.

        Every role key is set, so they replace whatever the config had.

        Examples:
            >>> Layout(pipeline=2, tensor=2, expert_devices=2, microbatches=4,
            ...        exchange="flat").overrides()[:3]
            ['mesh.axes={pp: 2, ep: 2, tp: 2}', 'mesh.ranks=null', 'parallel.data=[]']
        """
        axes = self.axes()
        node, device = self._expert_axes()

        def names(axis: str) -> str:
            return f"[{axis}]" if axes.get(axis, 1) > 1 else "[]"

        fsdp = [a for a in ("fsdp",) if axes.get(a, 1) > 1]
        if self.expert_fsdp:
            fsdp += [*node, *device]  # the expert axes shard the other weights too
        return [
            "mesh.axes={" + ", ".join(f"{a}: {s}" for a, s in axes.items()) + "}",
            "mesh.ranks=null",
            f"parallel.data={names('dp')}",
            "parallel.fsdp=[" + ", ".join(fsdp) + "]",
            f"parallel.tensor={names('tp')}",
            # Always set: a base config's own choice would otherwise survive (and be
            # refused where this layout has no tensor ways).
            f"parallel.moe_tensor={self.moe_tensor}",
            f"parallel.pipeline={'pp' if self.pipeline > 1 else 'null'}",
            f"parallel.microbatches={self.microbatches}",
            "exchange.node_axis=[" + ", ".join(node) + "]",
            "exchange.device_axis=[" + ", ".join(device) + "]",
            "exchange.method=" + ("hierarchical" if self.exchange in ("hierarchical", "dedup")
                                  else "flat"),
            f"exchange.dedup={'true' if self.exchange == 'dedup' else 'false'}",
            *self._context_overrides(),
            # A base config's schedule and stage sizes need a pipeline: not without one.
            *(["parallel.schedule=gpipe", "parallel.stage_layers=null",
               "parallel.virtual_stages=1"]
              if self.pipeline == 1 else []),
        ]

    def _context_overrides(self) -> list[str]:
        """``parallel.context`` and ``parallel.context_method``: set always where the
        config knows them (a base config's own would otherwise survive), and where it
        does not only for a layout with context ways (which then fails to build,
        naming the key)."""
        if self.context == 1 and not _context_keys_known():
            return []
        method = self.context_method if self.context > 1 else "auto"
        return ["parallel.context=[" + ", ".join(self.context_axes()) + "]",
                f"parallel.context_method={method}"]

    def name(self) -> str:
        """A short label: each role's ways outer → inner, the exchange, the microbatches.

        Examples:
            >>> Layout(pipeline=2, data=2, expert_nodes=2, expert_devices=2, tensor=1,
            ...        microbatches=4, exchange="dedup").name()
            'pp2 dp2 ep2x2(dedup) mb4'
        """
        parts = []
        for axis, size in self._sizes():
            if axis == "node" and self.expert > 1:
                split = (f"{self.expert_nodes}x{self.expert_devices}"
                         if self.expert_nodes > 1 and self.expert_devices > 1
                         else str(self.expert))
                fsdp = ",fsdp" if self.expert_fsdp else ""
                parts.append(f"ep{split}({self.exchange}{fsdp})")
            elif axis == "cpo" and self.context > 1:
                split = (f"{size}x{self.context_inner}"
                         if self.context_method == "hierarchical" else str(self.context))
                parts.append(f"cp{split}({self.context_method})")
            elif axis == "cpi":
                continue
            elif axis == "tp" and size > 1 and self.moe_tensor == "ffn":
                parts.append(f"tp{size}(ffn)")
            elif axis not in ("node", "device") and size > 1:
                parts.append(f"{axis}{size}")
        if self.pipeline > 1:
            parts.append(f"mb{self.microbatches}")
        return " ".join(parts) or "1 device"

    def config(self, base: Config) -> Config:
        """``base`` with this layout, validated by :class:`meshkit.config.Config`.

        Raises:
            ConfigError: the layout breaks one of the config's rules.
        """
        return with_overrides(base, self.overrides())


# ------------------------------------------------------------------ placement


@functools.cache
def _context_keys_known() -> bool:
    """Whether this meshkit's config has ``parallel.context`` (the context role)."""
    from meshkit.config.sections import all_keys

    return "parallel.context" in all_keys()



@functools.lru_cache(maxsize=65536)
def _span(sizes: tuple[int, ...], members: tuple[int, ...], per_node: int) -> tuple[int, int]:
    """``(group size, nodes it spans)`` of the group of rank 0 over the ``members`` axes
    of a row-major mesh of ``sizes``, with ``per_node`` consecutive ranks a node."""
    strides = np.cumprod((1, *sizes[::-1]))[::-1][1:]
    ranks = np.zeros(1, dtype=np.int64)
    for i in members:
        ranks = (ranks[:, None] + np.arange(sizes[i]) * strides[i]).ravel()
    return int(ranks.size), int(np.unique(ranks // per_node).size)


def _all_reduce(bytes_: float, group: tuple[int, int], t: cost.Topology, *,
                half: bool = False) -> float:
    """Ring all-reduce (``half``: all-gather or reduce-scatter) over a placed group."""
    g, nodes = group
    if g == 1 or bytes_ == 0:
        return 0.0
    link = t.inter if nodes > 1 else t.intra
    factor = 1 if half else 2
    return factor * ((g - 1) * link.latency_s + (g - 1) / g * bytes_ / link.bandwidth_Bps)


def layout_of(config: Config) -> Layout:
    """The :class:`Layout` of a config's roles (its axis names and order aside).

    ``exchange.method: auto`` counts as two-stage where there are node and device axes
    (what the cost model picks on multi-node presets), else flat.

    Args:
        config: a validated config.

    Returns:
        The layout: each role's ways, the expert node/device split, the exchange plan and
        the microbatches.

    Examples:
        >>> from meshkit.config import load_config
        >>> layout_of(load_config(None)).name()
        'ep2x4(hierarchical)'
    """
    shape = config.strategy().shape

    def ways(axes: Sequence[str]) -> int:
        return math.prod(shape[a] for a in axes)

    from meshkit.config.moe_tensor import resolve

    nodes, inside = ways(config.node_axes), ways(config.device_axes)
    expert_axes = config.expert_axes
    tensor = ways(config.axes_with_role("tensor"))
    moe = config.model.factory is None and config.model.num_experts > 0
    if nodes * inside == 1:
        exchange = "none"
    elif config.exchange.dedup:
        exchange = "dedup"
    elif config.exchange.method == "flat" or nodes == 1 or inside == 1:
        exchange = "flat"
    else:
        exchange = "hierarchical"
    context_axes = config.context_axes
    context = ways(context_axes)
    method = "none"
    if context > 1:
        from meshkit.config.context_method import resolve as resolve_context

        method = resolve_context(config)
    return Layout(
        context=context, context_method=method,
        context_inner=shape[context_axes[-1]] if method == "hierarchical" else 1,
        pipeline=ways(config.axes_with_role("pipeline")),
        data=ways(config.axes_with_role("data")),
        fsdp=ways([a for a in config.fsdp_axes if a not in expert_axes]),
        expert_nodes=nodes,
        expert_devices=inside,
        tensor=tensor,
        microbatches=config.parallel.microbatches,
        exchange=exchange,
        moe_tensor=resolve(config) if moe and tensor > 1 else "auto",
        expert_fsdp=any(a in expert_axes for a in config.fsdp_axes),
    )


# ------------------------------------------------------------------ enumeration


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _factorisation_count(n: int, parts: int) -> int:
    """How many ordered tuples of ``parts`` positive ints multiply to ``n``: for each
    prime ``p**e`` of ``n``, ``C(e + parts - 1, parts - 1)`` ways to share its powers."""
    count, p = 1, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        count *= math.comb(e + parts - 1, parts - 1)
        p += 1
    return count * (parts if n > 1 else 1)


def _factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for first in _divisors(n):  # not range(1, n + 1): that is n steps for any n
        for rest in _factorisations(n // first, parts - 1):
            yield (first, *rest)


def check_device_count(devices: int, *, flag: str = "--devices") -> int:
    """Check that the planner can lay out ``devices`` devices quickly.

    Args:
        devices: the device count.
        flag: what the message names as the culprit.

    Returns:
        ``devices``.

    Raises:
        PlanError: not an integer >= 1, more than :data:`MAX_DEVICES`, or more than
            :data:`MAX_FACTORISATIONS` ways to split it into the five roles.

    Examples:
        >>> check_device_count(2048)
        2048
        >>> check_device_count(2**40)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.plan.planner.PlanError: --devices: 1099511627776 devices are more than ...
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"{flag}: must be a positive integer, got {devices!r}")
    if devices > MAX_DEVICES:
        raise PlanError(f"{flag}: {devices} devices are more than the planner's limit of "
                        f"{MAX_DEVICES:,} (2**20)")
    ways = _factorisation_count(devices, _SPLITS)
    if ways > MAX_FACTORISATIONS:
        raise PlanError(f"{flag}: {devices} devices split into the five roles in {ways:,} "
                        f"ways, more than the planner's limit of {MAX_FACTORISATIONS:,} "
                        "(a count with fewer prime factors, such as a power of two, has "
                        "fewer)")
    return devices


def _expert_split(expert: int, tensor: int, per_node: int) -> tuple[int, int]:
    """``(nodes, devices)`` of the expert ways: the devices part is what one node holds
    of an expert group whose members are ``tensor`` ranks apart."""
    inside = per_node // tensor if per_node % tensor == 0 else 1
    devices = math.gcd(expert, max(inside, 1))
    return expert // devices, devices


def _context_plans(context: int, tensor: int, per_node: int,
                   methods: Sequence[str]) -> list[tuple[str, int]]:
    """``(method, inner ways)`` of each of ``methods`` a context split of ``context``
    ways allows: ``hierarchical`` where the group has ranks both inside a node (those
    ``tensor`` apart on one node are its Ulysses ways) and across nodes."""
    if context == 1:
        return [("none", 1)]
    inner = math.gcd(context, per_node // tensor) if per_node % tensor == 0 else 1
    return [(m, inner if m == "hierarchical" else 1) for m in methods
            if m != "hierarchical" or 1 < inner < context]


def candidate_layouts(devices: int, per_node: int, *,
                      moe_tensor: Sequence[str] = ("auto",),
                      expert_fsdp: Sequence[bool] = (False,),
                      contexts: Sequence[int] = (1,),
                      context_methods: Sequence[str] = CONTEXT_METHODS_PLANNED
                      ) -> Iterator[Layout]:
    """Every layout of ``devices`` devices, valid or not, before the config's rules.

    Args:
        devices: the device count.
        per_node: devices per node (decides the expert ways' node/device split).
        moe_tensor: the ``parallel.moe_tensor`` modes tried where there are tensor ways
            (``auto`` where there are none).
        expert_fsdp: whether the expert axes shard the other weights too
            (:attr:`Layout.expert_fsdp`), tried where there are expert ways.
        contexts: the context ways tried (those dividing ``devices``; 1: none).
        context_methods: the context methods tried where there are context ways.

    Yields:
        Layouts: for each of ``contexts`` dividing ``devices``, each factorisation of
        the rest into pipeline, data, fsdp, expert and tensor ways, with each exchange
        plan its expert split allows, each of ``moe_tensor`` and ``expert_fsdp``, each
        context method its split allows and, with a pipeline, each of
        :data:`MICROBATCHES`.

    Raises:
        PlanError: ``devices`` is beyond what :func:`check_device_count` allows.

    Examples:
        >>> sorted({x.exchange for x in candidate_layouts(8, per_node=4)})
        ['dedup', 'flat', 'hierarchical', 'none']
    """
    check_device_count(devices)
    for cp in sorted(set(contexts)):
        if devices % cp:
            continue
        for pp, dp, fsdp, ep, tp in _factorisations(devices // cp, _SPLITS):
            # The expert ways' members are the context and tensor ways apart.
            nodes, inside = _expert_split(ep, tp * cp, per_node)
            if ep == 1:
                plans: tuple[str, ...] = ("none",)
            elif nodes > 1 and inside > 1:
                plans = ("flat", "hierarchical", "dedup")
            else:
                plans = ("flat",)
            for (exchange, mode, sharded), (method, inner) in itertools.product(
                    itertools.product(plans, moe_tensor if tp > 1 else ("auto",),
                                      expert_fsdp if ep > 1 else (False,)),
                    _context_plans(cp, tp, per_node, context_methods)):
                for mb in (MICROBATCHES if pp > 1 else (1,)):
                    yield Layout(pipeline=pp, data=dp, fsdp=fsdp, expert_nodes=nodes,
                                 expert_devices=inside, tensor=tp, microbatches=mb,
                                 exchange=exchange, moe_tensor=mode, expert_fsdp=sharded,
                                 context=cp, context_method=method, context_inner=inner)


def rejection(config: Config, layout: Layout) -> str | None:
    """The config key whose rule ``layout`` breaks, or ``None`` if it is valid.

    A fast mirror of :func:`meshkit.config.validate` for the planner, which checks
    thousands of layouts; a test checks that it agrees with building the config on every
    8-device layout.

    Args:
        config: the model and batch.
        layout: the layout.

    Returns:
        ``None``, or the key :func:`meshkit.config.validate` would name.

    Examples:
        >>> from meshkit.config import load_config
        >>> rejection(load_config(None), Layout(expert_devices=16, exchange="flat"))
        'model.num_experts'
    """
    m, t = config.model, config.train
    if m.num_experts == 0 and layout.expert > 1:
        return "exchange.node_axis"
    if m.num_experts % layout.expert:
        return "model.num_experts"
    dedup = layout.exchange == "dedup"
    if dedup and not (layout.expert_nodes > 1 and layout.expert_devices > 1):
        return "exchange.dedup"
    if dedup and m.dispatch != "sort":
        return "exchange.dedup"
    # The config's node count: the node axis of a two-level split, else the one axis.
    two_level = layout.expert_nodes > 1 and layout.expert_devices > 1
    nodes = layout.expert_nodes if two_level else layout.expert
    if m.max_nodes is not None and (m.max_nodes > nodes
                                    or m.max_nodes * (m.num_experts // nodes) < m.top_k):
        return "model.max_nodes"
    if m.num_heads % layout.tensor:
        return "model.num_heads"
    if m.vocab_size % layout.tensor:
        return "model.vocab_size"
    why = _context_rejection(config, layout)
    if why is not None:
        return why
    if layout.moe_tensor != "auto" and not (m.num_experts and layout.tensor > 1):
        return "parallel.moe_tensor"
    # The tensor ways split a dense MLP's hidden width, and the experts' under ffn.
    if (m.num_experts == 0 or m.dense_layers or layout.ffn_split) and m.d_ff % layout.tensor:
        return "model.d_ff"
    if m.d_model % layout.weight_shards:
        return "model.d_model"
    if m.num_layers % layout.pipeline:
        return "parallel.pipeline"
    if m.dense_layers and layout.pipeline > 1:
        return "model.dense_layers"
    if layout.pipeline == 1 and layout.microbatches > 1:
        return "parallel.microbatches"
    if t.batch_size % layout.batch_ways:
        return "train.batch_size"
    local = t.batch_size // layout.batch_ways
    if local % layout.microbatches:
        return "parallel.microbatches"
    # Under tokens (``auto`` is charged as tokens: the planner's layouts name the mode)
    # each tensor rank routes its own slice of the tokens.
    if (m.num_experts and not layout.ffn_split
            and local // layout.microbatches * t.seq_len % layout.tensor):
        return "parallel.tensor"
    return None


def _context_rejection(config: Config, layout: Layout) -> str | None:
    """The config key a layout's context ways break: the context role itself where this
    meshkit's config has none, ``train.seq_len`` (cut into ``2c`` load-balanced chunks),
    or ``parallel.context_method`` (Ulysses ways, ``hierarchical``'s inner ones, that do
    not divide the heads a tensor rank holds)."""
    if layout.context == 1:
        return None
    if not _context_keys_known():
        return "parallel.context"
    m = config.model
    if config.train.seq_len % (2 * layout.context):
        return "train.seq_len"
    ways = {"ulysses": layout.context, "hierarchical": layout.context_inner}.get(
        layout.context_method, 1)
    kv = getattr(m, "num_kv_heads", None) or m.num_heads
    if (m.num_heads // layout.tensor) % ways or max(kv // layout.tensor, 1) % ways:
        return "parallel.context_method"
    return None


def enumerate_layouts(config: Config, devices: int, per_node: int) -> tuple[list[Layout],
                                                                          dict[str, int]]:
    """The valid layouts of ``devices`` devices, and how many each rule rejected.

    Args:
        config: the model and batch.
        devices: the device count.
        per_node: devices per node.

    Returns:
        ``(valid layouts, {config key: layouts it rejected})``.

    Examples:
        >>> from meshkit.config import load_config
        >>> valid, rejected = enumerate_layouts(load_config(None), 8, per_node=8)
        >>> len(valid), sorted(rejected)[:2]
        (54, ['model.num_heads', 'parallel.microbatches'])
    """
    valid: list[Layout] = []
    rejected: dict[str, int] = {}
    for layout in candidate_layouts(devices, per_node):
        key = rejection(config, layout)
        if key is None:
            valid.append(layout)
        else:
            rejected[key] = rejected.get(key, 0) + 1
    return valid, rejected


def sized_topology(topology: cost.Topology | str, devices: int) -> cost.Topology:
    """A topology with ``devices`` devices: whole nodes of the topology's size, or one
    node of ``devices`` when fewer than a node.

    Args:
        topology: a topology (its ``nodes`` is replaced), or a preset name or file.
        devices: the device count.

    Returns:
        The topology.

    Raises:
        PlanError: ``devices`` below 1, beyond :func:`check_device_count`'s limits, or not
            a whole number of nodes.

    Examples:
        >>> sized_topology("h100-8x400g", 32).nodes
        4
    """
    check_device_count(devices)
    if isinstance(topology, str):
        try:
            topology = cost.load_topology(topology, nodes=1)
        except ValueError as e:
            raise PlanError(f"--topology: {e}") from None
    per_node = topology.devices_per_node
    if devices < per_node:
        return dataclasses.replace(topology, nodes=1, devices_per_node=devices)
    if devices % per_node:
        raise PlanError(f"--devices: {devices} devices are not whole nodes of {per_node}")
    return dataclasses.replace(topology, nodes=devices // per_node)


def check_layout(config: Config, layout: Layout) -> Config:
    """``config`` with ``layout``, or a :class:`PlanError` naming the rule it breaks.

    Args:
        config: the base config.
        layout: the layout.

    Returns:
        The validated config.

    Raises:
        PlanError: the layout breaks one of the config's rules (the key is named).

    Examples:
        >>> from meshkit.config import load_config
        >>> check_layout(load_config(None), Layout(data=8)).strategy()
        Strategy(dp=8)
    """
    try:
        return layout.config(config)
    except ConfigError as e:
        raise PlanError(f"layout {layout.name()}: {e}") from None


def resolve_topology(*, devices: int | None, topology: str | None, preset: str | None,
                     nodes: int | None) -> cost.Topology:
    """The topology of ``meshkit plan``'s flags, sized to the device count.

    Args:
        devices: ``--devices`` (default: ``--nodes`` × the preset's devices per node).
        topology: ``--topology``, a topology file.
        preset: ``--preset``, a name from :data:`meshkit.exchange.cost.PRESETS`.
        nodes: ``--nodes``, with ``--preset``.

    Returns:
        The topology with ``devices`` devices.

    Raises:
        PlanError: both ``--topology`` and ``--preset``; ``--nodes`` without
            ``--preset``; an unknown preset; no device count; a count that disagrees
            with ``--nodes``; more devices than :data:`MAX_DEVICES` (or with more splits
            than :data:`MAX_FACTORISATIONS`); a topology file that does not load.

    Examples:
        >>> resolve_topology(devices=None, topology=None, preset="h100-8x400g", nodes=128).devices
        1024
    """
    if topology is not None and preset is not None:
        raise PlanError("--topology and --preset both name the cluster; give one")
    if nodes is not None and preset is None:
        raise PlanError("--nodes: needs --preset (a topology file is sized by --devices)")
    if preset is not None and preset not in cost.PRESETS:
        raise PlanError(f"--preset: unknown preset {preset!r}; known presets: "
                        f"{', '.join(cost.PRESETS)}")
    if nodes is not None and (isinstance(nodes, bool) or nodes < 1):
        raise PlanError(f"--nodes: must be a positive integer, got {nodes!r}")
    if nodes is not None and nodes > MAX_DEVICES:  # before any node count is multiplied
        raise PlanError(f"--nodes: {nodes} nodes are more than the planner's limit of "
                        f"{MAX_DEVICES:,} (2**20) devices")
    if preset is not None and nodes is not None:
        sized = cost.preset(preset, nodes)
        check_device_count(sized.devices, flag="--nodes")
        if devices is not None and devices != sized.devices:
            raise PlanError(f"--devices: {devices}, but --nodes {nodes} of {preset} have "
                            f"{sized.devices}")
        return sized
    if devices is None:
        raise PlanError("--devices: give the device count (or --preset P --nodes N)")
    return sized_topology(topology or preset or cost.default_topology(1, 8), devices)


def _given(config_path: str | None, overrides: Sequence[str], key: str) -> object:
    """``section.name`` as the file and the overrides give it (the last one wins), or
    ``None``."""
    for item in reversed(overrides):
        name, _, text = item.partition("=")
        if name.strip() == key:
            return load_yaml(text, where=key)
    raw = read_config_file(config_path) if config_path is not None else None
    section, _, field = key.partition(".")
    values = raw.get(section) if isinstance(raw, dict) else None
    return values.get(field) if isinstance(values, dict) else None


def planning_config(config_path: str | None, overrides: Sequence[str]) -> Config:
    """The config the planner ranks layouts for: its own mesh ignored, as the planner
    replaces it.

    Every rule that does not depend on the mesh is checked here (each section's values,
    the data against the vocabulary, ...); those that do (experts, heads, width, layers
    and batch divisible by the ways of the roles, ``model.max_nodes``) are checked per
    layout by :func:`rejection`. The config is validated with a one-device layout (and
    ``model.max_nodes`` checked alone), so ``model.num_experts=3`` plans although the
    config's own mesh of 8 expert devices does not divide it.

    Args:
        config_path: the YAML config (``None``: the embedded default).
        overrides: ``key=value`` overrides of it.

    Returns:
        The config with the one-device layout and the user's ``model.max_nodes``, not
        validated as a whole (:func:`check_layout` validates it with a real layout).

    Raises:
        ConfigError: a bad config, naming the key (``parallel.moe_tensor`` other than
            ``auto`` for a dense model: refused under every layout).

    Examples:
        >>> planning_config(None, ["model.num_experts=3"]).model.num_experts
        3
    """
    from meshkit.config import load_config

    # One device: every role of one way, so no mesh-dependent rule can fail, but
    # max_nodes (more than the one node) and moe_tensor (no tensor axes); they are set
    # back below, checked on their own.
    neutral = [*Layout().overrides(), "model.max_nodes=null"]
    config = load_config(config_path, [*overrides, *neutral])
    max_nodes = _given(config_path, overrides, "model.max_nodes")
    moe_tensor = _given(config_path, overrides, "parallel.moe_tensor")
    update: dict[str, object] = {}
    if max_nodes is not None:
        update["model"] = ModelConfig(**{**config.to_dict()["model"], "max_nodes": max_nodes})
    # The context method is the config's choice (auto: the cost model's per layout),
    # kept as moe_tensor is: the one-device layout's overrides set it to auto.
    context_method = _given(config_path, overrides, "parallel.context_method")
    parallel = {k: v for k, v in (("moe_tensor", moe_tensor),
                                  ("context_method", context_method)) if v is not None}
    if parallel:
        update["parallel"] = ParallelConfig(**{**config.to_dict()["parallel"], **parallel})
    if moe_tensor not in (None, "auto") and config.model.num_experts == 0:
        raise ConfigError(f"parallel.moe_tensor: {moe_tensor!r} says what the tensor axes "
                          "split in an MoE layer, but there are no MoE layers "
                          "(model.num_experts: 0); leave it `auto`")  # whatever the layout
    # Config's cross-section rules would judge them against the one-device mesh: copy
    # without them (rejection() judges them against each layout).
    return config.model_copy(update=update) if update else config
