"""One device's memory of a training step, fitted to XLA's own analysis (numpy only).

:func:`layout_memory` splits a step's bytes into terms, each a count the layout fixes
(parameters held, tokens per device, scores, expert slots, logits) times a coefficient.
The parameters, AdamW moments and the accumulation buffer are exact counts (coefficient
1). The other coefficients live in one place, :data:`FIT`, fitted by :func:`fit_terms`
to what XLA allocates for meshkit's compiled step (argument + temp + output − alias of
``compile_step(...).memory_analysis()``), as measured by ``benchmarks/bench_plan_memory.py``
and stored in ``tests/plan/xla_memory.json``. When the compiled step changes (remat,
attention kinds, schedules, ZeRO-1 of the memory issue), re-measure and re-fit::

    python benchmarks/bench_plan_memory.py --write && python benchmarks/bench_plan_memory.py --fit

Since issue 20 the fit sees compiled remat (``full``, ``save_dots``), chunked
attention, 1F1B, ZeRO-1 and fsdp's per-layer regather; the shares within a term
(:data:`REMAT_FACTORS`, :data:`ATTENTION_FACTORS`) are still estimates. The fit is a
minimax over the stored cases (worst ratio 0.77–1.23, short of the 0.9–1.1 target).

Example:
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
from meshkit.plan.model_desc import DTYPE_BYTES, ModelDesc
from meshkit.plan.planner import Layout


@functools.lru_cache(maxsize=65536)
def capacity(tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """:func:`meshkit.exchange.capacity.capacity`, cached: the planner asks for the same
    few token counts across thousands of candidates, and each call does exact
    fraction arithmetic.

    Example:
        >>> capacity(64, num_experts=8, top_k=2, capacity_factor=1.25)
        20
    """
    return _capacity(tokens, num_experts=num_experts, top_k=top_k,
                     capacity_factor=capacity_factor)


__all__ = [
    "ATTENTION_FACTORS",
    "FIT",
    "FITTED",
    "REMAT_FACTORS",
    "SCHEDULE_STASH",
    "Case",
    "LayoutMemory",
    "capacity",
    "default_attention_chunk",
    "features",
    "fit_terms",
    "layout_memory",
    "predict_case",
    "stored_points",
]

#: The fitted terms: bytes = coefficient × count, the counts of :func:`features`.
#: Fitted by ``benchmarks/bench_plan_memory.py --fit`` to ``tests/plan/xla_memory.json``.
FIT: dict[str, float] = {
    "gradients": 1.93,  # float32 gradients (at least 1: they exist)
    "pipeline_gradients": 0.236,  # a pipeline's gradients summed per microbatch
    "gathered_weights": 0.982,  # fsdp's gathered layers kept without remat
    "regathered_weights": 0.533,  # with remat or 1F1B: one layer regathered
    "block_inputs": 0.0,  # block/stage inputs kept where the rest is recomputed
    "scanned_residuals": 0.0,  # a scan's stacked copy of the kept residuals
    "workspace": 0.345,  # one layer's forward/backward working set
    "workspace_scores": 0.0,  # one layer's scores in flight (compute dtype)
    "workspace_softmax": 3.85,  # one layer's scores in flight (float32)
    "activations": 12.7,  # in units of [tokens, d_model] per layer
    "mlp_hidden": 0.0,  # not separable from expert_buffers on these cases
    "expert_buffers": 8.25,
    "attention_scores": 0.0,  # score elements kept per layer (compute dtype)
    "softmax": 2.57,  # score elements kept per layer (float32)
    "logits": 0.34,  # float32 logits
    "fixed": 0.0572,  # per MiB
}
#: The terms :data:`FIT` holds, in the order :func:`features` returns them.
FITTED: tuple[str, ...] = tuple(FIT)
#: Per remat policy, the share of each activation term kept for the backward pass
#: (``full`` keeps one block's worth: see :func:`features`). Not fitted: estimates.
REMAT_FACTORS: dict[str, dict[str, float]] = {
    "none": {"activations": 1.0, "mlp_hidden": 1.0, "expert_buffers": 1.0,
             "attention_scores": 1.0, "softmax": 1.0},
    # Matmul outputs kept (projections, MLP hidden, scores); elementwise recomputed.
    "save_dots": {"activations": 0.5, "mlp_hidden": 0.67, "expert_buffers": 1.0,
                  "attention_scores": 0.5, "softmax": 0.5},
    "full": {"activations": 0.0, "mlp_hidden": 0.0, "expert_buffers": 0.0,
             "attention_scores": 0.0, "softmax": 0.0},
}
#: Attention kinds: the scores' size relative to materialised ``[T, T]`` scores, as a
#: function of the sequence length (``chunked``: blocks of ``attention_chunk`` keys, by
#: default the config's, :func:`default_attention_chunk`; ``dot_product``: a fused
#: kernel on GPU, the XLA path on CPU, counted as the GPU's).
ATTENTION_FACTORS: dict[str, float] = {"xla": 1.0, "dot_product": 0.0, "chunked": 0.0}
#: Pipeline schedules: how many microbatches' activations a stage stashes, given S
#: stages, M microbatches and v virtual stages (GPipe in SPMD: every tick's, M + S − 1;
#: 1F1B at most S; interleaved, differentiated as GPipe is, every one of its v·M + S − 1
#: ticks of 1/v of the stage's layers).
SCHEDULE_STASH: dict[str, str] = {"gpipe": "M + S - 1", "1f1b": "min(S, M)",
                                  "interleaved": "(v·M + S - 1) / v"}


@functools.cache
def default_attention_chunk() -> int:
    """The chunk length of ``chunked`` attention when a description leaves it open: the
    config's ``model.attention_chunk`` default, read from its schema so that the planner
    and the step ``--verify`` compiles use one figure.

    Returns:
        Keys per block.

    Example:
        >>> default_attention_chunk() >= 1
        True
    """
    from meshkit.config.sections import ModelConfig  # pydantic, not JAX

    return int(ModelConfig.model_fields["attention_chunk"].default)


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
    """One device's bytes of a step, term by term.

    Attributes:
        params: parameter elements the device holds.
        terms: bytes per term, the exact ones (``parameters``, ``optimizer``,
            ``accumulator``, ``batch``) and the fitted ones (:data:`FITTED`).
    """

    params: int
    terms: dict[str, float]

    @property
    def state(self) -> float:
        """Parameters and optimizer moments."""
        return self.terms["parameters"] + self.terms["optimizer"]

    @property
    def total(self) -> int:
        """All terms."""
        return int(sum(self.terms.values()))


def _stage_params(desc: ModelDesc, lay: Layout) -> float:
    """Parameter elements one device holds, split as meshkit's rules split them: heads,
    MLP width and vocabulary over tensor ways, the width over fsdp, routed experts over
    expert ways, layers over the pipeline; norms replicated."""
    d, tp, f, s = desc.d_model, lay.tensor, lay.fsdp, lay.pipeline
    # Uneven stages hold ceil(layers / S) blocks at most: the largest stage bounds memory.
    moe_l = math.ceil(desc.moe_layers / s)
    dense_l = math.ceil(desc.num_layers / s) - moe_l
    attn = desc.attention_params / (tp * f) + 2 * d
    ffn_tp = tp if desc.megatron_tp else 1
    dense = dense_l * (attn + desc.dense_mlp_params / (ffn_tp * f))
    moe = moe_l * (attn + d * desc.num_experts / f
                   + desc.num_shared_experts * desc.expert_params / f
                   + desc.num_experts * desc.expert_params / (lay.expert * f))
    embed = desc.vocab_size * d * (1 if desc.tie_embeddings else 2) / (tp * f) + d
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
    tokens = seqs * desc.seq_len
    layers = math.ceil(desc.num_layers / s)  # the largest stage
    moe_layers = min(math.ceil(desc.moe_layers / s), layers)
    # GPipe in SPMD runs M + S − 1 ticks and keeps every tick's activations (the bubble's
    # included: the idle stages compute on padding); interleaved likewise, v·M + S − 1
    # ticks of 1/v of the layers; 1F1B stashes at most S microbatches (see keep below).
    v = virtual_stages if schedule == "interleaved" else 1
    if s == 1:
        stash = 1.0
    elif schedule == "1f1b":
        stash = min(s, m) / m
    else:
        stash = (v * m + s - 1) / (v * m)
    # One layer's weights as computed with (gathered over fsdp) in the compute dtype.
    ffn_tp = tp if desc.megatron_tp else 1
    layer_w = (desc.attention_params / tp + desc.dense_mlp_params / ffn_tp * (moe_layers == 0)
               + desc.num_experts * desc.expert_params / lay.expert
               * (moe_layers > 0)) * cb
    routed = tokens / (m * tp)  # tokens one device routes per microbatch
    if desc.is_moe:
        slots = (capacity(int(routed), num_experts=desc.num_experts, top_k=desc.top_k,
                          capacity_factor=desc.capacity_factor) if routed >= 1 else 0)
        # [E, C, d] dispatched; after the exchange a device holds E/X experts × X·C rows:
        # the same E·C slots, whatever the expert ways.
        buffers: float = moe_layers * m * desc.num_experts * slots * desc.d_model * cb
        hidden_moe: float = (moe_layers * m * desc.num_experts * slots
                      * (desc.mlp_mats - 1) * desc.ff_expert * cb)
        hidden_moe += moe_layers * tokens * desc.num_shared_experts * desc.ff_expert \
            * (desc.mlp_mats - 1) * cb
    else:
        buffers, hidden_moe = 0.0, 0.0
    hidden = (layers - moe_layers) * tokens * desc.d_ff / tp * (desc.mlp_mats - 1) * cb \
        + hidden_moe
    scale = ATTENTION_FACTORS[attention]
    if attention == "chunked":
        scale = float(desc.attention_chunk or default_attention_chunk())
    score_len = desc.seq_len if scale == 1.0 else min(scale, desc.seq_len)
    # Score elements; counted in the compute dtype and (the softmax's) float32 apart.
    scores = layers * seqs * desc.num_heads / tp * desc.seq_len * score_len
    interleaved = s > 1 and schedule == "interleaved"
    # The interleaved schedule checkpoints each chunk (meshkit.model.transformer): without
    # remat it keeps the matmul outputs only, as save_dots does, and the chunk's inputs.
    keep = REMAT_FACTORS["save_dots" if interleaved and remat == "none" else remat]
    # 1F1B keeps each stage's inputs (at most S microbatches) and recomputes a stage's
    # forward for one microbatch at its backward tick: one microbatch's residuals.
    if s > 1 and schedule == "1f1b":
        keep = {k: f / m / max(stash, 1e-12) for k, f in keep.items()}
    per_layer = {"activations": layers * tokens * desc.d_model * cb, "mlp_hidden": hidden,
                 "expert_buffers": buffers, "attention_scores": scores * cb,
                 "softmax": scores * 4}
    one_layer = layers * tokens * desc.d_model * cb / max(layers, 1) / max(m, 1)
    recompute = remat != "none" or (s > 1 and schedule == "1f1b")
    inputs = 0.0  # block (or stage) inputs kept where the rest is recomputed
    if remat != "none":
        inputs += layers * tokens * desc.d_model * cb * stash
    if s > 1 and schedule == "1f1b":
        inputs += min(s, m) * one_layer
    if interleaved and remat == "none":  # one microbatch's chunk input per tick
        inputs += (v * m + s - 1) * one_layer
    fitted = {
        "gradients": params * pb,
        # A pipelined step sums each microbatch's gradients inside its loop: a second copy.
        "pipeline_gradients": params * pb if s > 1 else 0.0,
        # fsdp's gathered weights: each layer's kept for the backward pass without remat
        # (GPipe: every tick's, M + S − 1 of them; interleaved: the stage's, once, as its
        # ticks slice their chunk from them); with remat, or 1F1B's recompute, the
        # scanned layers regather theirs, one layer's live at a time.
        "gathered_weights": layers * layer_w * (m + s - 1 if s > 1 and not interleaved
                                                else 1)
        if lay.fsdp > 1 and (interleaved or not recompute) else 0.0,
        "regathered_weights": layer_w if lay.fsdp > 1 and recompute and not interleaved
        else 0.0,
        # Residuals kept for the backward pass, per layer, as the remat policy keeps them.
        **{k: v * keep[k] * stash for k, v in per_layer.items()},
        "block_inputs": inputs,
        # Scanned layers (remat or fsdp) stack the residuals: one more copy of them.
        "scanned_residuals": sum(v * keep[k] * stash for k, v in per_layer.items()) + inputs
        if lay.fsdp > 1 or remat != "none" else 0.0,
        # One layer's forward and backward working set (one microbatch): live whatever
        # is kept, the same at any layer count.
        "workspace": sum(v for k, v in per_layer.items()
                         if k not in ("attention_scores", "softmax")) / max(layers, 1) / max(m, 1),
        "workspace_scores": scores * cb / max(layers, 1) / max(m, 1),
        "workspace_softmax": scores * 4 / max(layers, 1) / max(m, 1),
        # float32 for the softmax. meshkit's loss holds whole rows on each tensor rank
        # (fitted: dividing by the tensor ways left its tp8 case 10 % low); a Megatron
        # vocab-parallel loss keeps them split.
        "logits": tokens * desc.vocab_size / ffn_tp * 4,
        "fixed": 2.0**20,
    }
    exact = {
        "parameters": params * pb,
        # ZeRO-1 keeps 1/data of the moments (the replicated part; fsdp has split them).
        "optimizer": 2 * params * ob / (lay.data if desc.zero1 else 1),
        "accumulator": params * pb if grad_accum > 1 else 0.0,
        "batch": seqs * (desc.seq_len + 1) * 4,
    }
    return params, exact, fitted


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
    coef = FIT if fit is None else fit
    params, exact, counts = features(desc, lay, grad_accum=grad_accum, remat=remat,
                                     attention=attention, schedule=schedule,
                                     virtual_stages=virtual_stages)
    terms = {**exact, **{k: coef[k] * v for k, v in counts.items()}}
    return LayoutMemory(int(params), terms)


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

    def to_json(self) -> dict[str, Any]:
        """The stored form (``tests/plan/xla_memory.json``)."""
        return {"model": dataclasses.asdict(self.desc), "layout": dataclasses.asdict(
            self.layout), "devices": self.devices, "grad_accum": self.grad_accum,
            "layers": list(self.layers) if self.layers else None, "remat": self.remat,
            "attention": self.attention, "schedule": self.schedule}

    @classmethod
    def from_json(cls, name: str, row: dict[str, Any]) -> Case:
        """A case back from its stored form."""
        layers = row.get("layers")
        return cls(name, ModelDesc(**row["model"]), Layout(**row["layout"]), row["devices"],
                   row.get("grad_accum", 1), tuple(layers) if layers else None,
                   row.get("remat", "none"), row.get("attention", "xla"),
                   row.get("schedule", "gpipe"))


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
            out.append((dataclasses.replace(case, name=f"{name} L{n}", desc=desc,
                                            layers=None), int(size)))
    return out


def predict_case(case: Case, fit: dict[str, float] | None = None) -> int:
    """The numpy prediction of a measured case, comparable to XLA's bytes.

    The compiled step is a micro-step: its accumulator is not in XLA's figure.
    """
    m = layout_memory(case.desc, case.layout, grad_accum=case.grad_accum, remat=case.remat,
                      attention=case.attention, schedule=case.schedule, fit=fit)
    return m.total - int(m.terms["accumulator"])


#: Coefficients that cannot be below a count XLA must hold: the float32 gradients and
#: logits (without the floor the program, near-degenerate on these cases, zeroes them).
_FLOOR = {"gradients": 1.0}


def fit_terms(cases: Sequence[Case], measured: Sequence[int]) -> dict[str, float]:
    """Non-negative coefficients of :data:`FITTED` minimising the worst relative error to
    XLA's bytes (a linear program: minimise ``t`` with ``|prediction / XLA − 1| ≤ t`` on
    every case), since the drift test bounds the worst ratio, not the mean.

    Args:
        cases: the measured cases.
        measured: XLA's bytes of each.

    Returns:
        ``term -> coefficient``, rounded to 3 digits.
    """
    from scipy.optimize import linprog  # type: ignore[import-untyped]  # jax requires scipy

    rows, target = [], []
    for case, y in zip(cases, measured, strict=True):
        _, exact, counts = features(case.desc, case.layout, grad_accum=case.grad_accum,
                                    remat=case.remat, attention=case.attention,
                                    schedule=case.schedule)
        rest = y - sum(v for k, v in exact.items() if k != "accumulator")
        rows.append([counts[k] / y for k in FITTED])
        target.append(rest / y)
    a, b = np.array(rows), np.array(target)
    n, ones = len(FITTED), np.ones((len(b), 1))
    # Variables: the coefficients, then t. Ties go to the smallest coefficients (1e-9).
    cost = np.r_[np.full(n, 1e-9), 1.0]
    result = linprog(cost, A_ub=np.r_[np.c_[a, -ones], np.c_[-a, -ones]],
                     b_ub=np.r_[b, -b], method="highs",
                     bounds=[(_FLOOR.get(k, 0.0), None) for k in FITTED] + [(0, None)])
    if not result.success:  # pragma: no cover - a feasible program (t large enough)
        raise RuntimeError(f"fit_terms: {result.message}")
    return {k: float(f"{c:.3g}") if c > 1e-6 else 0.0
            for k, c in zip(FITTED, result.x[:n], strict=True)}


def _check_factors() -> None:  # pragma: no cover - import-time self-check
    assert all(set(f) == set(REMAT_FACTORS["none"]) for f in REMAT_FACTORS.values())
    assert math.isfinite(sum(FIT.values()))


_check_factors()
