"""One device's memory of a training step, fitted to XLA's own analysis (numpy only).

:func:`layout_memory` splits a step's bytes into terms, each a count the layout fixes
(parameters held, tokens per device, scores, expert slots, logits) times a coefficient.
The parameters, AdamW moments and the accumulation buffer are exact counts (coefficient
1): they are XLA's argument bytes, exactly. The rest is XLA's temp, and the temp is the
peak of a step that frees as it goes, so the fitted terms are live in phases
(:data:`TERM_PHASE`): what the forward pass keeps for the backward pass, plus either the
loss's backward pass (the logits) or one layer's (a scanned layer's working set, the
residuals remat or 1F1B recompute); or the optimizer update, once the residuals are
freed. The step's bytes are the exact terms plus its largest phase (:data:`PHASES`).

The coefficients live in one place, :data:`FIT`, fitted by :func:`fit_terms` to what XLA
allocates for meshkit's compiled step (argument + temp + output − alias of
``compile_step(...).memory_analysis()``), as measured by ``meshkit bench plan_memory``
(:mod:`meshkit.benchmarks.bench_plan_memory`, from a source checkout) and stored in
``tests/plan/xla_memory.json``. When the compiled step changes (fsdp's regather, uneven
stages, schedules), re-measure and re-fit in one command (it compiles every case, stores
XLA's bytes, fits and writes the terms into :data:`FIT`)::

    meshkit bench plan_memory --write --fit --apply

(``--held-out`` prints each point's ratio refitted without its case, and without its
model, beside the in-sample one.) The fit is a minimax over the stored cases, every case
weighing the same: 0.87–1.13 of XLA on all 65 stored points (42 within 0.9–1.1); the
shares within a term (:data:`REMAT_FACTORS`, :data:`ATTENTION_FACTORS`) are estimates.

Examples:
    >>> from meshkit.plan.model_desc import ModelDesc
    >>> from meshkit.plan.planner import Layout
    >>> desc = ModelDesc(name="t", vocab_size=256, d_model=256, num_layers=4, num_heads=4,
    ...                  d_ff=512, num_experts=8, top_k=2, seq_len=64, batch_size=32)
    >>> m = layout_memory(desc, Layout(data=8))
    >>> m.terms["parameters"] == m.params * 4, m.total > m.state
    (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshkit.exchange.capacity import capacity as _capacity
from meshkit.plan.context_cost import context_bytes
from meshkit.plan.model_desc import DTYPE_BYTES, Measured, ModelDesc, default_attention_chunk
from meshkit.plan.planner import Layout


@functools.lru_cache(maxsize=65536)
def capacity(tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """:func:`meshkit.exchange.capacity.capacity`, cached: the planner asks for the same
    few token counts across thousands of candidates, and each call does exact
    fraction arithmetic.

    Examples:
        >>> capacity(64, num_experts=8, top_k=2, capacity_factor=1.25)
        20
    """
    return _capacity(tokens, num_experts=num_experts, top_k=top_k,
                     capacity_factor=capacity_factor)


__all__ = [
    "ATTENTION_FACTORS",
    "FIT",
    "FITTED",
    "PHASES",
    "REMAT_FACTORS",
    "SCHEDULE_STASH",
    "TERM_PHASE",
    "Case",
    "LayoutMemory",
    "capacity",
    "default_attention_chunk",
    "expert_tp",
    "features",
    "fit_terms",
    "layout_memory",
    "predict_case",
    "stored_points",
]

#: The phase each fitted term is live in (see :data:`PHASES`).
TERM_PHASE: dict[str, str] = {
    # Held from the forward pass through the backward pass: live in both "loss" and "layer".
    "gradients": "kept",  # float32 gradients, accumulated as the backward pass runs
    "pipeline_gradients": "kept",  # a pipeline's gradients summed per microbatch
    "regathered_weights": "kept",  # fsdp: the layer in flight's gathered weights
    "vocab_weights": "kept",  # fsdp: the embedding and head gathered, and their gradients
    "activations": "kept",  # full-width residuals kept per layer, in [tokens, d_model]
    # The residuals split by heads over the tensor ways ([tokens, d_model / tensor]: the
    # queries, keys, values and attention outputs), apart from the full-width ones: the
    # default model's ep2 tp4 keeps about four [tokens, d_model] buffers a layer, not the
    # ten or so a layout without tensor ways keeps (charged 1.18× XLA with one term).
    "head_activations": "kept",
    "block_inputs": "kept",  # block (1F1B: stage) inputs kept where the rest is recomputed
    "mlp_hidden": "kept",  # the MLP's (or experts') hidden states kept
    "expert_buffers": "kept",  # MoE dispatch buffers [E, C, d] kept
    # The combine's gathered expert outputs [tokens, k, d], float32 (the router's
    # weights are), and its drop mask: per routed token and choice, not per slot.
    "combine": "kept",
    "softmax": "kept",  # attention score elements kept per layer, at the compute dtype
    "score_upcast": "kept",  # their float32 copies under bfloat16 (none at float32)
    "fixed": "kept",  # per MiB
    # Unrolled (no scan, no pipeline): the residual copies XLA keeps beyond a scan's, for
    # every layer (a scan's partial evaluation saves the matmul outputs; unrolled, XLA:CPU
    # keeps the elementwise results too: the default model's ep2x4 holds five
    # [E·C, d_ff] expert-hidden copies a layer, not two, and the bench_parallel "act"
    # model's dp8 three [b, h, T, T] score copies). Its peak is at the loss or the last
    # layer's backward pass, every layer's residuals still live and a small working set.
    "unrolled": "kept",
    "unrolled_softmax": "kept",  # the scores' extra copies (at the compute dtype)
    # The loss's backward pass: the logits and their gradient, freed before the layers'.
    "logits": "loss",
    # One layer's backward pass (the scanned or recomputed layer in flight), without a
    # pipeline. The layer in flight's residuals, live in buffers of its own: a scanned
    # layer's sliced out of the stack, or recomputed (remat). Its [tokens, d_model]
    # activations and its hidden states, dispatch buffers and combine apart: the buffer
    # dumps show some ten [tokens, d_model] buffers in flight (the default model's dp4
    # fsdp2 backward body twelve, bench_parallel's fsdp8 eight) but one copy of the
    # hidden states and buffers (two [E·C/2, d_ff] hidden slices, two [E, C, d] buffers),
    # which one coefficient for both charged some three times.
    "in_flight": "layer",
    "in_flight_hidden": "layer",
    "in_flight_softmax": "layer",  # the scores among them (at the compute dtype)
    "in_flight_upcast": "layer",  # their float32 copy where the compute dtype is lower
    # A pipeline's backward tick: one microbatch's stage (GPipe sliced out of the tick
    # loop's stack, 1F1B recomputed), a working set of another shape than a scanned
    # layer's, with a coefficient of its own.
    "tick": "layer",
    "tick_softmax": "layer",  # the scores among them (at the compute dtype)
    # A float32 copy of the scanned layers' kept residuals (activations, hidden, buffers)
    # where the compute dtype is lower: XLA hoists the backward loop's upcasts of its
    # inputs out of the loop, whole stacks at once, live through the backward pass.
    "kept_f32": "layer",
    # Context attention's K/V beyond the device's own, for the layer in flight
    # (meshkit.plan.context_cost.context_bytes): all_gather the whole sequence's, the
    # ring two blocks and their gradients.
    "context_kv": "layer",
    # The optimizer update, after the backward pass freed the residuals.
    "update": "update",  # the gradients and the update's float32 temporaries
}
#: The step's phases: its temp bytes are the largest phase's (kept + loss, kept + layer,
#: update), not the sum of every term, since XLA reuses what one phase frees.
PHASES: dict[str, tuple[str, ...]] = {"loss": ("kept", "loss"), "layer": ("kept", "layer"),
                                      "update": ("update",)}
# Each fitted term's phases (those of PHASES its TERM_PHASE group is in).
_TERM_PHASES: dict[str, tuple[str, ...]] = {
    term: tuple(name for name, groups in PHASES.items() if group in groups)
    for term, group in TERM_PHASE.items()}
#: The fitted terms: bytes = coefficient × count, the counts of :func:`features` (what
#: each counts: :data:`TERM_PHASE`). Fitted by ``meshkit bench plan_memory --fit``
#: to ``tests/plan/xla_memory.json``.
FIT: dict[str, float] = {
    "gradients": 1.0, "pipeline_gradients": 0.325, "regathered_weights": 1.71,
    "vocab_weights": 1.05, "activations": 4.53, "head_activations": 6.3,
    "block_inputs": 2.65, "mlp_hidden": 1.0, "expert_buffers": 1.25, "combine": 1.04,
    "softmax": 0.831, "score_upcast": 1.01, "fixed": 0.0, "unrolled": 0.0,
    "unrolled_softmax": 0.985, "logits": 2.29, "in_flight": 17.2, "in_flight_hidden": 1.0,
    "in_flight_softmax": 1.32, "in_flight_upcast": 1.65, "tick": 3.0, "tick_softmax": 0.0,
    "kept_f32": 0.0, "update": 1.0, "context_kv": 1.0,
}
#: The terms :data:`FIT` holds, in the order :func:`features` returns them.
FITTED: tuple[str, ...] = tuple(TERM_PHASE)
#: Per remat policy, the share of each residual term kept for the backward pass (the
#: rest is recomputed, one layer at a time: the ``recompute`` terms). Not fitted: estimates.
REMAT_FACTORS: dict[str, dict[str, float]] = {
    "none": {"activations": 1.0, "mlp_hidden": 1.0, "expert_buffers": 1.0, "softmax": 1.0,
             "score_upcast": 1.0},
    # Matmul outputs kept (projections, MLP hidden, scores); elementwise recomputed.
    "save_dots": {"activations": 0.5, "mlp_hidden": 0.67, "expert_buffers": 1.0,
                  "softmax": 0.5, "score_upcast": 0.0},  # a cast is not a dot
    "full": {"activations": 0.0, "mlp_hidden": 0.0, "expert_buffers": 0.0, "softmax": 0.0,
             "score_upcast": 0.0},
}
#: Attention kinds: the scores' size relative to materialised ``[T, T]`` scores, as a
#: function of the sequence length (``chunked``: blocks of ``attention_chunk`` keys, by
#: default the config's, :func:`default_attention_chunk`, none kept: its backward pass
#: recomputes them block by block; ``dot_product``: a fused kernel on GPU, the XLA path
#: on CPU, counted as the GPU's).
ATTENTION_FACTORS: dict[str, float] = {"xla": 1.0, "dot_product": 0.0, "chunked": 0.0}
#: Pipeline schedules: how many microbatches' residuals a stage keeps, given S stages,
#: M microbatches and v virtual stages (GPipe in SPMD: every tick's, M + S − 1; 1F1B
#: only stage inputs, recomputing one microbatch's stage for its backward tick;
#: interleaved, differentiated as GPipe is, every one of its v·M + S − 1 ticks of 1/v of
#: the stage's layers, each chunk checkpointed).
SCHEDULE_STASH: dict[str, str] = {"gpipe": "M + S - 1", "1f1b": "1 (recomputed)",
                                  "interleaved": "(v·M + S - 1) / v"}


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
    """One device's bytes of a step, term by term.

    Attributes:
        params: parameter elements the device holds.
        terms: bytes per term, the exact ones (``parameters``, ``optimizer``,
            ``accumulator``, ``batch``) and the fitted ones (:data:`FITTED`); the fitted
            ones are live in different phases (:data:`TERM_PHASE`), so they do not sum.
    """

    params: int
    terms: dict[str, float]

    @property
    def state(self) -> float:
        """Parameters and optimizer moments."""
        return self.terms["parameters"] + self.terms["optimizer"]

    @functools.cached_property
    def phases(self) -> dict[str, float]:
        """Each phase's fitted bytes (:data:`PHASES`)."""
        out = dict.fromkeys(PHASES, 0.0)
        for k, v in self.terms.items():  # one pass: the planner asks for thousands
            for name in _TERM_PHASES.get(k, ()):
                out[name] += v
        return out

    @property
    def peak_phase(self) -> str:
        """The phase that sets the peak."""
        phases = self.phases
        return max(phases, key=lambda name: phases[name])

    @functools.cached_property
    def total(self) -> int:
        """The exact terms plus the largest phase (the ranking reads it many times)."""
        exact = sum(v for k, v in self.terms.items() if k not in TERM_PHASE)
        return int(exact + max(self.phases.values()))


def expert_tp(desc: ModelDesc, lay: Layout) -> int:
    """The tensor ways that split each expert's hidden width: all of them under
    ``moe_tensor: ffn`` (routed and shared experts alike), else none.

    Examples:
        >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
        ...               d_ff=128, num_experts=8, top_k=2, seq_len=64, batch_size=32)
        >>> expert_tp(d, Layout(tensor=4, moe_tensor="ffn")), expert_tp(d, Layout(tensor=4))
        (4, 1)
    """
    return lay.tensor if desc.is_moe and lay.ffn_split else 1


def _stage_params(desc: ModelDesc, lay: Layout) -> float:
    """Parameter elements one device holds, split as meshkit's rules split them: heads,
    MLP width and vocabulary over tensor ways (each expert's width too under ``ffn``),
    the width over fsdp (and over the expert ways where they are fsdp too), routed
    experts over expert ways, layers over the pipeline; norms replicated."""
    d, tp, f, s = desc.d_model, lay.tensor, lay.fsdp, lay.pipeline
    w = lay.weight_shards  # a non-expert weight's shards on the model width
    etp = expert_tp(desc, lay)
    # Uneven stages hold ceil(layers / S) blocks at most: the largest stage bounds memory.
    moe_l = math.ceil(desc.moe_layers / s)
    dense_l = math.ceil(desc.num_layers / s) - moe_l
    attn = desc.attention_params / (tp * w) + 2 * d
    ffn_tp = tp if desc.megatron_tp else 1
    dense = dense_l * (attn + desc.dense_mlp_params / (ffn_tp * w))
    moe = moe_l * (attn + d * desc.num_experts / w
                   + desc.num_shared_experts * desc.expert_params / (w * etp)
                   + desc.num_experts * desc.expert_params / (lay.expert * f * etp))
    embed = desc.vocab_size * d * (1 if desc.tie_embeddings else 2) / (tp * w) + d
    return dense + moe + embed


def features(desc: ModelDesc, lay: Layout, *, grad_accum: int = 1, remat: str = "none",
             attention: str = "xla", schedule: str = "gpipe", virtual_stages: int = 1
             ) -> tuple[float, dict[str, float], dict[str, float]]:
    """The counts behind :func:`layout_memory`.

    Args:
        desc: the model and batch.
        lay: the layout.
        grad_accum: micro-steps per optimizer step.
        remat, attention, schedule: the step's choices.
        virtual_stages: ``interleaved``'s chunks per stage (else ignored).

    Returns:
        ``(parameter elements, exact terms in bytes, fitted terms' counts in bytes)``.
    """
    pb, cb, ob = (DTYPE_BYTES[desc.param_dtype], DTYPE_BYTES[desc.compute_dtype],
                  DTYPE_BYTES[desc.optimizer_dtype])
    s, tp, m = lay.pipeline, lay.tensor, lay.microbatches
    params = _stage_params(desc, lay)
    seqs = desc.batch_size / (grad_accum * lay.batch_ways)  # per device per micro-step
    cp = lay.context
    local_len = desc.seq_len / cp  # the device's share of each sequence
    tokens = seqs * local_len
    mb_tokens = tokens / m  # one microbatch
    layers = math.ceil(desc.num_layers / s)  # the largest stage
    moe_layers = min(math.ceil(desc.moe_layers / s), layers)
    ffn_tp = tp if desc.megatron_tp else 1
    etp = expert_tp(desc, lay)
    # Tokens one device routes per microbatch: its tensor rank's slice (tokens), or all
    # of them with 1/tp of each expert's width (ffn).
    routed = mb_tokens / tp if etp == 1 else mb_tokens
    # The stage's residuals for one microbatch, per kind (bytes).
    if desc.is_moe:
        slots = (capacity(int(routed), num_experts=desc.num_experts, top_k=desc.top_k,
                          capacity_factor=desc.capacity_factor) if routed >= 1 else 0)
        # [E, C, d] dispatched; after the exchange a device holds E/X experts × X·C rows:
        # the same E·C slots, whatever the expert ways.
        buffers: float = moe_layers * desc.num_experts * slots * desc.d_model * cb
        combine = moe_layers * routed * desc.top_k * desc.d_model * 4.0
        hidden: float = (moe_layers * desc.num_experts * slots * (desc.expert_mats - 1)
                         * desc.ff_expert / etp * cb)
        # The shared experts run on the tokens the device routes.
        hidden += moe_layers * routed * desc.num_shared_experts * desc.ff_expert / etp \
            * (desc.expert_mats - 1) * cb
    else:
        buffers, hidden, combine = 0.0, 0.0, 0.0
    hidden += (layers - moe_layers) * mb_tokens * desc.d_ff / tp * (desc.mlp_mats - 1) * cb
    scale = ATTENTION_FACTORS[attention]
    if attention == "chunked":
        scale = float(desc.attention_chunk or default_attention_chunk())
    # The keys a query's scores span: the whole sequence, materialised (xla; under
    # all_gather and Ulysses too, whose queries see every key), one block of the ring
    # (a local block at a time), or a chunk (chunked).
    keys = local_len if lay.context_method == "ring" else desc.seq_len
    score_len = keys if scale == 1.0 else min(scale, keys)
    scores = layers * seqs / m * desc.num_heads / tp * local_len * score_len  # elements
    stage = {"activations": layers * mb_tokens * desc.d_model * cb, "mlp_hidden": hidden,
             # The scores at the compute dtype; below float32 the softmax's copies are
             # float32 (DeepSeek-V2-Lite's kept scores are all float32; a float32
             # model keeps 3 copies, a bfloat16 one 2 float32 copies' bytes).
             "expert_buffers": buffers, "softmax": scores * cb,
             "score_upcast": scores * 4 if cb < 4 else 0.0}
    interleaved = s > 1 and schedule == "interleaved"
    v = virtual_stages if interleaved else 1
    # The interleaved schedule checkpoints each chunk (meshkit.model.transformer): without
    # remat it keeps the matmul outputs only, as save_dots does, and the chunk's inputs.
    keep = dict(REMAT_FACTORS["save_dots" if interleaved and remat == "none" else remat])
    if interleaved and remat == "none":
        # ... but the scores whole, as the float32 dot output: Mixtral-8x7B's interleaved
        # v8 at 2,048 devices keeps f32[ticks, 1, heads, T, T] (17 GiB), not half of
        # them at bfloat16 (7 GiB charged, 0.73 of XLA).
        keep["softmax"], keep["score_upcast"] = (0.0 if cb < 4 else 1.0), 1.0
    if attention == "chunked" or lay.context_method in ("ring", "hierarchical"):
        # Its backward recomputes each block's scores (the ring's custom VJP too).
        keep["softmax"] = keep["score_upcast"] = 0.0
    keep["combine"] = keep["expert_buffers"]  # kept as the dispatch buffers are
    one_f = s > 1 and schedule == "1f1b"
    # Microbatch-stage residual sets kept from the forward to the backward pass: GPipe in
    # SPMD every tick's (M + S − 1, the bubble's included: idle stages compute on
    # padding), no pipeline the whole batch, 1F1B none (it keeps the stage inputs and
    # recomputes one microbatch's stage at its backward tick), interleaved its
    # v·M + S − 1 ticks' of 1/v of the stage each.
    sets = (0.0 if one_f else (v * m + s - 1) / v if s > 1 else float(m))
    # The layer in flight's residuals, in buffers of its own: layers run as a scan (remat
    # or fsdp) slice the kept ones out of the stack or recompute them (one layer's); a
    # pipeline's ticks are a scan too, so its backward tick holds one microbatch's stage
    # (GPipe sliced out, 1F1B recomputed, as the remat policy keeps it). Unrolled, a
    # layer's backward pass reuses the space its freed residuals held.
    scanned = lay.weight_shards > 1 or remat != "none"
    unrolled = not scanned and s == 1
    # 1F1B under a remat policy keeps what the policy saves for every microbatch whose
    # backward tick is still to come, up to S of them (one_f_one_b's stashed vjps):
    # BLOOM's save_dots 1F1B at 3 stages was 0.61 of XLA with one.
    # Those are residuals kept as the forward pass's are (the kept terms, ``stashed`` sets
    # of them); the layer in flight is then one layer's, recomputed as under a scan.
    stashed = float(min(s, m)) if one_f and remat != "none" else 0.0
    in_flight = {k: v / max(layers, 1) if stashed or (s == 1 and scanned)
                 else v * keep[k] + v / max(layers, 1) * (1 - keep[k]) if s > 1
                 else 0.0 for k, v in {**stage, "combine": combine}.items()}
    # Block (or stage) inputs kept where the rest is recomputed.
    inputs = stage["activations"] * max(sets, 1) if remat != "none" else 0.0
    if one_f:
        # Its M microbatches' stage inputs, and float32 buffers of the same shape (their
        # copy and cotangents) where the compute dtype is lower: DeepSeek-V3's 1F1B at
        # 2,048 devices keeps bf16[M, 1, T, d] beside f32[M, 1, T, d] ones. Counted at
        # float32, the bfloat16 and float32 models share the coefficient.
        inputs += m * stage["activations"] / max(layers, 1) * 4 / cb
    if interleaved and remat == "none":  # one microbatch's chunk input per tick
        inputs += (v * m + s - 1) * stage["activations"] / max(layers, 1)
    # One layer's weights as gathered over fsdp: at the parameters' dtype (the cast to the
    # compute dtype comes after the gather, and the weights' gradient is float32 too).
    # The experts are gathered over the fsdp ways only (never over expert ways).
    layer_w = (desc.attention_params / tp + desc.dense_mlp_params / ffn_tp * (moe_layers == 0)
               + (desc.num_experts * desc.expert_params / lay.expert * (lay.fsdp > 1)
                  + desc.num_shared_experts * desc.expert_params) / etp
               * (moe_layers > 0)) * pb
    fitted = {
        "gradients": params * pb,
        # A pipelined step sums each microbatch's gradients inside its loop: a second copy.
        "pipeline_gradients": params * pb if s > 1 else 0.0,
        # fsdp regathers each layer's weights for its backward pass: one layer's live,
        # under every schedule (the block ties its weights to its input, so no loop
        # hoists a stage's gathers out of its ticks).
        "regathered_weights": layer_w if lay.weight_shards > 1 else 0.0,
        # fsdp gathers the embedding and the head whole (over the tensor ways still
        # split) on every stage, and their gradients are whole until the reduce-scatter:
        # at a 250,680-token vocabulary (BLOOM) tens of GiB no layer count grows.
        "vocab_weights": (desc.vocab_size * desc.d_model * (1 if desc.tie_embeddings else 2)
                          / tp * pb if lay.weight_shards > 1 else 0.0),
        "activations": stage["activations"] * keep["activations"] * (sets + stashed),
        "head_activations": stage["activations"] / tp * keep["activations"] * (sets + stashed),
        "block_inputs": inputs,
        "mlp_hidden": stage["mlp_hidden"] * keep["mlp_hidden"] * (sets + stashed),
        "expert_buffers": stage["expert_buffers"] * keep["expert_buffers"] * (sets + stashed),
        "combine": combine * keep["expert_buffers"] * (sets + stashed),
        "softmax": stage["softmax"] * keep["softmax"] * (sets + stashed),
        "score_upcast": stage["score_upcast"] * keep["score_upcast"] * (sets + stashed),
        "fixed": 2.0**20,
        # float32 for the softmax, the whole micro-step's (1F1B: a microbatch's, at the
        # last stage's tick). meshkit's loss holds whole rows on each tensor rank; a
        # Megatron vocab-parallel loss keeps them split.
        "logits": (mb_tokens if one_f else tokens) * desc.vocab_size / ffn_tp * 4,
        # The combine's [tokens, k, d] float32 among them: DeepSeek-V3's 1F1B stage
        # recomputed at 2,048 devices holds f32[layers, T, k, d].
        "in_flight": in_flight["activations"] if s == 1 else 0.0,
        "in_flight_hidden": (in_flight["mlp_hidden"] + in_flight["expert_buffers"]
                             + in_flight["combine"]) if s == 1 else 0.0,
        "tick": (in_flight["activations"] + in_flight["mlp_hidden"]
                 + in_flight["expert_buffers"] + in_flight["combine"]) if s > 1 else 0.0,
        "in_flight_softmax": in_flight["softmax"] if s == 1 else 0.0,
        "tick_softmax": in_flight["softmax"] if s > 1 else 0.0,
        "in_flight_upcast": in_flight["score_upcast"],
        "kept_f32": ((stage["activations"] * keep["activations"] + stage["mlp_hidden"]
                      * keep["mlp_hidden"] + stage["expert_buffers"] * keep["expert_buffers"])
                     * (sets + stashed) * 4 / cb if scanned and cb < 4 else 0.0),
        "unrolled": (0.0 if not unrolled else
                     (stage["activations"] + stage["mlp_hidden"] + stage["expert_buffers"])
                     * sets),
        "unrolled_softmax": stage["softmax"] * sets if unrolled else 0.0,
        "context_kv": _context_kv(desc, lay, mb_tokens, cb),
        "update": params * pb,
    }
    exact = {
        "parameters": params * pb,
        # ZeRO-1 keeps 1/data of the moments (the replicated part; fsdp has split them).
        "optimizer": 2 * params * ob / (lay.data if desc.zero1 else 1),
        "accumulator": params * pb if grad_accum > 1 else 0.0,
        "batch": seqs * (local_len + 1) * 4,
    }
    return params, exact, fitted


def _context_kv(desc: ModelDesc, lay: Layout, mb_tokens: float, cb: int) -> float:
    """:func:`meshkit.plan.context_cost.context_bytes` of one microbatch's layer."""
    if lay.context == 1:
        return 0.0
    hd = desc.head_size
    kv = 2 * mb_tokens * max(desc.kv_heads // lay.tensor, 1) * hd * cb
    q = mb_tokens * desc.num_heads / lay.tensor * hd * cb
    return float(context_bytes(lay.context_method, kv=kv, q=q, ways=lay.context))


def layout_memory(desc: ModelDesc, lay: Layout, *, grad_accum: int = 1, remat: str = "none",
                  attention: str = "xla", schedule: str = "gpipe", virtual_stages: int = 1,
                  fit: dict[str, float] | None = None) -> LayoutMemory:
    """One device's bytes of a training step: exact terms plus the fitted ones.

    Args:
        desc: the model and batch.
        lay: the layout.
        grad_accum: micro-steps per optimizer step (activations are a micro-step's).
        remat: a remat policy (:data:`meshkit.choices.REMAT_POLICIES`).
        attention: an attention kind (:data:`meshkit.choices.ATTENTION_KINDS`).
        schedule: a pipeline schedule (:data:`meshkit.choices.PIPELINE_SCHEDULES`).
        virtual_stages: ``interleaved``'s chunks per stage (``parallel.virtual_stages``).
        fit: coefficients (default :data:`FIT`).

    Returns:
        The :class:`LayoutMemory`.
    """
    if desc.measured is not None:
        return _measured_memory(desc, desc.measured, lay, grad_accum=grad_accum)
    coef = FIT if fit is None else fit
    params, exact, counts = features(desc, lay, grad_accum=grad_accum, remat=remat,
                                     attention=attention, schedule=schedule,
                                     virtual_stages=virtual_stages)
    terms = {**exact, **{k: coef[k] * v for k, v in counts.items()}}
    return LayoutMemory(int(params), terms)


def _measured_memory(desc: ModelDesc, m: Measured, lay: Layout, *, grad_accum: int
                     ) -> LayoutMemory:
    """A measured model's bytes (:class:`meshkit.plan.model_desc.Measured`), from its own
    one-device step as the fit's terms are from meshkit's: the parameters a device holds
    (the fsdp-sharded ones split) times the step's bytes per parameter, the tokens it
    runs times its bytes per token, and under fsdp one full-width copy of the
    fsdp-sharded weights (gathered for the matmuls; XLA keeps them for the backward
    pass where nothing regathers them). Data and fsdp ways only."""
    pb, ob = DTYPE_BYTES[desc.param_dtype], DTYPE_BYTES[desc.optimizer_dtype]
    held = m.params - m.fsdp_params + m.fsdp_params / lay.fsdp
    seqs = desc.batch_size / (grad_accum * lay.batch_ways)
    exact = {
        "parameters": held * pb,
        "optimizer": 2 * held * ob / (lay.data if desc.zero1 else 1),
        "accumulator": held * pb if grad_accum > 1 else 0.0,
        "batch": seqs * (desc.seq_len + 1) * 4,
    }
    # The rest of the step's bytes at no tokens: gradients and the update's temporaries.
    rest = max(m.bytes_per_param * held - exact["parameters"] - 2 * held * ob, 0.0)
    terms = {**exact, "measured_state": rest,
             "measured_tokens": m.bytes_per_token * seqs * desc.seq_len,
             "gathered_weights": m.fsdp_params * (1 - 1 / lay.fsdp) * pb}
    return LayoutMemory(int(held), terms)


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured point: a model, a layout, a device count and the step's choices.

    Attributes:
        name: a label.
        desc: the model as compiled (its layers the full count).
        layout: the layout.
        devices: the device count.
        grad_accum: micro-steps per optimizer step (the compile used one micro-step).
        layers: the layer counts compiled to extrapolate from, or ``None``.
        remat, attention, schedule: the choices compiled (ZeRO-1 is ``desc.zero1``).
        target: one of the cases the issue checks (reported apart; the fit weighs every
            case the same).
        virtual_stages: ``interleaved``'s chunks per stage (else 1).
    """

    name: str
    desc: ModelDesc
    layout: Layout
    devices: int
    grad_accum: int = 1
    layers: tuple[int, int] | None = None
    remat: str = "none"
    attention: str = "xla"
    schedule: str = "gpipe"
    target: bool = False
    virtual_stages: int = 1

    def to_json(self) -> dict[str, Any]:
        """The stored form (``tests/plan/xla_memory.json``)."""
        return {"model": dataclasses.asdict(self.desc), "layout": dataclasses.asdict(
            self.layout), "devices": self.devices, "grad_accum": self.grad_accum,
            "layers": list(self.layers) if self.layers else None, "remat": self.remat,
            "attention": self.attention, "schedule": self.schedule, "target": self.target,
            "virtual_stages": self.virtual_stages}

    @classmethod
    def from_json(cls, name: str, row: dict[str, Any]) -> Case:
        """A case back from its stored form."""
        layers = row.get("layers")
        return cls(name, ModelDesc(**row["model"]), Layout(**row["layout"]), row["devices"],
                   row.get("grad_accum", 1), tuple(layers) if layers else None,
                   row.get("remat", "none"), row.get("attention", "xla"),
                   row.get("schedule", "gpipe"), bool(row.get("target", False)),
                   int(row.get("virtual_stages", 1)))


def stored_points(stored: dict[str, dict[str, Any]]) -> list[tuple[Case, int]]:
    """Every measured point of ``tests/plan/xla_memory.json``: a case compiled whole, or
    an extrapolated one and each of its compiled layer counts (as cases of their own, so
    the fit sees the per-layer and fixed parts apart).

    Args:
        stored: the file's content.

    Returns:
        ``(case, XLA's bytes)`` pairs.
    """
    out = []
    for name, row in stored.items():
        case = Case.from_json(name, row)
        if case.layers is None:
            out.append((case, int(row["xla_bytes"])))
            continue
        out.append((case, int(row["xla_bytes"])))  # the extrapolated whole model
        for n, size in zip(case.layers, row["compiled_bytes"], strict=True):
            desc = dataclasses.replace(case.desc, num_layers=n,
                                       dense_layers=min(case.desc.dense_layers, n - 1))
            # The target is the whole model, not the counts compiled to extrapolate it.
            out.append((dataclasses.replace(case, name=f"{name} L{n}", desc=desc,
                                            layers=None, target=False), int(size)))
    return out


def predict_case(case: Case, fit: dict[str, float] | None = None) -> int:
    """The numpy prediction of a measured case, comparable to XLA's bytes.

    The compiled step is a micro-step: its accumulator is not in XLA's figure.
    """
    m = layout_memory(case.desc, case.layout, grad_accum=case.grad_accum, remat=case.remat,
                      attention=case.attention, schedule=case.schedule,
                      virtual_stages=case.virtual_stages, fit=fit)
    return m.total - int(m.terms["accumulator"])


#: Coefficients that cannot be below a count XLA must hold: the float32 gradients (in
#: the backward pass and at the update), and one copy of each residual the buffer dumps
#: show kept at exactly its count (the MLP's hidden states, the dispatch buffers, the
#: combine's [tokens, k, d]: the default model's and DeepSeek-V2-Lite's alike); without
#: these floors the minimax trades them for the activations' term, which rises with them.
#: The same for a scanned layer in flight: one copy of its hidden states and buffers, and
#: the fewest [tokens, d_model] buffers a dump showed (eight: bench_parallel's fsdp8);
#: without them the minimax zeroes both and charges the bytes to the gathered weights.
#: A pipeline's backward tick at least 3 copies of a microbatch's stage working set: the
#: dense 1F1B pipelines (Llama-2-7B's, BLOOM-176B's) fitted 3.21 when they compiled;
#: while a dense model under 1F1B fails to compile (a VJP type error in meshkit's
#: step), no stored point sees a dense tick, and without the floor the minimax drops it
#: to 2.27 and puts Mixtral-8x7B's interleaved v8 at 2,048 devices at 0.87 of XLA.
#: The context attention's K/V in flight (no stored point has context ways) is charged at
#: its count: the floor keeps the fit from zeroing a term it has no point to see.
_FLOOR = {"gradients": 1.0, "update": 1.0, "mlp_hidden": 1.0, "expert_buffers": 1.0,
          "combine": 1.0, "in_flight_hidden": 1.0, "in_flight": 8.0, "tick": 3.0,
          "context_kv": 1.0}


def _phase_rows(cases: Sequence[Case], measured: Sequence[int]
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per phase, each case's counts over XLA's bytes (a matrix, one column per term of
    :data:`FITTED`, zero outside the phase); and each case's exact bytes over XLA's."""
    counts, exact = [], []
    for case, y in zip(cases, measured, strict=True):
        _, ex, c = features(case.desc, case.layout, grad_accum=case.grad_accum,
                            remat=case.remat, attention=case.attention, schedule=case.schedule,
                            virtual_stages=case.virtual_stages)
        counts.append([c[k] / y for k in FITTED])
        exact.append(sum(v for k, v in ex.items() if k != "accumulator") / y)
    a = np.array(counts)
    rows = {name: a * np.array([TERM_PHASE[k] in groups for k in FITTED])
            for name, groups in PHASES.items()}
    return rows, np.array(exact)


def _fit_assigned(rows: dict[str, np.ndarray], exact: np.ndarray, peak: Sequence[str]
                  ) -> tuple[float, np.ndarray]:
    """The minimax fit with each case's peak phase given: every phase at most
    ``(1 + t)·XLA``, the given one at least ``(1 − t)·XLA`` (a linear program)."""
    from scipy.optimize import linprog  # type: ignore[import-untyped]  # jax requires scipy

    n, cases = len(FITTED), len(exact)
    ones = np.ones((cases, 1))
    upper = np.vstack([np.c_[rows[name], -ones] for name in PHASES])
    at_peak = np.array([rows[p][i] for i, p in enumerate(peak)])
    a_ub = np.r_[upper, np.c_[-at_peak, -ones]]
    b_ub = np.r_[np.tile(1 - exact, len(PHASES)), exact - 1]
    # Variables: the coefficients, then t. Ties go to the smallest coefficients (1e-9).
    result = linprog(np.r_[np.full(n, 1e-9), 1.0], A_ub=a_ub, b_ub=b_ub, method="highs",
                     bounds=[(_FLOOR.get(k, 0.0), None) for k in FITTED] + [(0, None)])
    if not result.success:  # pragma: no cover - a feasible program (t large enough)
        raise RuntimeError(f"fit_terms: {result.message}")
    return float(result.x[-1]), result.x[:n]


def _centre(rows: dict[str, np.ndarray], exact: np.ndarray, peak: Sequence[str], worst: float
            ) -> np.ndarray:
    """Among the coefficients whose worst error is ``worst`` (the minimax's), those with
    the least summed error: the minimax alone leaves every point but the worst few free
    to sit anywhere in the band, and any term they alone need (a model's own) at zero."""
    from scipy.optimize import linprog

    n, cases = len(FITTED), len(exact)
    eye = np.eye(cases)
    at_peak = np.array([rows[p][i] for i, p in enumerate(peak)])
    bound = worst + 1e-6
    # Variables: the coefficients, then each case's error e. Every phase at most
    # (1 + worst)·XLA and at most (1 + e); the peak phase at least (1 − worst), (1 − e).
    a_ub = np.vstack([np.c_[rows[name], np.zeros((cases, cases))] for name in PHASES]
                     + [np.c_[rows[name], -eye] for name in PHASES]
                     + [np.c_[-at_peak, np.zeros((cases, cases))], np.c_[-at_peak, -eye]])
    b_ub = np.r_[np.tile(1 + bound - exact, len(PHASES)), np.tile(1 - exact, len(PHASES)),
                 exact - 1 + bound, exact - 1]
    result = linprog(np.r_[np.full(n, 1e-9), np.ones(cases)], A_ub=a_ub, b_ub=b_ub,
                     method="highs",
                     bounds=[(_FLOOR.get(k, 0.0), None) for k in FITTED] + [(0, None)] * cases)
    if not result.success:  # pragma: no cover - the minimax's coefficients are feasible
        raise RuntimeError(f"fit_terms: {result.message}")
    return np.asarray(result.x[:n])


def fit_terms(cases: Sequence[Case], measured: Sequence[int],
              start: dict[str, float] | None = None) -> dict[str, float]:
    """Non-negative coefficients of :data:`FITTED` minimising the worst relative error to
    XLA's bytes, since the drift test bounds the worst ratio, not the mean; every point
    weighs the same (the cases a check compiles are not favoured). At that worst error,
    the least summed error (:func:`_centre`).

    A step's bytes are its largest phase's (:data:`PHASES`), so the program is linear
    once each case's peak phase is fixed: start from the phases ``start`` gives (default
    :data:`FIT`) and from each phase for all, re-assign each case to its peak under the
    fit and try moving one case at a time to another phase while the worst error drops.

    Args:
        cases: the measured cases.
        measured: XLA's bytes of each.
        start: coefficients whose peak phases start the search (default :data:`FIT`).

    Returns:
        ``term -> coefficient``, rounded to 3 digits.
    """
    rows, exact = _phase_rows(cases, measured)
    names = list(PHASES)

    def peaks(coef: np.ndarray) -> list[str]:
        return [names[i] for i in np.argmax(np.stack([rows[p] @ coef for p in names]), axis=0)]

    first = np.array([(start or FIT)[k] for k in FITTED])
    best: tuple[float, np.ndarray] | None = None
    best_peak = peaks(first)
    for peak in [peaks(first)] + [[p] * len(exact) for p in names]:
        got = _fit_assigned(rows, exact, peak)
        improved = True
        while improved:
            improved = False
            again = peaks(got[1])
            trials = [again] if again != peak else []
            trials += [[*peak[:i], p, *peak[i + 1:]] for i in range(len(peak))
                       for p in names if p != peak[i]]
            for trial in trials:
                tried = _fit_assigned(rows, exact, trial)
                if tried[0] < got[0] - 1e-7:
                    peak, got, improved = trial, tried, True
                    break
        if best is None or got[0] < best[0] - 1e-7:
            best, best_peak = got, peak
    assert best is not None
    best = best[0], _centre(rows, exact, best_peak, best[0])
    return {k: float(f"{c:.3g}") if c > 1e-6 else 0.0
            for k, c in zip(FITTED, best[1], strict=True)}


def _check_factors() -> None:  # pragma: no cover - import-time self-check
    assert all(set(f) == set(REMAT_FACTORS["none"]) for f in REMAT_FACTORS.values())
    assert set(FIT) == set(TERM_PHASE) and set(TERM_PHASE.values()) == {
        g for groups in PHASES.values() for g in groups}
    assert math.isfinite(sum(FIT.values()))


_check_factors()
