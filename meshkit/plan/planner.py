"""Choose a parallel layout: enumerate, predict one training step, rank (numpy only).

A :class:`Layout` gives each role a size — ``pipeline``, ``data``, ``fsdp``, ``expert``
and ``tensor`` ways, the exchange plan and the microbatch count — and lays the mesh out
outer → inner as ``pp, dp, fsdp, node, device, tp`` (slowest links first: tensor
groups are neighbouring ranks, pipeline neighbours the farthest apart). Rank ``r`` sits
on node ``r // devices_per_node`` of the :class:`meshkit.exchange.cost.Topology`, so whether a
role's groups cross nodes follows from the layout, and the expert ways split into a node
part and a device part accordingly.

**The step model** (:func:`predict`), per device, with ``S`` stages and ``M``
microbatches. One *tick* of the GPipe schedule runs one microbatch through one stage::

    tick = compute + weights + tensor + exchange + fsdp + pipeline   (per microbatch)
    step = M·tick + (S−1)·tick + gradients + optimizer

* **compute**: the tick's FLOPs over the device's FLOP/s (``Topology.flops_per_s``).
  The FLOPs are :func:`meshkit.plan.flops.flops_per_token` (the MFU count) for the device's
  tokens, split as the roles split them (layers over stages, heads, vocabulary and the
  MoE's tokens over tensor ranks), with the routed experts scaled by the capacity
  padding the MoE really computes (``E·C`` slots for ``k`` rows a token). Every stage
  computes the embedding and head (SPMD), so they are not divided by ``S``.
* **weights**: the stage's working weights (full width after the fsdp gather, the
  device's experts, its tensor share) stream through memory three times a tick — read
  forward, read backward, gradient written — over the memory bandwidth. It is what
  small matmuls cost beyond their FLOPs, and why holding fewer experts per device pays
  even where the exchange is free.
* **tensor**: per layer, an all-reduce after attention and its transpose, the MoE's
  all-gather and its reduce-scatter, plus one embedding all-reduce, of
  ``[tokens, d_model]`` float32.
* **exchange**: four all-to-alls per layer (dispatch, combine and their transposes) of
  the ``[E, C, d_model]`` buffer, by :func:`meshkit.exchange.cost.predict` for the plan (flat,
  two-stage or dedup with ``nodes_per_token`` as the dedup buffers carry them,
  :func:`meshkit.exchange.capacity.dedup_nodes_per_token`).
* **fsdp**: per layer, an all-gather of its weights, a second one in the backward pass
  (the blocks are rematerialised with ``regather``: gathered weights are not kept) and a
  reduce-scatter of their gradients; plus three transposes through memory (read and
  write) of the weights gathered on a dimension that is not their leading one (the
  routed experts and the attention output projection): after each gather and before
  the reduce-scatter, counted in the compiled step's copy fusions.
* **pipeline**: a ``ppermute`` of the activations forward and one backward.
* **bubble**: the ``S − 1`` idle ticks, ``(S−1)/(M+S−1)`` of the pipelined part.
* **gradients**: one all-reduce per step of the gradients of weights replicated across
  devices: dense weights over the data and expert ways, expert weights over the data
  and tensor ways.
* **optimizer**: AdamW reads parameters, gradients and both moments and writes three of
  them back: ``7 × parameter bytes`` over the memory bandwidth.

Collectives cost ring times over the link their groups use (``inter`` as soon as a
group spans two nodes): ``2(g−1)·α + 2(g−1)/g·bytes/β`` for an all-reduce, half that
for an all-gather or reduce-scatter. **Overlap: none.** Every term adds to the step, as
on the simulated CPU devices where there is nothing to overlap with; on GPUs, where the
gradient all-reduce and the fsdp gathers overlap the backward pass, the model
overestimates those layouts' communication.

**Memory** is :func:`meshkit.plan.memory.device_memory`: parameters, gradients, AdamW
moments and activations (at one float32 copy each), the same count the start-up check
uses.

Examples:
    >>> from meshkit.config import load_config
    >>> from meshkit.exchange.cost import preset
    >>> config = load_config(None)
    >>> best = plan(config, devices=8, topology=preset("h100-8x400g", 1))[0]
    >>> best.layout.devices, best.predicted_step_s > 0
    (8, True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator, Sequence

import numpy as np

from meshkit._fs import cannot_write, write_file
from meshkit._yamlfile import load_yaml
from meshkit.config import Config, ConfigError, ModelConfig, read_config_file, with_overrides
from meshkit.errors import UsageError
from meshkit.exchange import cost
from meshkit.exchange.capacity import capacity, dedup_nodes_per_token
from meshkit.plan.flops import flops_per_token
from meshkit.plan.memory import WORD, DeviceMemory, device_memory
from meshkit.units import format_bytes

__all__ = [
    "AXIS_ORDER",
    "EXCHANGES",
    "MAX_DEVICES",
    "MAX_FACTORISATIONS",
    "MICROBATCHES",
    "TERMS",
    "Layout",
    "PlanError",
    "PlanReport",
    "Prediction",
    "candidate_layouts",
    "check_device_count",
    "check_layout",
    "enumerate_layouts",
    "format_table",
    "layout_of",
    "plan",
    "planning_config",
    "predict",
    "rejection",
    "resolve_topology",
    "run_plan",
    "sized_topology",
]

#: Mesh axis names, outer → inner, and the role each one has.
AXIS_ORDER = (("pp", "pipeline"), ("dp", "data"), ("fsdp", "fsdp"), ("node", "expert"),
              ("device", "expert"), ("tp", "tensor"))
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
#: The terms of a predicted step, in the order :class:`Prediction` reports them.
TERMS = ("compute", "weights", "tensor", "exchange", "fsdp", "pipeline", "bubble",
         "gradients", "optimizer")
# AdamW per parameter per step: reads parameter, gradient and two moments, writes three.
_OPTIMIZER_PASSES = 7
# A tick's weights through memory: read forward, read backward, gradient written.
_WEIGHT_PASSES = 3
# Collectives per layer per tick (see the module docstring).
_TENSOR_ALL_REDUCES = 2  # attention output, forward and its transpose
_EXCHANGES_PER_LAYER = 4  # dispatch, combine, and both transposes
_PIPELINE_PERMUTES = 2  # activations forward, their gradients backward
# FSDP's collectives per layer per tick: the forward all-gather of the weights, the
# backward pass's second all-gather (meshkit's blocks under fsdp are rematerialised with
# `regather`, meshkit/model/remat.py: a gathered weight is never kept for the backward
# pass) and the gradients' reduce-scatter.
_FSDP_COLLECTIVES = 3
# ... and its transposes through memory, each a read and a write of the full-width
# weight: a weight sharded on d_model where d_model is not its leading dimension (the
# routed experts [E, d, f] and [E, f, d], the attention output [heads, d_head, d]) is
# gathered along its leading physical dimension and then transposed into the layout the
# matmul reads, in the forward pass and again in the backward pass's regather; its
# gradient is transposed back before the reduce-scatter. Counted in meshkit's compiled
# step (meshkit bench plan's model, 8 CPU devices): the copy fusions write 41 MB
# more a step at fsdp2·ep4 and 78 MB more at fsdp4·ep2 than without fsdp, 3 × the
# full-width experts and output projection of each of the 4 layers (40.9 and 78.6 MB).
# On GPUs NCCL's all-gather also concatenates along the leading dimension, so the
# transposes should remain (not measured there); at HBM bandwidth they cost little.
_FSDP_TRANSPOSES = 3


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

    @property
    def expert(self) -> int:
        """Ways the experts are split."""
        return self.expert_nodes * self.expert_devices

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        return self.pipeline * self.data * self.fsdp * self.expert * self.tensor

    @property
    def batch_ways(self) -> int:
        """Ways the batch is split: data, fsdp and expert."""
        return self.data * self.fsdp * self.expert

    def _sizes(self) -> list[tuple[str, int]]:
        sizes = dict(pp=self.pipeline, dp=self.data, fsdp=self.fsdp, node=self.expert_nodes,
                     device=self.expert_devices, tp=self.tensor)
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
        for name, size in self._sizes():
            if size > 1:
                out["ep" if single_expert and name in ("node", "device") else name] = size
        return out or {"dp": 1}

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

        return [
            "mesh.axes={" + ", ".join(f"{a}: {s}" for a, s in axes.items()) + "}",
            "mesh.ranks=null",
            f"parallel.data={names('dp')}",
            f"parallel.fsdp={names('fsdp')}",
            f"parallel.tensor={names('tp')}",
            f"parallel.pipeline={'pp' if self.pipeline > 1 else 'null'}",
            f"parallel.microbatches={self.microbatches}",
            "exchange.node_axis=[" + ", ".join(node) + "]",
            "exchange.device_axis=[" + ", ".join(device) + "]",
            "exchange.method=" + ("hierarchical" if self.exchange in ("hierarchical", "dedup")
                                  else "flat"),
            f"exchange.dedup={'true' if self.exchange == 'dedup' else 'false'}",
            # A base config's schedule and stage sizes need a pipeline: not without one.
            *(["parallel.schedule=gpipe", "parallel.stage_layers=null",
               "parallel.virtual_stages=1"]
              if self.pipeline == 1 else []),
        ]

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
                parts.append(f"ep{split}({self.exchange})")
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


class StepFigures:
    """What a predicted step derives from its ``terms`` (seconds each) and
    ``tokens_per_step``: shared by :class:`Prediction` and the model planner's."""

    terms: dict[str, float]
    tokens_per_step: int

    @property
    def predicted_step_s(self) -> float:
        """Seconds per step: the sum of the terms (no overlap)."""
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second at the predicted step time."""
        return self.tokens_per_step / self.predicted_step_s

    @property
    def bottleneck(self) -> str:
        """The largest term."""
        return max(self.terms, key=lambda t: self.terms[t])


@dataclasses.dataclass(frozen=True)
class Prediction(StepFigures):
    """The predicted step of one layout.

    Attributes:
        layout: the layout.
        terms: seconds per step of each of :data:`TERMS`.
        memory: one device's memory, term by term.
        tokens_per_step: the global batch in tokens.
    """

    layout: Layout
    terms: dict[str, float]
    memory: DeviceMemory
    tokens_per_step: int

    def to_json(self) -> dict[str, object]:
        """The ``meshkit plan --json`` object of this layout.

        Returns:
            ``layout``, ``overrides``, ``predicted_step_s``, ``predicted_tokens_per_s``,
            ``predicted_memory_bytes``, ``predicted_state_bytes``, ``bottleneck``,
            ``terms_s``.
        """
        return {
            "layout": self.layout.name(),
            "overrides": self.layout.overrides(),
            "predicted_step_s": self.predicted_step_s,
            "predicted_tokens_per_s": self.tokens_per_s,
            "predicted_memory_bytes": self.memory.total,
            "predicted_state_bytes": self.memory.state,
            "bottleneck": self.bottleneck,
            "terms_s": dict(self.terms),
        }


# ------------------------------------------------------------------ placement


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


def _fsdp_time(layers: int, layer_bytes: float, transposed_bytes: float, head_bytes: float,
               group: tuple[int, int], t: cost.Topology) -> float:
    """FSDP's time for one pass of the batch through ``layers`` layers: each layer's
    gathers and reduce-scatter (:data:`_FSDP_COLLECTIVES`) of its ``layer_bytes`` over the
    placed ``group``, the transposes (:data:`_FSDP_TRANSPOSES`, a read and a write each) of
    its ``transposed_bytes``, and the embedding and head's gather and reduce-scatter."""
    return (layers * (_FSDP_COLLECTIVES * _all_reduce(layer_bytes, group, t, half=True)
                      + _FSDP_TRANSPOSES * 2 * transposed_bytes / t.memory_bandwidth_Bps)
            + 2 * _all_reduce(head_bytes, group, t, half=True))


# ------------------------------------------------------------------ the model


@dataclasses.dataclass(frozen=True)
class _Work:
    """What does not depend on the layout: the model and the batch."""

    model: ModelConfig
    batch: int
    seq_len: int

    @functools.cached_property
    def flops(self) -> tuple[float, float, float]:
        """Forward FLOPs per token: (split over stages and tensor ranks, routed
        experts, head)."""
        f = flops_per_token(self.model, seq_len=self.seq_len)
        return float(f.attention + f.scores + f.router + f.shared), float(f.experts), \
            float(f.head)


def predict(config: Config, layout: Layout, topology: cost.Topology) -> Prediction:
    """Predict one training step of ``config``'s model and batch under ``layout``.

    The formulas and the overlap assumption are in this module's docstring.

    Args:
        config: the model (``model``) and the global batch (``train.batch_size``,
            ``train.seq_len``); its mesh is ignored.
        layout: the layout (its sizes must satisfy the config's rules; see
            :func:`rejection`).
        topology: the cluster, with ``flops_per_s`` set and ``devices`` equal to the
            layout's.

    Returns:
        The :class:`Prediction`.

    Raises:
        ValueError: a topology without ``flops_per_s`` or of another device count.

    Examples:
        >>> from meshkit.config import load_config
        >>> from meshkit.exchange.cost import preset
        >>> p = predict(load_config(None), Layout(data=8), preset("h100-8x400g", 1))
        >>> p.terms["exchange"], p.bottleneck
        (0.0, 'gradients')
    """
    if topology.flops_per_s is None:
        raise ValueError("topology: flops_per_s is unknown; use a preset or a file "
                         "written by meshkit calibrate")
    if topology.devices != layout.devices:
        raise ValueError(f"topology has {topology.devices} devices, the layout "
                         f"{layout.devices}")
    work = _Work(config.model, config.train.batch_size, config.train.seq_len)
    return _predict(work, layout, topology)


def _predict(work: _Work, lay: Layout, t: cost.Topology) -> Prediction:
    m = work.model
    assert t.flops_per_s is not None
    d, e, k = m.d_model, m.num_experts, m.top_k
    stages, mb, tp = lay.pipeline, lay.microbatches, lay.tensor
    sequences = work.batch // lay.batch_ways
    n = sequences * work.seq_len // mb  # one device's tokens per microbatch
    routed = n // tp  # what the MoE routes per device per microbatch
    split, experts, head = work.flops
    slots = (capacity(routed, num_experts=e, top_k=k, capacity_factor=m.capacity_factor)
             if routed else 0)
    padding = e * slots / (routed * k) if routed else 1.0
    tick_flops = 3 * (n * split / (stages * tp) + routed * experts * padding / stages
                      + n * head / tp)
    layers = m.num_layers // stages
    memory = device_memory(m, sequences=sequences, seq_len=work.seq_len, tensor=tp,
                           fsdp=lay.fsdp, pipeline=stages, expert=lay.expert,
                           microbatches=mb)
    sizes = tuple(s for _, s in lay._sizes())  # pp, dp, fsdp, node, device, tp
    per_node = t.devices_per_node

    def group(*members: int) -> tuple[int, int]:
        return _span(sizes, members, per_node)

    act = n * d * WORD
    tensor = 0.0
    if tp > 1:
        g = group(5)
        per_layer = (_TENSOR_ALL_REDUCES * _all_reduce(act, g, t)
                     + 2 * _all_reduce(act, g, t, half=True))  # MoE all-gather, transpose
        tensor = layers * per_layer + _all_reduce(act, g, t)  # + the embedding's
    exchange = 0.0
    if lay.expert > 1:
        size, nodes = group(3, 4)
        buffer = e * slots * d * WORD
        sub = cost.Topology(nodes, size // nodes, t.inter, t.intra, t.memory_bandwidth_Bps)
        method = "flat" if lay.exchange == "none" else lay.exchange
        carried = (dedup_nodes_per_token(routed, num_experts=e, nodes=nodes, top_k=k,
                                         max_nodes=m.max_nodes,
                                         capacity_factor=m.capacity_factor)
                   if routed else 1.0)
        exchange = layers * _EXCHANGES_PER_LAYER * cost.predict(
            method, buffer, sub, top_k=k, nodes_per_token=carried)
    # One layer's weights as the device computes with them: full width (gathered over
    # fsdp), its tensor share of attention, its experts.
    layer_weights = (4 * d * d // tp + d * e + 3 * e * d * m.d_ff // lay.expert
                     + 3 * d * m.num_shared_experts * m.d_ff) * WORD
    head_weights = 2 * m.vocab_size * d // tp * WORD  # embedding and head, every stage
    weights = (_WEIGHT_PASSES * (layers * layer_weights + head_weights)
               / t.memory_bandwidth_Bps)
    fsdp = 0.0
    if lay.fsdp > 1:
        # The weights FSDP gathers on a dimension that is not their leading one: the
        # routed experts and the attention output projection (see _FSDP_TRANSPOSES).
        transposed = (d * d // tp + 3 * e * d * m.d_ff // lay.expert) * WORD
        fsdp = _fsdp_time(layers, layer_weights, transposed, head_weights, group(2), t)
    pipeline = 0.0
    if stages > 1:
        _, nodes = group(0)
        link = t.inter if nodes > 1 else t.intra
        pipeline = _PIPELINE_PERMUTES * (link.latency_s + act / link.bandwidth_Bps)
    compute = tick_flops / t.flops_per_s
    tick = compute + weights + tensor + exchange + fsdp + pipeline
    # Gradients of weights replicated over data (and expert / tensor) ways: one all-reduce
    # a step, of this device's share (fsdp has reduce-scattered it already).
    expert_bytes = layers * 3 * e * d * m.d_ff // (lay.expert * lay.fsdp) * WORD
    dense_bytes = memory.params - expert_bytes
    gradients = (_all_reduce(dense_bytes, group(1, 3, 4), t)
                 + _all_reduce(expert_bytes, group(1, 5), t))
    terms = {
        "compute": mb * compute,
        "weights": mb * weights,
        "tensor": mb * tensor,
        "exchange": mb * exchange,
        "fsdp": mb * fsdp,
        "pipeline": mb * pipeline,
        "bubble": (stages - 1) * tick,
        "gradients": gradients,
        "optimizer": _OPTIMIZER_PASSES * memory.params / t.memory_bandwidth_Bps,
    }
    return Prediction(lay, terms, memory, work.batch * work.seq_len)


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

    nodes, inside = ways(config.node_axes), ways(config.device_axes)
    if nodes * inside == 1:
        exchange = "none"
    elif config.exchange.dedup:
        exchange = "dedup"
    elif config.exchange.method == "flat" or nodes == 1 or inside == 1:
        exchange = "flat"
    else:
        exchange = "hierarchical"
    return Layout(
        pipeline=ways(config.axes_with_role("pipeline")),
        data=ways(config.axes_with_role("data")),
        fsdp=ways(config.axes_with_role("fsdp")),
        expert_nodes=nodes,
        expert_devices=inside,
        tensor=ways(config.axes_with_role("tensor")),
        microbatches=config.parallel.microbatches,
        exchange=exchange,
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


def candidate_layouts(devices: int, per_node: int) -> Iterator[Layout]:
    """Every layout of ``devices`` devices, valid or not, before the config's rules.

    Args:
        devices: the device count.
        per_node: devices per node (decides the expert ways' node/device split).

    Yields:
        Layouts: each factorisation into pipeline, data, fsdp, expert and tensor ways,
        with each exchange plan its expert split allows and, with a pipeline, each of
        :data:`MICROBATCHES`.

    Raises:
        PlanError: ``devices`` is beyond what :func:`check_device_count` allows.

    Examples:
        >>> sorted({x.exchange for x in candidate_layouts(8, per_node=4)})
        ['dedup', 'flat', 'hierarchical', 'none']
    """
    check_device_count(devices)
    for pp, dp, fsdp, ep, tp in _factorisations(devices, _SPLITS):
        nodes, inside = _expert_split(ep, tp, per_node)
        if ep == 1:
            plans: tuple[str, ...] = ("none",)
        elif nodes > 1 and inside > 1:
            plans = ("flat", "hierarchical", "dedup")
        else:
            plans = ("flat",)
        for exchange in plans:
            for mb in (MICROBATCHES if pp > 1 else (1,)):
                yield Layout(pipeline=pp, data=dp, fsdp=fsdp, expert_nodes=nodes,
                             expert_devices=inside, tensor=tp, microbatches=mb,
                             exchange=exchange)


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
    if m.d_model % layout.fsdp:
        return "model.d_model"
    if m.num_layers % layout.pipeline:
        return "parallel.pipeline"
    if layout.pipeline == 1 and layout.microbatches > 1:
        return "parallel.microbatches"
    if t.batch_size % layout.batch_ways:
        return "train.batch_size"
    local = t.batch_size // layout.batch_ways
    if local % layout.microbatches:
        return "parallel.microbatches"
    if local // layout.microbatches * t.seq_len % layout.tensor:
        return "parallel.tensor"
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


def plan(config: Config, *, devices: int, topology: cost.Topology) -> list[Prediction]:
    """Every valid layout of ``devices`` devices that fits in memory, fastest first.

    Args:
        config: the model and the global batch.
        devices: the device count.
        topology: the cluster (``devices`` of them; see :func:`sized_topology`), with
            ``flops_per_s``; layouts needing more than ``memory_bytes`` per device are
            dropped (none is when it is ``None``).

    Returns:
        Predictions, ranked by predicted step time (then memory).

    Raises:
        PlanError: no layout satisfies the config's rules (the message names the key
            that rejected most), none fits in memory (it names the smallest need), or the
            topology's numbers make a predicted step time inf or NaN.
        ValueError: as :func:`predict`.
    """
    if topology.devices != devices:
        raise PlanError(f"--devices: {devices}, but the topology has {topology.devices}")
    if topology.flops_per_s is None:
        raise PlanError("--topology: the topology has no flops_per_s; use a preset or a "
                        "file written by meshkit calibrate")
    layouts, rejected = enumerate_layouts(config, devices, topology.devices_per_node)
    if not layouts:
        worst = max(rejected, key=lambda key: rejected[key])
        raise PlanError(
            f"{worst}: no layout of {devices} devices satisfies the config's rules "
            f"({sum(rejected.values())} rejected; by key: "
            + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items(), key=lambda i: -i[1]))
            + ")"
        )
    work = _Work(config.model, config.train.batch_size, config.train.seq_len)
    predictions = [_predict(work, layout, topology) for layout in layouts]
    if not all(math.isfinite(p.predicted_step_s) for p in predictions):
        # Ranking by NaN would print an arbitrary order as if it were a result.
        raise PlanError("--topology: predicted step times are not finite (inf or NaN): a "
                        "link, memory or FLOP/s figure is out of any physical range")
    limit = topology.memory_bytes
    fitting = [p for p in predictions if limit is None or p.memory.total <= limit]
    if not fitting:
        assert limit is not None  # without a limit every layout fits
        least = min(predictions, key=lambda p: p.memory.total)
        raise PlanError(
            f"model: fits nowhere on {devices} devices: the smallest layout "
            f"({least.layout.name()}) needs {format_bytes(least.memory.total)} per device, "
            f"the topology has {format_bytes(limit)} (memory_bytes)"
        )
    fitting.sort(key=lambda p: (p.predicted_step_s, p.memory.total))
    return fitting


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


def format_table(predictions: Sequence[Prediction]) -> str:
    """The ``meshkit plan`` table: one row a layout, best first.

    Args:
        predictions: ranked predictions.

    Returns:
        The table, with the overrides of each layout below it.

    Examples:
        >>> from meshkit.config import load_config
        >>> from meshkit.exchange.cost import preset
        >>> best = plan(load_config(None), devices=8, topology=preset("h100-8x400g", 1))
        >>> format_table(best[:1]).splitlines()[0].split()[:3]
        ['#', 'layout', 'step']
    """
    lines = [f"{'#':>3} {'layout':<34} {'step ms':>10} {'tokens/s':>12} {'GiB/dev':>8} "
             f"{'state GiB':>9}  bottleneck"]
    for i, p in enumerate(predictions, 1):
        share = p.terms[p.bottleneck] / p.predicted_step_s
        lines.append(
            f"{i:>3} {p.layout.name():<34} {p.predicted_step_s * 1e3:>10.3f} "
            f"{p.tokens_per_s:>12,.0f} {p.memory.total / 2**30:>8.3f} "
            f"{p.memory.state / 2**30:>9.3f}  {p.bottleneck} ({share:.0%})"
        )
        lines.append(f"    {' '.join(p.layout.overrides())}")
    return "\n".join(lines)


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


def _max_nodes_given(config_path: str | None, overrides: Sequence[str]) -> object:
    """``model.max_nodes`` as the file and the overrides give it (the last one wins)."""
    for item in reversed(overrides):
        key, _, text = item.partition("=")
        if key.strip() == "model.max_nodes":
            return load_yaml(text, where=key.strip())
    raw = read_config_file(config_path) if config_path is not None else None
    model = raw.get("model") if isinstance(raw, dict) else None
    return model.get("max_nodes") if isinstance(model, dict) else None


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
        ConfigError: a bad config, naming the key.

    Examples:
        >>> planning_config(None, ["model.num_experts=3"]).model.num_experts
        3
    """
    from meshkit.config import load_config

    # One device: every role of one way, so no mesh-dependent rule can fail, but
    # max_nodes (more than the one node); it is set back below, checked on its own.
    neutral = [*Layout().overrides(), "model.max_nodes=null"]
    config = load_config(config_path, [*overrides, *neutral])
    max_nodes = _max_nodes_given(config_path, overrides)
    if max_nodes is None:
        return config
    model = ModelConfig(**{**config.to_dict()["model"], "max_nodes": max_nodes})
    # Config's cross-section rules would judge max_nodes against the one-device mesh:
    # copy without them (rejection() judges it against each layout).
    return config.model_copy(update={"model": model})


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What ``meshkit plan`` found.

    Attributes:
        ranked: every layout that fits, best first.
        shown: the best ``top`` of them.
        topology: the cluster, sized to the device count.
        written: the config file written for the best layout, or ``None``.

    Examples:
        >>> report = run_plan(None, [], devices=8, top=2)
        >>> first = report.text().splitlines()[0]
        >>> first.split(" layouts fit on ")[1].split(",")[0], first.endswith("; the best 2:")
        ('1 node(s) × 8 devices', True)
        >>> json.loads(report.to_json())[0]["layout"]
        'pp2 dp4 mb2'
    """

    ranked: list[Prediction]
    shown: list[Prediction]
    topology: cost.Topology
    written: str | None = None

    def text(self) -> str:
        """The ``meshkit plan`` table: a line naming the cluster, then the best layouts.

        Returns:
            The text, without a final newline.
        """
        t = self.topology
        where = (f"{t.nodes} node(s) × {t.devices_per_node} devices, "
                 f"{t.flops_per_s / 1e12 if t.flops_per_s else 0:.3g} TFLOP/s and "
                 + (format_bytes(t.memory_bytes) if t.memory_bytes else
                    "unknown memory") + " per device")
        return (f"{len(self.ranked)} layouts fit on {where}; the best {len(self.shown)}:\n"
                + format_table(self.shown))

    def to_json(self) -> str:
        """``meshkit plan --json``: the best layouts as a JSON list, best first.

        Returns:
            The JSON text, indented.
        """
        return json.dumps([p.to_json() for p in self.shown], indent=2)


def run_plan(config_path: str | None, overrides: Sequence[str], *, devices: int | None,
             topology: str | None = None, preset: str | None = None,
             nodes: int | None = None, top: int = 5, write: str | None = None) -> PlanReport:
    """``meshkit plan``: rank the layouts; optionally write the best one's config.

    Args:
        config_path: the YAML config (``None``: the embedded default).
        overrides: ``key=value`` overrides of it.
        devices, topology, preset, nodes: the cluster (see :func:`resolve_topology`).
        top: how many layouts to show (>= 1).
        write: write the best layout's config to this file.

    Returns:
        A :class:`PlanReport` (the command prints its :meth:`~PlanReport.text` or
        :meth:`~PlanReport.to_json`).

    Raises:
        PlanError: bad flags, no valid layout, none that fits, an unwritable ``write``.
        ConfigError: a bad config (its mesh aside: the planner replaces it; see
            :func:`planning_config`).

    Examples:
        >>> report = run_plan(None, [], devices=8, top=1)
        >>> report.shown[0].layout.name(), len(report.ranked) > 1, report.written
        ('pp2 dp4 mb2', True, None)
    """
    if isinstance(top, bool) or top < 1:
        raise PlanError(f"--top: must be a positive integer, got {top!r}")
    if write is not None:
        problem = cannot_write(write)  # before the search, not after it
        if problem is not None:
            raise PlanError(f"--write: cannot write {write}: {problem}")
    config = planning_config(config_path, overrides)
    sized = resolve_topology(devices=devices, topology=topology, preset=preset, nodes=nodes)
    ranked = plan(config, devices=sized.devices, topology=sized)
    if write is not None:
        best = check_layout(config, ranked[0].layout)
        try:
            write_file(write, best.to_yaml(), flag="--write")
        except UsageError as e:
            raise PlanError(str(e)) from None
    return PlanReport(ranked=ranked, shown=ranked[:top], topology=sized, written=write)
