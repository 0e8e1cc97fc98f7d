"""The one step model and ranking of ``meshkit plan``: a config (meshkit's transformer,
described by :meth:`meshkit.plan.model_desc.ModelDesc.of_config`, or a user's model,
:mod:`meshkit.training.factory_desc`) and ``--model FILE`` alike (numpy only).

A *candidate* is a :class:`meshkit.plan.planner.Layout` with a remat policy, an attention
kind, a pipeline schedule and a number of accumulation micro-steps. Its memory is
:func:`meshkit.plan.memory_fit.layout_memory` (fitted to XLA); its step
(:func:`predict_model`), per device, with ``S`` stages, ``M`` microbatches, ``A``
micro-steps and ``v`` virtual stages. One *tick* runs one microbatch through one stage::

    tick = compute + weights + tensor + context + exchange + fsdp + pipeline
    step = A·(M·tick + (S−1)/v·tick) + gradients + optimizer

* **compute**: the tick's training FLOPs (:meth:`ModelDesc.flops_per_token`, the MFU
  count) over ``Topology.flops_per_s``, split as the roles split them: layers over
  stages, the rest over tensor ways (heads, the MoE's tokens, a Megatron MLP), the
  routed experts scaled by the capacity padding the MoE computes (``E·C`` slots for
  ``k`` rows a token); every stage computes the head (SPMD), so it is not divided by
  ``S``. The attention scores' causal half is left out where the kernel skips it
  (``chunked``, ``dot_product``, a context ring: :func:`_skipped_scores`). Times the
  remat recompute (:data:`REMAT_RECOMPUTE`).
* **weights**: the stage's working weights (full width after the fsdp gather, the
  device's experts, its tensor share) stream through memory :data:`_WEIGHT_PASSES` times
  a tick (read forward, read backward, gradient written): what small matmuls cost beyond
  their FLOPs, and why holding fewer experts per device pays even where the exchange
  is free.
* **tensor**: per layer, the attention output's all-reduce and its transpose
  (:data:`_TENSOR_ALL_REDUCES`), and the MLP's: a dense layer's Megatron MLP two
  all-reduces; an MoE layer under ``moe_tensor: tokens`` the all-gather of its tensor
  ranks' tokens and the reduce-scatter back, under ``ffn`` two all-reduces of the
  combined partial sums (:attr:`meshkit.plan.planner.Layout.moe_tensor`); plus one
  embedding all-reduce; of ``[tokens, d_model]`` at the compute dtype.
* **exchange**: per MoE layer, :data:`_EXCHANGES_PER_LAYER` all-to-alls (dispatch,
  combine and their transposes) of the ``[E, C, d_model]`` buffer (its capacity ``C``
  of the device's tokens over the tensor ways under ``tokens``, of all of them under
  ``ffn``: ``tp`` times the bytes), by
  :func:`meshkit.exchange.cost.predict` for the plan (flat, two-stage, or dedup with
  ``nodes_per_token`` as :func:`meshkit.exchange.capacity.dedup_nodes_per_token`).
* **fsdp**: per layer and tick, :data:`_FSDP_COLLECTIVES` collectives (the forward
  all-gather, the backward pass's regather, the gradients' reduce-scatter) of its
  weights, and :data:`_FSDP_TRANSPOSES` transposes through memory of the weights gathered
  off their leading dimension; inside the tick, as the compiled step runs it: a block's
  gathers are tied to its input, so every tick gathers again, the bubble's included.
  The non-expert weights are gathered over the fsdp ways, and over the expert ways too
  where those are fsdp (``Layout.expert_fsdp``); the routed experts over the fsdp ways
  only.
* **pipeline**: a ``ppermute`` of the activations forward and one backward per tick
  (``v`` times as many for ``interleaved``).
* **bubble**: the ``(S − 1)/v`` idle ticks, ``(S−1)/(v·M+S−1)`` of the pipelined part
  (GPipe and 1F1B alike).
* **gradients**: one all-reduce per optimizer step of the gradients of weights
  replicated across devices: dense weights over the data and expert ways (the data ways
  alone where the expert ways are fsdp too, ``Layout.expert_fsdp``), expert weights
  over the data and tensor ways (the data ways alone under ``ffn``).
* **optimizer**: AdamW reads parameters, gradients and both moments and writes three of
  them back: :data:`_OPTIMIZER_PASSES` × the parameter bytes over the memory bandwidth.

Collectives cost ring times over the link their groups use (``inter`` as soon as a
group spans two nodes): ``2(g−1)·α + 2(g−1)/g·bytes/β`` for an all-reduce, half that
for an all-gather or reduce-scatter. **Overlap: none.** Every term adds to the step, as
on the simulated CPU devices where there is nothing to overlap with; on GPUs, where the
gradient all-reduce and the fsdp gathers overlap the backward pass, the model
overestimates those layouts' communication.

Examples:
    >>> from meshkit.exchange.cost import preset
    >>> from meshkit.plan.model_desc import ModelDesc
    >>> desc = ModelDesc(name="t", vocab_size=256, d_model=256, num_layers=4, num_heads=4,
    ...                  d_ff=512, seq_len=64, batch_size=32)
    >>> best = plan_model(desc, devices=8, topology=preset("h100-8x400g", 1))[0]
    >>> best.candidate.layout.devices, best.memory.total > 0
    (8, True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from meshkit.choices import (
    MOE_TENSOR_MODES,
    PIPELINE_SCHEDULES,
    PIPELINE_SCHEDULES_BUILT,
    REMAT_POLICIES,
)
from meshkit.config.context_method import choose
from meshkit.exchange import cost
from meshkit.exchange.capacity import dedup_nodes_per_token
from meshkit.plan.context_cost import context_seconds
from meshkit.plan.flops import TRAINING_MULTIPLIER
from meshkit.plan.memory_fit import LayoutMemory, capacity, expert_tp, layout_memory
from meshkit.plan.model_desc import DTYPE_BYTES, Measured, ModelDesc, default_attention_chunk
from meshkit.plan.planner import (
    MICROBATCHES,
    Layout,
    PlanError,
    _all_reduce,
    _divisors,
    _span,
    candidate_layouts,
)
from meshkit.units import format_bytes

if TYPE_CHECKING:
    from meshkit.plan.measured import MeasuredModel

__all__ = [
    "ACCUMULATION",
    "REMAT_RECOMPUTE",
    "TERMS",
    "Candidate",
    "ModelPlanReport",
    "ModelPrediction",
    "auto_context_method",
    "candidates",
    "context_ways",
    "format_model_table",
    "layout_rejection",
    "model_rejection",
    "plan_model",
    "predict_model",
    "run_model_plan",
    "runnable_choices",
    "runnable_rejection",
    "uncompiled",
]

#: The terms of a predicted step, in the order :class:`ModelPrediction` reports them.
TERMS = ("compute", "weights", "tensor", "context", "exchange", "fsdp", "pipeline", "bubble",
         "gradients", "optimizer")
# AdamW per parameter per step: reads parameter, gradient and two moments, writes three.
_OPTIMIZER_PASSES = 7
# A tick's weights through memory: read forward, read backward, gradient written.
_WEIGHT_PASSES = 3
# Collectives per layer per tick (see the module docstring).
_TENSOR_ALL_REDUCES = 2  # attention output, forward and its transpose
_MEGATRON_MLP_ALL_REDUCES = 2  # a column/row-parallel MLP's output, forward and transpose
_MOE_TOKEN_SPLITS = 2  # meshkit's MoE: all-gather of the tensor ranks' tokens, reduce-scatter
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
# Indices of the context axes (outer, inner) and the tensor axis in Layout._sizes().
_CP = (5, 6)
_TP = 7
#: Micro-steps tried per optimizer step when the description leaves ``grad_accum`` open.
ACCUMULATION = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Compute multiplier of each remat policy: ``full`` reruns the forward pass (1 + 1/3 of
#: a step's 3 passes), ``save_dots`` reruns the elementwise work only.
REMAT_RECOMPUTE = {"none": 1.0, "save_dots": 1.05, "full": 4 / 3}
#: Virtual stages (chunks per stage) tried for ``interleaved``: those dividing the
#: layers a stage holds. More chunks shrink the bubble but multiply the sends.
VIRTUAL_STAGES = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout and the step's choices.

    Attributes:
        layout: each role's ways.
        remat, attention, schedule: the step's choices.
        grad_accum: micro-steps per optimizer step.
        virtual_stages: chunks of layers per stage (``parallel.virtual_stages``): above 1
            only with the ``interleaved`` schedule.
    """

    layout: Layout
    remat: str = "none"
    attention: str = "xla"
    grad_accum: int = 1
    schedule: str = "gpipe"
    virtual_stages: int = 1

    def name(self) -> str:
        """The layout's name with the choices that differ from the plain step."""
        parts = [self.layout.name()]
        if self.grad_accum > 1:
            parts.append(f"accum{self.grad_accum}")
        if self.remat != "none":
            parts.append(self.remat)
        if self.layout.pipeline > 1 and self.schedule != "gpipe":
            parts.append(self.schedule + (f" v{self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))
        if self.attention != "xla":
            parts.append(self.attention)
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class ModelPrediction:
    """The predicted step and memory of one candidate.

    Attributes:
        candidate: the candidate.
        terms: seconds per optimizer step of each term.
        memory: one device's bytes, term by term.
        tokens_per_step: the global batch in tokens.
        verified_bytes: XLA's bytes per device from ``--verify`` (plus the
            accumulator), or ``None``.
        compiled_prediction: the numpy prediction of exactly what ``--verify``
            compiled (the model as meshkit builds it, the choices the config knows),
            to compare with ``verified_bytes``; ``None`` when not verified.
    """

    candidate: Candidate
    terms: dict[str, float]
    memory: LayoutMemory
    tokens_per_step: int
    verified_bytes: int | None = None
    compiled_prediction: int | None = None

    @property
    def layout(self) -> Layout:
        """The candidate's layout."""
        return self.candidate.layout

    @property
    def predicted_step_s(self) -> float:
        """Seconds per optimizer step: the sum of the terms (no overlap)."""
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second at the predicted step time."""
        return self.tokens_per_step / self.predicted_step_s

    @property
    def bottleneck(self) -> str:
        """The largest term."""
        return max(self.terms, key=lambda t: self.terms[t])

    def to_json(self) -> dict[str, object]:
        """The ``meshkit plan --model ... --json`` object of this candidate."""
        c = self.candidate
        out: dict[str, object] = {
            "layout": c.name(),
            "overrides": c.layout.overrides(),
            "remat": c.remat, "attention": c.attention, "grad_accum": c.grad_accum,
            "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "predicted_step_s": self.predicted_step_s,
            "predicted_tokens_per_s": self.tokens_per_s,
            "predicted_memory_bytes": self.memory.total,
            "predicted_state_bytes": int(self.memory.state),
            # The fitted terms are live in phases: they do not sum to the total, the
            # exact terms plus the peak phase's do (meshkit.plan.memory_fit.PHASES).
            "memory_terms_bytes": {k: int(v) for k, v in self.memory.terms.items()},
            "memory_peak_phase": self.memory.peak_phase,
            "bottleneck": self.bottleneck,
            "terms_s": dict(self.terms),
        }
        if self.verified_bytes is not None:
            out["verified_memory_bytes"] = self.verified_bytes
            out["compiled_predicted_memory_bytes"] = self.compiled_prediction
            out["compiled_without"] = uncompiled(c)
        return out


def _device_sequences(desc: ModelDesc, lay: Layout, grad_accum: int) -> int:
    """Sequences one device runs per micro-step (the batch over accumulation and the
    batch ways)."""
    return desc.batch_size // (grad_accum * lay.batch_ways)


def model_rejection(desc: ModelDesc, cand: Candidate) -> str | None:
    """The description field a candidate cannot split, or ``None`` if it is valid.

    Args:
        desc: the model.
        cand: the candidate.

    Returns:
        ``num_heads``, ``num_kv_heads``, ``num_experts``, ``num_layers``, ``batch_size``,
        ``d_model``, ``d_ff`` (a Megatron dense MLP's width over the tensor ways),
        ``expert_d_ff`` (each expert's, under ``ffn``), ``zero1`` or ``schedule``
        (``interleaved``: its chunks must split the stages' layers evenly and it needs
        as many microbatches as stages), or ``None``.

    Examples:
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
        ...               d_ff=128, seq_len=16, batch_size=8)
        >>> model_rejection(d, Candidate(Layout(tensor=8)))
        'num_heads'
    """
    lay = cand.layout
    why = layout_rejection(desc, lay)
    if why is not None:
        return why
    if desc.measured is not None:
        micro = desc.batch_size // cand.grad_accum
        if desc.batch_size % cand.grad_accum or micro % lay.batch_ways:
            return "batch_size"
        return "zero1" if desc.zero1 and lay.data == 1 else None
    if _schedule_breaks(desc, lay, cand.schedule, cand.virtual_stages):
        return "schedule"
    if _batch_breaks(desc, lay, cand.grad_accum):
        return "batch_size"
    mbs = desc.micro_batch_size
    if (mbs is not None and lay.pipeline > 1
            and _device_sequences(desc, lay, cand.grad_accum) != mbs * lay.microbatches):
        return "micro_batch_size"
    if desc.d_model % lay.weight_shards:
        return "d_model"
    # The tensor ways split a Megatron dense MLP's width, and each expert's under ffn.
    if (desc.megatron_tp and desc.num_layers > desc.moe_layers
            and desc.d_ff % lay.tensor):
        return "d_ff"
    if expert_tp(desc, lay) > 1 and desc.ff_expert % lay.tensor:
        return "expert_d_ff"
    if desc.zero1 and lay.data == 1:  # ZeRO-1 shards over the data ways: it needs some
        return "zero1"
    return None


def _schedule_breaks(desc: ModelDesc, lay: Layout, schedule: str, virtual_stages: int
                     ) -> bool:
    """``interleaved`` whose chunks do not split the stages' layers evenly, or with
    fewer microbatches than stages."""
    return schedule == "interleaved" and lay.pipeline > 1 and bool(
        desc.num_layers % (lay.pipeline * virtual_stages) or lay.microbatches < lay.pipeline)


def _batch_breaks(desc: ModelDesc, lay: Layout, grad_accum: int) -> bool:
    """The batch does not split into the micro-steps, the batch ways and the
    microbatches."""
    micro = desc.batch_size // grad_accum
    return bool(desc.batch_size % grad_accum or micro % lay.batch_ways
                or (micro // lay.batch_ways) % lay.microbatches)


def layout_rejection(desc: ModelDesc, lay: Layout) -> str | None:
    """The first rules of :func:`model_rejection`, those a layout breaks whatever the
    step's choices: the planner checks them once per layout, not once per candidate.

    Args:
        desc: the model.
        lay: the layout.

    Returns:
        ``num_heads``, ``num_kv_heads``, ``seq_len``, ``num_experts``, ``num_layers``
        (for a measured model the config key of a role it cannot split), or ``None``.

    Examples:
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
        ...               d_ff=128, seq_len=16, batch_size=8)
        >>> layout_rejection(d, Layout(context=16, context_method="ring"))
        'seq_len'
    """
    if desc.measured is not None:
        # A user's model is measured whole: the planner knows how its parameters split
        # over data and fsdp ways, not its tensor, expert, pipeline or context use.
        for ways, key in ((lay.tensor, "parallel.tensor"), (lay.expert, "exchange.device_axis"),
                          (lay.pipeline, "parallel.pipeline"),
                          (lay.context, "parallel.context")):
            if ways > 1:
                return key
        return None
    if desc.num_heads % lay.tensor:
        return "num_heads"
    if desc.kv_heads % lay.tensor and lay.tensor % desc.kv_heads:
        return "num_kv_heads"
    why = _context_rejection(desc, lay)
    if why is not None:
        return why
    if (desc.num_experts if desc.is_moe else 1) % lay.expert:
        return "num_experts"
    if desc.num_layers < lay.pipeline:  # uneven stages are fine (the largest counts)
        return "num_layers"
    return None


def _context_rejection(desc: ModelDesc, lay: Layout) -> str | None:
    """The field a layout's context ways cannot split: ``seq_len`` (the load-balanced
    order cuts each sequence into ``2c`` chunks), or ``num_heads`` / ``num_kv_heads``
    (Ulysses, and ``hierarchical``'s inner ways, turn sequence shards into head shards:
    the heads a tensor rank holds must divide among them)."""
    if lay.context == 1:
        return None
    if desc.seq_len % (2 * lay.context):
        return "seq_len"
    ways = {"ulysses": lay.context, "hierarchical": lay.context_inner}.get(
        lay.context_method, 1)
    if (desc.num_heads // lay.tensor) % ways:
        return "num_heads"
    if _kv_per_rank(desc, lay) % ways:
        return "num_kv_heads"
    return None


def _kv_per_rank(desc: ModelDesc, lay: Layout) -> int:
    """Key/value heads a tensor rank holds: split where the tensor ways divide them,
    one (replicated) where there are more tensor ways than kv heads."""
    return max(desc.kv_heads // lay.tensor, 1)


def context_ways(desc: ModelDesc, devices: int) -> tuple[int, ...]:
    """The context ways the planner tries for a model on ``devices`` devices.

    1, and each divisor ``c`` of ``devices`` whose load-balanced chunks (``seq_len /
    2c`` tokens, :func:`_context_rejection`) hold at least one attention block (the
    config's ``model.attention_chunk`` default, 128): a chunk shorter than a block
    leaves the kernel's blocks part-empty and only adds messages, and the bound keeps
    the search of a long sequence on many devices within the planning time. A measured
    model (``model.factory``) splits no sequence: 1 only.

    Args:
        desc: the model.
        devices: the device count.

    Returns:
        Context ways, ascending.

    Examples:
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
        ...               d_ff=128, seq_len=1024, batch_size=8)
        >>> context_ways(d, 8)
        (1, 2, 4)
    """
    if desc.measured is not None:
        return (1,)
    block = default_attention_chunk()
    return tuple(c for c in _divisors(devices)
                 if c == 1 or (desc.seq_len % (2 * c) == 0
                               and desc.seq_len // (2 * c) >= block))


def candidates(desc: ModelDesc, devices: int, per_node: int,
               schedules: Sequence[str] = PIPELINE_SCHEDULES,
               remat_policies: Sequence[str] | None = None) -> Iterator[Candidate]:
    """Every candidate of ``devices`` devices, valid or not.

    Args:
        desc: the model (its ``remat``, ``attention`` and ``grad_accum``, when set, are
            the only ones tried; else every remat policy, ``xla`` attention and each of
            :data:`ACCUMULATION`).
        devices: the device count.
        per_node: devices per node.
        schedules: pipeline schedules tried for pipelined layouts.
        remat_policies: policies tried when ``desc.remat`` is open (default: all).

    Yields:
        Candidates.
    """
    for lay in _layouts(desc, devices, per_node):
        yield from _expand(desc, lay, schedules, remat_policies)


def _layouts(desc: ModelDesc, devices: int, per_node: int) -> Iterator[Layout]:
    """The layouts :func:`candidates` expands (see there)."""
    mbs = desc.micro_batch_size
    # An MoE model's tensor ways split its tokens or its experts' width: both tried
    # unless the description fixes one; its expert ways may shard the other weights too.
    modes = ((desc.moe_tensor,) if desc.moe_tensor else MOE_TENSOR_MODES[1:]) \
        if desc.is_moe else ("auto",)
    sharded = (False, True) if desc.is_moe else (False,)
    for lay in candidate_layouts(devices, per_node, moe_tensor=modes, expert_fsdp=sharded,
                                 contexts=context_ways(desc, devices)):
        if lay.expert > 1 and not desc.is_moe:
            continue
        if mbs is not None and lay.pipeline > 1 and lay.microbatches != MICROBATCHES[0]:
            continue  # the microbatches follow from micro_batch_size: one layout each
        yield lay


def _choices(desc: ModelDesc, lay: Layout, schedules: Sequence[str],
             remat_policies: Sequence[str] | None
             ) -> tuple[list[tuple[str, int]], tuple[str, ...], tuple[int, ...]]:
    """A layout's ``(schedule, virtual stages)`` pairs, remat policies and
    accumulation counts tried."""
    remats = (desc.remat,) if desc.remat else tuple(remat_policies or REMAT_POLICIES)
    accums = (desc.grad_accum,) if desc.grad_accum else ACCUMULATION
    scheds = (desc.schedule,) if desc.schedule else tuple(schedules)
    pairs = [(sched, v) for sched in (scheds if lay.pipeline > 1 else ("gpipe",))
             for v in _virtual_stages(desc, lay, sched)]  # by the stages, not microbatches
    return pairs, remats, accums


def _expand(desc: ModelDesc, lay: Layout, schedules: Sequence[str],
            remat_policies: Sequence[str] | None,
            accumulations: Sequence[int] | None = None) -> Iterator[Candidate]:
    """One layout's candidates, in :func:`candidates`' order (``accumulations``: only
    these of its accumulation counts)."""
    attention = desc.attention or "xla"
    mbs = desc.micro_batch_size
    pairs, remats, accums = _choices(desc, lay, schedules, remat_policies)
    if accumulations is not None:
        accums = tuple(accumulations)
    for sched, v in pairs:
        for remat in remats:
            for accum in accums:  # innermost and ascending: see plan_model
                placed = lay
                if mbs is not None and lay.pipeline > 1:
                    seqs = _device_sequences(desc, lay, accum)
                    placed = dataclasses.replace(lay, microbatches=max(1, seqs // mbs))
                yield Candidate(placed, remat, attention, accum, sched, v)


def _virtual_stages(desc: ModelDesc, lay: Layout, schedule: str) -> tuple[int, ...]:
    """The virtual stages tried: 1 but for ``interleaved``, which tries each of
    :data:`VIRTUAL_STAGES` that divides the layers of a stage (none: no candidate)."""
    if schedule != "interleaved" or lay.pipeline == 1:
        return (1,)
    if desc.num_layers % lay.pipeline:
        return (VIRTUAL_STAGES[0],)  # rejected by model_rejection, which names the field
    per_stage = desc.num_layers // lay.pipeline
    return tuple(v for v in VIRTUAL_STAGES if per_stage % v == 0) or (VIRTUAL_STAGES[0],)


#: Attention kinds whose kernel skips the causal mask's blocks wholly above the diagonal
#: (meshkit's blockwise kernel, ``meshkit.model.flash``; a fused flash kernel on GPU).
_BLOCK_SKIPPING = ("chunked", "dot_product")


def _skipped_scores(desc: ModelDesc, cand: Candidate) -> float:
    """Training FLOPs a token's attention scores skip: the causal half of
    :meth:`ModelDesc.flops_per_token`'s full square (the MFU count, which keeps it) where
    the kernel skips the blocks above the diagonal (:data:`_BLOCK_SKIPPING`, and a
    ring's steps, which visit blocks of ``T/c``); none where the scores are computed
    whole and masked (``xla``, and ``all_gather`` or Ulysses around it)."""
    ring = cand.layout.context_method in ("ring", "hierarchical")
    if cand.attention not in _BLOCK_SKIPPING and not ring:
        return 0.0
    return 0.5 * 12 * desc.num_layers * desc.seq_len * desc.num_heads * desc.head_size


def _context_shape(desc: ModelDesc, lay: Layout, t: cost.Topology, *, batch: int
                   ) -> dict[str, Any]:
    """The arguments of :func:`meshkit.config.context_method.predict` (and ``choose``)
    for a layout's context axes: ``batch`` sequences a microbatch, the heads a tensor
    rank holds, each axis on the link its groups use (``cpo`` and ``cpi`` for
    ``hierarchical``, one ``cp`` axis otherwise)."""
    sizes = tuple(v for _, v in lay._sizes())
    axes = _CP if lay.context_method == "hierarchical" else _CP[1:]
    links = tuple(t.inter if _span(sizes, (i,), t.devices_per_node)[1] > 1 else t.intra
                  for i in axes)
    return dict(seq_len=desc.seq_len, batch=batch, heads=desc.num_heads // lay.tensor,
                kv_heads=_kv_per_rank(desc, lay), head_dim=desc.head_size,
                dtype_bytes=DTYPE_BYTES[desc.compute_dtype],
                sizes=tuple(sizes[i] for i in axes), links=links,
                flops_per_s=t.flops_per_s)


def auto_context_method(desc: ModelDesc, lay: Layout, t: cost.Topology) -> str:
    """What ``parallel.context_method: auto`` runs on a layout's context axes: the
    config's cost model's pick (:func:`meshkit.config.context_method.choose`) for one
    micro-step's microbatch.

    Args:
        desc: the model.
        lay: a layout with context ways (valid for ``desc``).
        t: the topology.

    Returns:
        The method.

    Examples:
        >>> from meshkit.exchange.cost import preset
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
        ...               d_ff=128, seq_len=1024, batch_size=8)
        >>> auto_context_method(d, Layout(data=2, context=4, context_method="ring"),
        ...                     preset("h100-8x400g", 1))
        'ring'
    """
    shape = _context_shape(desc, lay, t, batch=max(
        desc.batch_size // (lay.batch_ways * lay.microbatches), 1))
    shape["context_sizes"] = shape.pop("sizes")
    return _choose(**shape)


@functools.lru_cache(maxsize=4096)
def _choose(**shape: Any) -> str:
    return choose(**shape).method


def candidate_memory(desc: ModelDesc, cand: Candidate) -> LayoutMemory:
    """One device's memory of a candidate, as :func:`predict_model` reports it.

    Args:
        desc: the model.
        cand: the candidate.

    Returns:
        The :class:`~meshkit.plan.memory_fit.LayoutMemory`.
    """
    v = cand.virtual_stages if cand.schedule == "interleaved" else 1
    return layout_memory(desc, cand.layout, grad_accum=cand.grad_accum, remat=cand.remat,
                         attention=cand.attention, schedule=cand.schedule, virtual_stages=v)


def predict_model(desc: ModelDesc, cand: Candidate, t: cost.Topology, *,
                  memory: LayoutMemory | None = None) -> ModelPrediction:
    """The predicted step (see the module docstring) and memory of one candidate: the one
    step model of ``meshkit plan``, for a config and for ``--model`` alike.

    Args:
        desc: the model.
        cand: a valid candidate (:func:`model_rejection` is ``None``).
        t: the topology, with ``flops_per_s`` and the candidate's device count.
        memory: its :func:`candidate_memory`, where the caller has it already.

    Returns:
        The :class:`ModelPrediction`.

    Raises:
        ValueError: a topology without ``flops_per_s`` or of another device count.

    Examples:
        >>> from meshkit.exchange.cost import preset
        >>> d = ModelDesc(name="t", vocab_size=256, d_model=256, num_layers=4, num_heads=4,
        ...               d_ff=512, seq_len=64, batch_size=32)
        >>> p = predict_model(d, Candidate(Layout(data=8)), preset("h100-8x400g", 1))
        >>> p.terms["exchange"], p.terms["fsdp"], p.bottleneck
        (0.0, 0.0, 'gradients')
    """
    if t.flops_per_s is None:
        raise ValueError("topology: flops_per_s is unknown; use a preset or a file "
                         "written by meshkit calibrate")
    lay = cand.layout
    if t.devices != lay.devices:
        raise ValueError(f"topology has {t.devices} devices, the layout {lay.devices}")
    memory = memory or candidate_memory(desc, cand)
    if desc.measured is not None:
        return _predict_measured(desc, desc.measured, cand, t, memory)
    s, mb, tp, accum = lay.pipeline, lay.microbatches, lay.tensor, cand.grad_accum
    d, e, k = desc.d_model, desc.num_experts, desc.top_k
    cb = DTYPE_BYTES[desc.compute_dtype]
    seqs = _device_sequences(desc, lay, accum)
    cp = lay.context
    n = seqs * desc.seq_len // (mb * cp)  # tokens per microbatch (its share of each sequence)
    layers = math.ceil(desc.num_layers / s)  # the largest of uneven stages sets the pace
    moe_layers = min(math.ceil(desc.moe_layers / s), layers)
    dense_layers = layers - moe_layers
    etp = expert_tp(desc, lay)  # tensor ways splitting each expert's width (ffn)
    # What one device routes per microbatch: its tensor rank's slice of the tokens
    # (tokens), or all of them, with 1/tp of each expert (ffn).
    routed = n // tp if etp == 1 else n
    padding = 1.0
    slots = 0
    if desc.is_moe and routed:
        slots = capacity(routed, num_experts=e, top_k=k, capacity_factor=desc.capacity_factor)
        padding = e * slots / (routed * k)
    # Training FLOPs per token (forward and backward), split as the roles split them:
    # the head on every stage (SPMD), over the tensor ways; the routed experts over the
    # stages, scaled by their capacity padding; the rest over stages and tensor ways.
    head_flops = TRAINING_MULTIPLIER * 2.0 * desc.vocab_size * d
    routed_flops = TRAINING_MULTIPLIER * 2.0 * k * desc.expert_params * desc.moe_layers
    other_flops = (desc.flops_per_token() - routed_flops - head_flops
                   - _skipped_scores(desc, cand))
    tick_flops = n * ((other_flops + routed_flops * padding) / (s * tp) + head_flops / tp)
    compute = tick_flops * REMAT_RECOMPUTE[cand.remat] / t.flops_per_s
    sizes = tuple(v for _, v in lay._sizes())

    def group(*members: int) -> tuple[int, int]:
        return _span(sizes, members, t.devices_per_node)

    act = n * d * cb
    tensor = 0.0
    if tp > 1:
        g = group(_TP)
        # A dense layer's Megatron MLP all-reduces its output (and its transpose); an MoE
        # layer all-gathers its tensor ranks' tokens and reduce-scatters back (tokens),
        # or all-reduces the combined [n, d] partial sums forward and backward (ffn).
        dense_mlp = (_MEGATRON_MLP_ALL_REDUCES * _all_reduce(act, g, t) if desc.megatron_tp
                     else 0.0)
        moe_mlp = (_MEGATRON_MLP_ALL_REDUCES * _all_reduce(act, g, t) if etp > 1
                   else _MOE_TOKEN_SPLITS * _all_reduce(act, g, t, half=True))
        tensor = (layers * _TENSOR_ALL_REDUCES * _all_reduce(act, g, t)
                  + dense_layers * dense_mlp + moe_layers * moe_mlp
                  + _all_reduce(act, g, t))  # + the vocabulary-parallel embedding's
    context = 0.0
    if cp > 1:
        # One layer's K/V traffic over the context axes, by the config's cost model
        # (meshkit.plan.context_cost), each axis on the link its groups use.
        context = layers * context_seconds(
            lay.context_method, **_context_shape(desc, lay, t, batch=n * cp // desc.seq_len))
    exchange = 0.0
    if lay.expert > 1:
        size, nodes = group(3, 4)
        sub = cost.Topology(nodes, size // nodes, t.inter, t.intra, t.memory_bandwidth_Bps)
        method = "flat" if lay.exchange == "none" else lay.exchange
        exchange = moe_layers * _EXCHANGES_PER_LAYER * cost.predict(
            method, e * slots * d * cb, sub, top_k=k,
            nodes_per_token=dedup_nodes_per_token(
                routed, num_experts=e, nodes=nodes, top_k=k, max_nodes=desc.max_nodes,
                capacity_factor=desc.capacity_factor) if routed else 1.0)
    # One layer's weights as the device computes with them: full width (gathered over
    # fsdp), its tensor share of attention, and of the dense MLP, or the router, shared
    # experts and its experts (their tensor share under ffn).
    attn_w = desc.attention_params / tp * cb
    dense_w = desc.dense_mlp_params / (tp if desc.megatron_tp else 1) * cb
    routed_w = e * desc.expert_params / (lay.expert * etp) * cb if desc.is_moe else 0.0
    moe_w = (d * e + desc.num_shared_experts * desc.expert_params / etp) * cb + routed_w
    head_w = 2 * desc.vocab_size * d / tp * cb  # embedding and head, every stage
    stage_w = layers * attn_w + dense_layers * dense_w + moe_layers * moe_w
    weights = _WEIGHT_PASSES * (stage_w + head_w) / t.memory_bandwidth_Bps
    fsdp = 0.0
    if lay.weight_shards > 1:
        # The non-expert weights over the fsdp ways (and the expert ways where they are
        # fsdp too); the routed experts over the fsdp ways only. Transposed after the
        # gather (_FSDP_TRANSPOSES): the attention output and the MLP (dense or experts).
        out_w = desc.num_heads * desc.head_size * d / tp * cb
        if not lay.expert_fsdp:  # every weight over the fsdp ways
            fsdp = (_fsdp_time(dense_layers, attn_w + dense_w, out_w + dense_w, head_w,
                               group(2), t)
                    + _fsdp_time(moe_layers, attn_w + moe_w, out_w + routed_w, 0.0, group(2), t))
        else:
            shared = group(2, 3, 4)
            experts = routed_w if lay.fsdp > 1 else 0.0
            fsdp = (_fsdp_time(dense_layers, attn_w + dense_w, out_w + dense_w, head_w,
                               shared, t)
                    + _fsdp_time(moe_layers, attn_w + moe_w - routed_w, out_w, 0.0, shared, t)
                    + _fsdp_time(moe_layers, experts, experts, 0.0, group(2), t))
    pipeline = 0.0
    if s > 1:
        _, nodes = group(0)
        link = t.inter if nodes > 1 else t.intra
        pipeline = _PIPELINE_PERMUTES * (link.latency_s + act / link.bandwidth_Bps)
    v = cand.virtual_stages if cand.schedule == "interleaved" else 1
    # A tick of the interleaved schedule runs 1/v of the stage's layers and sends its
    # output on: the compute is the same per microbatch, the sends v times as many.
    pipeline *= v
    # fsdp inside the tick: a block's gathers are tied to its input, so every tick
    # (each microbatch, and each idle bubble tick, which computes on padding) gathers the
    # stage's weights again; no loop hoists them (see _FSDP_COLLECTIVES).
    tick = compute + weights + tensor + context + exchange + fsdp + pipeline
    bubble_ticks = (s - 1) / v
    pbytes = memory.terms["parameters"]
    expert_bytes = (desc.routed_params / (s * lay.expert * lay.fsdp * etp)
                    * DTYPE_BYTES[desc.param_dtype])
    dense_bytes = pbytes - expert_bytes
    # Gradients of weights replicated across devices, one all-reduce per optimizer step
    # (fsdp has reduce-scattered its share already): dense weights over the data and
    # expert ways (the data ways alone where the expert ways are fsdp too), expert
    # weights over the data and tensor ways (the data ways alone under ffn, where each
    # tensor rank holds its own slice).
    # The context ways hold every weight whole, as data ways do: they reduce too.
    gradients = (_all_reduce(dense_bytes, group(1, *_CP) if lay.expert_fsdp
                             else group(1, 3, 4, *_CP), t)
                 + _all_reduce(expert_bytes, group(1, *_CP, _TP) if etp == 1
                               else group(1, *_CP), t))
    ticks = accum * mb
    terms = {
        "compute": ticks * compute,
        "weights": ticks * weights,
        "tensor": ticks * tensor,
        "context": ticks * context,
        "exchange": ticks * exchange,
        "fsdp": ticks * fsdp,
        "pipeline": ticks * pipeline,
        "bubble": accum * bubble_ticks * tick,
        "gradients": gradients,
        "optimizer": _OPTIMIZER_PASSES * pbytes / t.memory_bandwidth_Bps,
    }
    return ModelPrediction(cand, terms, memory, desc.tokens)


def _predict_measured(desc: ModelDesc, m: Measured, cand: Candidate,
                      t: cost.Topology, memory: LayoutMemory) -> ModelPrediction:
    """:func:`predict_model` of a measured model (data and fsdp ways only: see
    :func:`model_rejection`): the same terms, counted from the measurement. Its fsdp
    gathers every fsdp-sharded weight and reduce-scatters its gradient, the three
    collectives of :data:`_FSDP_COLLECTIVES`, once per micro-step as a tick."""
    assert t.flops_per_s is not None
    lay, accum = cand.layout, cand.grad_accum
    cb, pb = DTYPE_BYTES[desc.compute_dtype], DTYPE_BYTES[desc.param_dtype]
    tokens = _device_sequences(desc, lay, accum) * desc.seq_len
    sizes = tuple(v for _, v in lay._sizes())

    def group(*members: int) -> tuple[int, int]:
        return _span(sizes, members, t.devices_per_node)

    compute = tokens * m.flops_per_token * REMAT_RECOMPUTE[cand.remat] / t.flops_per_s
    weights = _WEIGHT_PASSES * m.params * cb / t.memory_bandwidth_Bps
    fsdp = (_FSDP_COLLECTIVES * _all_reduce(m.fsdp_params * pb, group(2), t, half=True)
            if lay.fsdp > 1 else 0.0)
    pbytes = memory.terms["parameters"]
    terms = dict.fromkeys(TERMS, 0.0)
    terms.update(compute=accum * compute, weights=accum * weights, fsdp=accum * fsdp,
                 gradients=_all_reduce(pbytes, group(1), t),
                 optimizer=_OPTIMIZER_PASSES * pbytes / t.memory_bandwidth_Bps)
    return ModelPrediction(cand, terms, memory, desc.tokens)


def _fsdp_time(layers: int, layer_bytes: float, transposed_bytes: float, head_bytes: float,
               group: tuple[int, int], t: cost.Topology) -> float:
    """FSDP's time for one tick through ``layers`` layers: each layer's gathers and
    reduce-scatter (:data:`_FSDP_COLLECTIVES`) of its ``layer_bytes`` over the placed
    ``group``, the transposes (:data:`_FSDP_TRANSPOSES`, a read and a write each) of its
    ``transposed_bytes``, and the embedding and head's gather and reduce-scatter."""
    return (layers * (_FSDP_COLLECTIVES * _all_reduce(layer_bytes, group, t, half=True)
                      + _FSDP_TRANSPOSES * 2 * transposed_bytes / t.memory_bandwidth_Bps)
            + 2 * _all_reduce(head_bytes, group, t, half=True))


def runnable_rejection(desc: ModelDesc) -> Callable[[Candidate], str | None]:
    """The rule meshkit's config adds to a description's for ``--runnable``: dense
    layers ahead of MoE layers are not split into pipeline stages
    (``model.dense_layers`` with ``parallel.pipeline`` is refused).

    Args:
        desc: the model as meshkit builds it.

    Returns:
        A ``reject`` for :func:`plan_model`.

    Examples:
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=4, num_heads=4,
        ...               d_ff=128, num_experts=4, top_k=2, dense_layers=1, seq_len=16,
        ...               batch_size=8)
        >>> runnable_rejection(d)(Candidate(Layout(pipeline=2, data=4, microbatches=2)))
        'dense_layers'
    """
    def reject(cand: Candidate) -> str | None:
        return "dense_layers" if desc.is_moe and desc.dense_layers and (
            cand.layout.pipeline > 1) else None

    return reject


def runnable_choices() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The remat policies and pipeline schedules this meshkit's config can select.

    Before the memory issue's keys exist (``model.remat``, ``parallel.schedule``), only
    ``none`` and ``gpipe``; after, every listed policy and every schedule built
    (:data:`meshkit.choices.PIPELINE_SCHEDULES_BUILT`).

    Returns:
        ``(remat policies, schedules)``.

    Examples:
        >>> "none" in runnable_choices()[0]
        True
    """
    from meshkit.plan.verify import known_keys

    known = known_keys()
    return (REMAT_POLICIES if "model.remat" in known else ("none",),
            PIPELINE_SCHEDULES_BUILT if "parallel.schedule" in known else ("gpipe",))


def uncompiled(cand: Candidate) -> list[str]:
    """The candidate's choices ``--verify`` cannot pass to this meshkit's config.

    Args:
        cand: a candidate.

    Returns:
        Phrases such as ``"remat full (model.remat)"``; empty when all are compiled.

    Examples:
        >>> uncompiled(Candidate(Layout(data=8)))
        []
    """
    from meshkit.plan.verify import known_keys

    known = known_keys()
    out = []
    if cand.remat != "none" and "model.remat" not in known:
        out.append(f"remat {cand.remat} (model.remat)")
    if cand.attention != "xla" and "model.attention" not in known:
        out.append(f"attention {cand.attention} (model.attention)")
    if cand.layout.pipeline > 1 and cand.schedule != "gpipe" and (
            "parallel.schedule" not in known or cand.schedule not in PIPELINE_SCHEDULES_BUILT):
        out.append(f"schedule {cand.schedule} (parallel.schedule)")
    return out


def plan_model(desc: ModelDesc, *, devices: int, topology: cost.Topology,
               schedules: Sequence[str] = PIPELINE_SCHEDULES, keep_all: bool = False,
               remats: Sequence[str] | None = None,
               reject: Callable[[Candidate], str | None] | None = None,
               reject_layout: Callable[[Layout], str | None] | None = None,
               rules: str = "can split the model") -> list[ModelPrediction]:
    """Every valid candidate that fits, fastest first (numpy and the standard library
    only: no JAX).

    Args:
        desc: the model.
        devices: the device count.
        topology: the cluster of ``devices`` devices with ``flops_per_s``; candidates
            over ``memory_bytes`` are dropped.
        schedules: pipeline schedules tried.
        keep_all: keep candidates that do not fit too (ranked after those that do).
        remats: remat policies tried when the description leaves ``remat`` open
            (default: all).
        reject: more rules, checked before the description's own
            (:func:`model_rejection`): the key a candidate breaks, or ``None``
            (``meshkit plan CONFIG`` passes the config's, naming config keys).
        reject_layout: rules of the layout alone, checked before ``reject`` and once
            per layout (a rejected layout counts once per candidate it would have
            given); without ``reject``, the description's own layout rules
            (:func:`layout_rejection`) are checked once per layout too.
        rules: what the no-candidate message says the layouts failed.

    Returns:
        The ranked predictions.

    Raises:
        PlanError: no valid candidate (naming the field that rejected most), or none
            fits (naming the least memory any needs).
    """
    if topology.devices != devices:
        raise PlanError(f"--devices: {devices}, but the topology has {topology.devices}")
    if topology.flops_per_s is None:
        raise PlanError("--topology: the topology has no flops_per_s; use a preset or a "
                        "file written by meshkit calibrate")
    rejected: dict[str, int] = {}
    preds = []
    limit = topology.memory_bytes
    # More micro-steps only add fsdp gathers and bubbles to a step of the same compute:
    # once one fits, the larger counts of the same layout, remat and schedule are slower
    # and are not evaluated (unless keep_all).
    settled: set[tuple[Layout, str, str, int]] = set()
    least: tuple[LayoutMemory, Candidate] | None = None  # of those over the limit
    for lay in _layouts(desc, devices, topology.devices_per_node):
        # The rules of the layout alone first, once: a long sequence on many devices
        # has millions of candidates, most of them of layouts that split nothing.
        why = (reject_layout(lay) if reject_layout is not None else None) or (
            layout_rejection(desc, lay) if reject is None else None)
        pairs, some_remats, accums = _choices(desc, lay, schedules, remats)
        if why is not None:
            rejected[why] = rejected.get(why, 0) + len(pairs) * len(some_remats) * len(accums)
            continue
        if reject is None and desc.measured is None and desc.micro_batch_size is None:
            # The micro-steps the batch cannot split into, counted at once: each of
            # their candidates breaks the schedule's rule or else the batch's (the
            # order model_rejection checks them in).
            bad = [a for a in accums if _batch_breaks(desc, lay, a)]
            for sched, v in pairs:
                rule = "schedule" if _schedule_breaks(desc, lay, sched, v) else "batch_size"
                if bad:
                    rejected[rule] = rejected.get(rule, 0) + len(some_remats) * len(bad)
            accums = tuple(a for a in accums if a not in bad)
            if not keep_all and limit is not None:
                for group in _accumulation_groups(desc, lay, pairs, some_remats, accums):
                    why = model_rejection(desc, group[0])  # the same for every count
                    if why is not None:
                        rejected[why] = rejected.get(why, 0) + len(group)
                        continue
                    fit, over = _first_fit(desc, group, limit)
                    for memory, cand in over:
                        if least is None or memory.total < least[0].total:
                            least = memory, cand
                    if fit is not None:
                        preds.append(_finite(predict_model(desc, fit[1], topology,
                                                           memory=fit[0])))
                continue
        for cand in _expand(desc, lay, schedules, remats, accums):
            key = (cand.layout, cand.remat, cand.schedule, cand.virtual_stages)
            if key in settled:
                continue
            why = ((reject(cand) if reject is not None else None)
                   or model_rejection(desc, cand))
            if why is not None:
                rejected[why] = rejected.get(why, 0) + 1
                continue
            memory = candidate_memory(desc, cand)
            if not keep_all and limit is not None and memory.total > limit:
                # Over the device's memory: its step time is never shown, only the
                # least memory any candidate needs, when none fits.
                if least is None or memory.total < least[0].total:
                    least = memory, cand
                continue
            pred = _finite(predict_model(desc, cand, topology, memory=memory))
            preds.append(pred)
            if not keep_all and (limit is None or pred.memory.total <= limit):
                settled.add(key)
    if not preds and least is None:
        worst = max(rejected, key=lambda w: rejected[w]) if rejected else "model"
        raise PlanError(
            f"{worst}: no layout of {devices} devices {rules} "
            f"({sum(rejected.values())} rejected; by key: "
            + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items(), key=lambda i: -i[1]))
            + ")")
    fits = [p for p in preds if limit is None or p.memory.total <= limit]
    if not fits and not keep_all:
        assert limit is not None and least is not None
        raise PlanError(
            f"model: fits nowhere on {devices} devices ({desc.name}): the least memory any "
            f"layout needs is {format_bytes(least[0].total)} ({least[1].name()}), "
            f"the topology has {format_bytes(limit)} (memory_bytes)")
    fits.sort(key=lambda p: (p.predicted_step_s, p.memory.total))
    if keep_all:
        rest = sorted((p for p in preds if limit is not None and p.memory.total > limit),
                      key=lambda p: p.predicted_step_s)
        return fits + rest
    return fits


def _finite(pred: ModelPrediction) -> ModelPrediction:
    """``pred``, or a :class:`PlanError` where its step time is inf or NaN (ranking by
    NaN would print an arbitrary order as if it were a result)."""
    if not math.isfinite(pred.predicted_step_s):
        raise PlanError("--topology: predicted step times are not finite (inf or NaN): a "
                        "link, memory or FLOP/s figure is out of any physical range")
    return pred


def _accumulation_groups(desc: ModelDesc, lay: Layout, pairs: Sequence[tuple[str, int]],
                         remats: Sequence[str], accums: Sequence[int]
                         ) -> Iterator[list[Candidate]]:
    """A layout's candidates by (schedule, virtual stages, remat), each group its
    accumulation counts ascending (those the batch splits into)."""
    attention = desc.attention or "xla"
    for sched, v in pairs:
        for remat in remats:
            if accums:
                yield [Candidate(lay, remat, attention, a, sched, v) for a in accums]


def _first_fit(desc: ModelDesc, group: Sequence[Candidate], limit: int
               ) -> tuple[tuple[LayoutMemory, Candidate] | None,
                          list[tuple[LayoutMemory, Candidate]]]:
    """The fewest micro-steps of ``group`` that fit in ``limit`` bytes, found by
    bisection, and the candidates over the limit whose memory was needed for the least
    one: from two micro-steps on, a device's memory only falls as they grow (the
    accumulator is one parameter copy at any count, the activations a micro-step's), so
    the least of those over the limit is one micro-step's or the last over it.

    Returns:
        ``((memory, candidate) that fits, or None; [(memory, candidate) over the limit
        that may hold the least])``.
    """
    known: dict[int, LayoutMemory] = {}

    def mem(i: int) -> LayoutMemory:
        if i not in known:
            known[i] = candidate_memory(desc, group[i])
        return known[i]

    def pick(*indices: int) -> list[tuple[LayoutMemory, Candidate]]:
        return [(mem(i), group[i]) for i in sorted(set(indices)) if i >= 0]

    last = len(group) - 1
    if mem(0).total <= limit:
        return (mem(0), group[0]), []
    if last == 0 or mem(last).total > limit:
        return None, pick(0, last)
    lo, hi = 1, last  # mem(hi) fits; the first that fits is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if mem(mid).total <= limit:
            hi = mid
        else:
            lo = mid + 1
    return (mem(lo), group[lo]), pick(0, lo - 1)


def format_model_table(preds: Sequence[ModelPrediction]) -> str:
    """The ``meshkit plan --model`` table: one row a candidate, best first.

    Args:
        preds: ranked predictions.

    Returns:
        The table, with each candidate's overrides below it.
    """
    # As wide as the longest name (44 at least): context layouts' names run longer.
    w = max([44, *(len(p.candidate.name()) for p in preds)])
    lines = [f"{'#':>3} {'candidate':<{w}} {'step ms':>11} {'tokens/s':>12} {'memory':>10} "
             f"{'XLA':>10}  bottleneck"]
    for i, p in enumerate(preds, 1):
        share = p.terms[p.bottleneck] / p.predicted_step_s
        xla = format_bytes(p.verified_bytes) if p.verified_bytes is not None else "-"
        lines.append(f"{i:>3} {p.candidate.name():<{w}} {p.predicted_step_s * 1e3:>11.3f} "
                     f"{p.tokens_per_s:>12,.0f} {format_bytes(p.memory.total):>10} {xla:>10}  "
                     f"{p.bottleneck} ({share:.0%})")
        lines.append(f"    {' '.join(p.candidate.layout.overrides())}")
    return "\n".join(lines)


def _count(n: int) -> str:
    """A parameter count as people write it: 6.74B, 429,376."""
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M" if n >= 10**7 else f"{n:,}"


def to_json(preds: Sequence[ModelPrediction]) -> str:
    """The predictions as a JSON list, best first."""
    return json.dumps([p.to_json() for p in preds], indent=2)


@dataclasses.dataclass(frozen=True)
class ModelPlanReport:
    """What ``meshkit plan --model FILE`` found.

    Attributes:
        desc: the model.
        ranked: every candidate that fits by the prediction, best first (verified ones
            reordered: see :func:`meshkit.plan.verify.verify_plan`).
        shown: the best ``top``.
        topology: the cluster.
        verified: how many were compiled.
        measured: the model measured as meshkit builds it (``--measure``), or ``None``.
        compiled_as: what ``--verify`` compiled in place of the description (its
            :meth:`~meshkit.plan.model_desc.ModelDesc.differences`; none for a config,
            whose own model is compiled).
        written: the config file ``--write`` wrote for the best layout, or ``None``.
    """

    desc: ModelDesc
    ranked: list[ModelPrediction]
    shown: list[ModelPrediction]
    topology: cost.Topology
    verified: int = 0
    measured: MeasuredModel | None = None
    compiled_as: tuple[str, ...] = ()
    written: str | None = None

    def text(self) -> str:
        """The table, a line naming the model and cluster first."""
        t = self.topology
        head = (f"{self.desc.name}: {_count(self.desc.params)} parameters, "
                f"{self.desc.tokens:,} tokens a step; {len(self.ranked)} layouts fit on "
                f"{t.nodes} node(s) × {t.devices_per_node} devices, "
                f"{(t.flops_per_s or 0) / 1e12:.3g} TFLOP/s and "
                + (format_bytes(t.memory_bytes) if t.memory_bytes else "unknown memory")
                + f" per device; the best {len(self.shown)}:")
        lines = [head, format_model_table(self.shown)]
        limit = t.memory_bytes
        over = [p for p in self.ranked[:self.verified] if p.verified_bytes is not None
                and limit is not None and p.verified_bytes > limit]
        for p in over:
            lines.append(f"  ✗ {p.candidate.name()}: XLA needs "
                         f"{format_bytes(p.verified_bytes or 0)}, over the "
                         f"{format_bytes(limit or 0)} a device has")
        if self.verified and self.compiled_as:
            lines.append("  verified as meshkit builds it: " + "; ".join(self.compiled_as))
        if self.measured is not None:
            m, built = self.measured, self.desc.buildable()
            per_token = m.flops_per_token(built.num_layers)
            lines.append(
                f"  measured as meshkit builds it: {m.params:,} parameters (jax.eval_shape; "
                f"formula {built.params:,}), {per_token:.4g} FLOP a training token "
                f"(XLA's cost analysis of 2 and 3 compiled layers; formula "
                f"{built.flops_per_token():.4g}, without capacity padding, softmax and "
                f"optimizer: {per_token / built.flops_per_token():.2f}x)")
        if self.verified:
            missing = sorted({w for p in self.ranked[:self.verified]
                              for w in uncompiled(p.candidate)})
            if missing:
                lines.append("  compiled without " + ", ".join(missing) + " (not built in "
                             "this meshkit yet): XLA's figure is the step without them; "
                             "compare it with compiled_predicted_memory_bytes (--json)")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The shown candidates as JSON, best first."""
        limit = self.topology.memory_bytes
        rows = []
        for p in self.shown:
            row = p.to_json()
            if p.verified_bytes is not None:
                row["verified_fits"] = limit is None or p.verified_bytes <= limit
            rows.append(row)
        return json.dumps(rows, indent=2)


def run_model_plan(model_path: str, *, devices: int | None, topology: str | None = None,
                   preset: str | None = None, nodes: int | None = None, top: int = 5,
                   verify: int | None = None, extrapolate: bool = False,
                   runnable: bool = False,
                   measure: Callable[[ModelDesc], MeasuredModel] | None = None,
                   progress: Callable[[str], None] | None = None) -> ModelPlanReport:
    """``meshkit plan --model FILE``: rank candidates; ``--verify K`` compiles the best K.

    Args:
        model_path: the model description file.
        devices, topology, preset, nodes: the cluster (as ``meshkit plan``).
        top: rows shown.
        verify: compile this many of the best candidates (``None``: none).
        extrapolate: compile few layers and extrapolate (``--verify-extrapolate``).
        runnable: the model as meshkit builds it (:meth:`ModelDesc.buildable`) with only
            the remat policies and schedules this meshkit can select
            (:func:`runnable_choices`; ``--runnable``), so ``--verify`` compiles exactly
            the candidate.
        measure: also measure the model as meshkit builds it with this function
            (``--measure`` passes :func:`meshkit.training.measured.measure_model`, which
            imports JAX and compiles 2 steps on one device of this process; the planner,
            a layer below the training step, takes it as an argument).
        progress: progress lines of the compiles.

    Returns:
        The :class:`ModelPlanReport`.

    Raises:
        PlanError: bad flags, nothing valid or nothing that fits.
        ModelDescError: a bad model file.
        VerifyError: a bad ``--verify`` count or a device count beyond the host's.
    """
    from meshkit.plan.model_desc import load_model_desc
    from meshkit.plan.planner import resolve_topology
    from meshkit.plan.verify import check_simulated, verify_plan

    if isinstance(top, bool) or top < 1:
        raise PlanError(f"--top: must be a positive integer, got {top!r}")
    desc = load_model_desc(model_path)
    sized = resolve_topology(devices=devices, topology=topology, preset=preset, nodes=nodes)
    if verify is not None:
        check_simulated(sized.devices)  # before the ranking, not after it
    if runnable:  # meshkit's own model and choices: what it can train and compile today
        remats, schedules = runnable_choices()
        desc = desc.buildable()
        rule = runnable_rejection(desc)
        ranked = plan_model(desc, devices=sized.devices, topology=sized,
                            schedules=schedules, remats=remats,
                            reject_layout=lambda lay: (rule(Candidate(lay))
                                                       or layout_rejection(desc, lay)))
    else:
        ranked = plan_model(desc, devices=sized.devices, topology=sized)
    if verify is not None:
        ranked = verify_plan(desc, ranked, devices=sized.devices, count=verify,
                             memory_bytes=sized.memory_bytes, extrapolate=extrapolate,
                             progress=progress)
    measured = None
    if measure is not None:
        if progress is not None:
            progress("measure: compiling 2 and 3 layers on one device ...")
        measured = measure(desc)
    return ModelPlanReport(desc, ranked, ranked[:max(top, verify or 0)], sized,
                           verified=verify or 0, measured=measured,
                           compiled_as=tuple(desc.differences()))
