"""Benchmark: the planner's memory (numpy) against XLA's (the compiled step), per device.

Each case is a model, a layout and a device count. The step is compiled by
:func:`meshkit.plan.verify.verify` (a subprocess with that many simulated CPU devices,
abstract inputs) and XLA's argument + temp + output − alias is read per device. Full-size
cases compile 2 and 4 layers and extrapolate linearly to the model's layers (XLA's
figure is linear in the layers from 2 on; a scan over 1 layer is off the line), which
keeps a full run within minutes on 2 cores.

It prints predicted / XLA per case and, with ``--write``, stores the measured bytes in
``tests/plan/xla_memory.json``, which ``tests/plan/test_memory_fit.py`` checks the numpy
prediction against (within 0.8–1.2) without compiling anything. Re-fit the terms in
:mod:`meshkit.plan.memory_fit` from the same file with ``--fit``.

``--held-out`` prints, for every stored point, its in-sample ratio beside the ratio of
a fit without its case (all its compiled layer counts) and of a fit without its model
(small, default, act, Mixtral-8x7B, ...): how far the terms carry to what they were not
fitted on. ``--markdown`` prints the same ratios as the README's table ("Memory, fitted
to XLA"), a row per stored case, so after a refit the table is one command::

    meshkit bench plan_memory --markdown

The one-command refit, after the compiled step changed (measure every case, store it,
fit, write the terms into ``memory_fit.FIT``)::

    meshkit bench plan_memory --write --fit --apply

The full-size cases read their models from ``configs/models/``, and the stored numbers
are ``tests/plan/xla_memory.json``: both belong to a source checkout, not to the
installed package. Without one (meshkit installed from a wheel), the small cases are
measured (``--only small``, the default there) and the options that read or write the
stored numbers or the source (``--only full``, ``--write``, ``--fit``, ``--held-out``,
``--markdown``) are usage errors.

``--json FILE`` writes the report (:mod:`meshkit.benchmarks._report`): the table of
the cases measured (or ``--held-out``'s), with every case's measured fields in ``data``.

``--plan N`` checks ``meshkit plan --devices N`` on the default config: its first four
layouts and three spread down the ranking (at the quarters of the rest), each compiled
with its overrides, predicted / XLA for each.

Usage: meshkit bench plan_memory [--only small|full] [--match TEXT ...] [--write]
       [--fit [--apply]] [--held-out | --markdown] [--plan N] [--json FILE]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("plan_memory")  # before the imports: Ctrl-C in one line, not a traceback

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import meshkit.plan.memory_fit
from meshkit.benchmarks._report import SOURCE_ROOT, Report, Table, add_json_flag
from meshkit.errors import UsageError
from meshkit.plan.memory_fit import Case, fit_terms, predict_case, stored_points
from meshkit.plan.model_desc import ModelDesc, load_model_desc
from meshkit.plan.planner import Layout
from meshkit.plan.verify import VerifyJob, known_keys, stage_split, verify

ROOT = SOURCE_ROOT  # a source checkout's top, where there is one
MODELS = ROOT / "configs" / "models"  # the full-size cases' model descriptions
STORED = ROOT / "tests" / "plan" / "xla_memory.json"
SOURCE = Path(meshkit.plan.memory_fit.__file__)  # where FIT lives

# The model of meshkit.benchmarks.bench_parallel on the 7 layouts of tests/train/test_parallel.py.
SMALL = ModelDesc(name="bench_parallel", vocab_size=256, d_model=256, num_layers=4,
                  num_heads=4, d_ff=512, num_experts=8, top_k=2, seq_len=64, batch_size=32,
                  compute_dtype="float32")
DEFAULT = ModelDesc(name="default", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
                    d_ff=128, num_experts=8, top_k=2, seq_len=64, batch_size=32,
                    compute_dtype="float32")
# Activations dominate (2,048 tokens a device at dp8, 0.4 M parameters): what remat,
# chunked attention and the pipeline schedules change is visible here, not on SMALL.
# A dense model (model.num_experts: 0).
ACT = ModelDesc(name="activations", vocab_size=256, d_model=128, num_layers=2, num_heads=4,
                d_ff=256, num_experts=1, top_k=1, seq_len=256, batch_size=64,
                compute_dtype="float32")
# The head's and the logits' share of the bytes: a vocabulary far above d_model, as
# BLOOM-176B's 250,680 beside 14,336.
VOCAB = ModelDesc(name="vocab", vocab_size=65536, d_model=256, num_layers=2, num_heads=4,
                  d_ff=512, num_experts=1, top_k=1, seq_len=64, batch_size=32,
                  compute_dtype="float32")
# Issue 36's matched shapes: a dense model and an MoE model of the same width, layers,
# heads, d_ff (each expert's), vocabulary and batch.
DENSE36 = ModelDesc(name="dense36", vocab_size=512, d_model=128, num_layers=2, num_heads=4,
                    d_ff=512, seq_len=64, batch_size=32, compute_dtype="float32")
MOE36 = dataclasses.replace(DENSE36, name="moe36", num_experts=8, top_k=2)
SMALL_LAYOUTS = {
    "dp8": Layout(data=8),
    "fsdp8": Layout(fsdp=8),
    "tp2-node2-device2": Layout(tensor=2, expert_nodes=2, expert_devices=2,
                                exchange="hierarchical", moe_tensor="tokens"),
    "pp2-node2-device2": Layout(pipeline=2, expert_nodes=2, expert_devices=2, microbatches=4,
                                exchange="hierarchical"),
    "pp2-tp2-node2": Layout(pipeline=2, tensor=2, expert_devices=2, microbatches=2,
                            exchange="flat", moe_tensor="tokens"),
    "fsdp2-node2-device2": Layout(fsdp=2, expert_nodes=2, expert_devices=2,
                                  exchange="hierarchical"),
    "dp2-pp2-tp2": Layout(data=2, pipeline=2, tensor=2, microbatches=2, moe_tensor="tokens"),
}


def _cases(only: str | None) -> list[Case]:
    cases: list[Case] = []
    if only in (None, "small"):
        # The targets (target=True, reported apart, not weighted): the 7 small
        # layouts, the default model's top layouts at 8 devices, and below each
        # full-size model's first layout at 64 devices.
        cases += [Case(f"small {n}", SMALL, lay, 8, target=True)
                  for n, lay in SMALL_LAYOUTS.items()]
        cases += [Case("default ep2x4", DEFAULT,
                       Layout(expert_nodes=2, expert_devices=4, exchange="hierarchical"), 8,
                       target=True),
                  Case("default pp2 dp4 mb2", DEFAULT, Layout(pipeline=2, data=4,
                                                               microbatches=2), 8, target=True),
                  # The rest of `meshkit plan --devices 8`'s top 5 once fsdp's regather
                  # and transposes were charged.
                  Case("default dp4 fsdp2", DEFAULT, Layout(data=4, fsdp=2), 8, target=True),
                  Case("default dp2 fsdp2 ep2", DEFAULT,
                       Layout(data=2, fsdp=2, expert_devices=2, exchange="flat"), 8,
                       target=True),
                  Case("default pp2 dp2 ep2 mb2", DEFAULT,
                       Layout(pipeline=2, data=2, expert_devices=2, exchange="flat",
                              microbatches=2), 8, target=True)]
        # The step's choices of the memory issue, each on a layout above: the remat
        # policies (scanned layers; with fsdp, weights regathered per layer), chunked
        # attention (blocks of 16 keys of 64), the 1F1B schedule and ZeRO-1.
        cases += [
            Case("small fsdp8 remat full", SMALL, Layout(fsdp=8), 8, remat="full"),
            Case("small dp8 zero1", dataclasses.replace(SMALL, zero1=True), Layout(data=8),
                 8),
            Case("default pp2 dp4 mb4 1f1b", DEFAULT, Layout(pipeline=2, data=4,
                                                             microbatches=4), 8,
                 schedule="1f1b", target=True),
            Case("default pp2 dp4 mb4", DEFAULT, Layout(pipeline=2, data=4,
                                                        microbatches=4), 8, target=True),
        ]
        # The same choices where the activations are most of the bytes (chunked
        # attention: blocks of 64 keys of 256).
        pp = Layout(pipeline=2, data=4, microbatches=4)
        cases += [
            Case("act dp8", ACT, Layout(data=8), 8),
            Case("act dp8 remat full", ACT, Layout(data=8), 8, remat="full"),
            Case("act dp8 remat save_dots", ACT, Layout(data=8), 8, remat="save_dots"),
            Case("act dp8 chunked", dataclasses.replace(ACT, attention_chunk=64),
                 Layout(data=8), 8, attention="chunked"),
            Case("act fsdp8", ACT, Layout(fsdp=8), 8),
            Case("act fsdp8 remat full", ACT, Layout(fsdp=8), 8, remat="full"),
            Case("act pp2 dp4 mb4", ACT, pp, 8),
            Case("act pp2 dp4 mb4 1f1b", ACT, pp, 8, schedule="1f1b"),
            # A pipeline over fsdp (each stage's layers scanned, weights regathered).
            Case("small pp2 dp2 fsdp2 mb2", SMALL, Layout(pipeline=2, data=2, fsdp=2,
                                                          microbatches=2), 8),
            Case("act pp2 dp2 fsdp2 mb2 1f1b", ACT, Layout(pipeline=2, data=2, fsdp=2,
                                                           microbatches=2), 8,
                 schedule="1f1b"),
        ]
        # Issue 36: dense MLPs split over the tensor ways, the experts' width split
        # (moe_tensor ffn) against their tokens, and expert axes that are fsdp too.
        tp = Layout(data=2, tensor=4)
        cases += [
            Case("dense36 dp8", DENSE36, Layout(data=8), 8),
            Case("dense36 dp2 tp4", DENSE36, tp, 8),
            Case("moe36 dp2 tp4 ffn", MOE36, dataclasses.replace(tp, moe_tensor="ffn"), 8),
            Case("moe36 dp2 tp4 tokens", MOE36, dataclasses.replace(tp, moe_tensor="tokens"),
                 8),
            Case("moe36 dp2 ep4 expert-fsdp", MOE36,
                 Layout(data=2, expert_devices=4, exchange="flat", expert_fsdp=True), 8),
            Case("moe36 pp2 dp2 tp2 ffn mb2", MOE36,
                 Layout(pipeline=2, data=2, tensor=2, microbatches=2, moe_tensor="ffn"), 8),
            Case("dense36 pp2 dp4 mb2", DENSE36, Layout(pipeline=2, data=4, microbatches=2),
                 8),
            Case("moe36 tp2 ep2 fsdp2 expert-fsdp ffn",
                 dataclasses.replace(MOE36, dense_layers=1, num_layers=3),
                 Layout(fsdp=2, expert_devices=2, tensor=2, exchange="flat",
                        moe_tensor="ffn", expert_fsdp=True), 8),
        ]
    if only in (None, "full"):
        # As meshkit builds them (ModelDesc.buildable): what the compile measures.
        models = MODELS
        mixtral = load_model_desc(models / "mixtral_8x7b.yaml").buildable()
        llama = load_model_desc(models / "llama2_7b.yaml").buildable()
        deepseek = load_model_desc(models / "deepseek_v2_lite.yaml").buildable()
        bloom = load_model_desc(models / "bloom_176b.yaml").buildable()
        cases += [
            Case("Mixtral-8x7B dp8 fsdp2 ep4", mixtral,
                 Layout(data=8, fsdp=2, expert_devices=4, exchange="flat"), 64, layers=(2, 4),
                 target=True),
            Case("Llama-2-7B dp8 fsdp8 accum4", llama, Layout(data=8, fsdp=8), 64,
                 grad_accum=4, layers=(2, 4), target=True),
            Case("DeepSeek-V2-Lite dp8 fsdp2 ep4", deepseek,
                 Layout(data=8, fsdp=2, expert_devices=4, exchange="flat"), 64, layers=(2, 4),
                 target=True),
            # A dense MLP over tensor ways: --verify of Llama-2-7B's runnable candidates
            # found the fit low here.
            Case("Llama-2-7B fsdp8 tp8 accum128", llama, Layout(fsdp=8, tensor=8), 64,
                 grad_accum=128, layers=(2, 4)),
            # A pipeline over fsdp at full size, as the planner picks for Mixtral at scale
            # (2 and 4 layers a stage).
            Case("Mixtral-8x7B pp4 dp2 fsdp2 ep4 mb2 1f1b accum8", mixtral,
                 Layout(pipeline=4, data=2, fsdp=2, expert_devices=4, microbatches=2,
                        exchange="flat"), 64, grad_accum=8, layers=(8, 16),
                 schedule="1f1b"),
            # Remat at full size: what --verify of Llama-2-7B's 4M-token batch compiles.
            Case("Llama-2-7B dp8 fsdp8 accum4 remat full", llama, Layout(data=8, fsdp=8),
                 64, grad_accum=4, layers=(2, 4), remat="full"),
            # save_dots with 1F1B over fsdp: --verify's runnable first choice for
            # Llama-2-7B at its 4M-token batch on 64 devices (2 and 4 layers a stage).
            Case("Llama-2-7B pp2 dp4 fsdp8 mb32 save_dots 1f1b", llama,
                 Layout(pipeline=2, data=4, fsdp=8, microbatches=32), 64, layers=(4, 8),
                 remat="save_dots", schedule="1f1b"),
            # 1F1B without remat over tensor ways at full size: --verify's runnable first
            # and second choices for Llama-2-7B at its 4M-token batch on 64 devices (2
            # accumulation steps; 2 and 4 layers a stage), held out until issue 21's
            # refit put them at 1.11 of XLA.
            Case("Llama-2-7B pp2 dp4 fsdp4 tp2 mb32 accum2 1f1b", llama,
                 Layout(pipeline=2, data=4, fsdp=4, tensor=2, microbatches=32), 64,
                 grad_accum=2, layers=(4, 8), schedule="1f1b"),
            Case("Llama-2-7B pp2 dp8 fsdp2 tp2 mb32 accum2 1f1b", llama,
                 Layout(pipeline=2, data=8, fsdp=2, tensor=2, microbatches=32), 64,
                 grad_accum=2, layers=(4, 8), schedule="1f1b"),
            # A 250,680-token vocabulary over a pipeline: --verify of BLOOM-176B's runnable
            # candidates (chunked attention) found the fit 0.55-0.73 of XLA here, the
            # miss in the part that does not grow with the layers (the head's).
            Case("BLOOM-176B pp6 fsdp64 mb32 1f1b chunked", bloom,
                 Layout(pipeline=6, fsdp=64, microbatches=32), 384, layers=(12, 24),
                 attention="chunked", schedule="1f1b"),
            # save_dots with 1F1B at that size: --verify put it at 0.60 after the head's term.
            Case("BLOOM-176B pp3 fsdp64 tp2 mb32 save_dots 1f1b chunked", bloom,
                 Layout(pipeline=3, fsdp=64, tensor=2, microbatches=32), 384, layers=(6, 12),
                 remat="save_dots", attention="chunked", schedule="1f1b"),
        ]
        # Full-size pipelines at 2,048 devices, as `meshkit plan --runnable --verify
        # --verify-extrapolate` picks them (its candidates' own overrides): held out, the
        # refit of 0.86–1.14 in sample put them at 0.62–0.82 of XLA. Mixtral-8x7B's first
        # choice on 256 H100 nodes, interleaved over 8 chunks a stage (compiled whole: 32
        # layers are 4 stages of 8 one-layer chunks).
        cases.append(Case("Mixtral-8x7B pp4 fsdp16 ep4x2 tp4 mb4 interleaved v8", mixtral,
                          Layout(pipeline=4, fsdp=16, expert_nodes=4, expert_devices=2,
                                 tensor=4, microbatches=4, exchange="flat",
                                 moe_tensor="tokens"), 2048,
                          schedule="interleaved", virtual_stages=8))
        # DeepSeek-V3's top 5 on 256 H800 nodes (chunked attention, 1F1B, one sequence a
        # microbatch, ZeRO-1): 2 and 4 layers a stage, or whole (61 layers, 16 uneven
        # stages) where 4 a stage is beyond the model.
        # Pipelined: its 3 dense layers compiled as MoE layers (meshkit splits no dense
        # layers into stages; ModelDesc.differences).
        dsv3 = dataclasses.replace(load_model_desc(models / "deepseek_v3.yaml"),
                                   attention="chunked").buildable()
        dsv3 = dataclasses.replace(dsv3, dense_layers=0)
        for st, dp, fsdp, mb in ((8, 2, 16, 60), (8, 4, 8, 60), (16, 2, 8, 120),
                                 (16, 4, 4, 120), (4, 2, 32, 30)):
            cases.append(Case(f"DeepSeek-V3 pp{st} dp{dp} fsdp{fsdp} ep8 mb{mb} 1f1b chunked",
                              dsv3, Layout(pipeline=st, data=dp, fsdp=fsdp, expert_nodes=8,
                                           microbatches=mb, exchange="flat"), 2048,
                              layers=(2 * st, 4 * st) if 4 * st <= dsv3.num_layers else None,
                              attention="chunked", schedule="1f1b"))
    if only in (None, "small"):
        # The same regime at 8 devices: a vocabulary of 64k beside a d_model of 256.
        # The logits apart from the gathered embedding and head: without fsdp, and split
        # over the tensor ways (the loss is vocab-parallel).
        cases += [Case("vocab pp2 fsdp4 mb4 1f1b", VOCAB,
                       Layout(pipeline=2, fsdp=4, microbatches=4), 8, schedule="1f1b"),
                  Case("vocab fsdp8", VOCAB, Layout(fsdp=8), 8),
                  Case("vocab dp8", VOCAB, Layout(data=8), 8),
                  Case("vocab dp2 tp4", VOCAB, Layout(data=2, tensor=4), 8)]
    return cases


def _jobs(case: Case) -> list[VerifyJob]:
    """One job, or one per compiled layer count."""
    descs = ([case.desc] if case.layers is None else
             [dataclasses.replace(case.desc, num_layers=n, dense_layers=min(
                 case.desc.dense_layers, n - 1)) for n in case.layers])
    known = known_keys()
    # Every choice set, so a base config's own schedule is never compiled (an open chunk
    # length is the config's default, as the planner's: default_attention_chunk).
    s = case.layout.pipeline
    sched = ([f"parallel.schedule={case.schedule}",
              f"parallel.virtual_stages={case.virtual_stages}"] if s > 1 else [])
    # Stages that do not divide the layers compile uneven, as --verify compiles them.
    return [VerifyJob(f"{case.name} L{d.num_layers}", None,
                      tuple(d.overrides(grad_accum=case.grad_accum, remat=case.remat,
                                        attention=case.attention, known=known)
                            + sched + ([f"parallel.stage_layers={stage_split(d.num_layers, s)}"]
                                       if d.num_layers % s else [])
                            + case.layout.overrides()))
            for d in descs]


def _slots(case: Case) -> int:
    """The layers an extrapolated case is extended to: uneven stages each hold the
    largest stage's layer slots (as ``--verify`` extends them, and as the planner
    charges ``ceil(layers / S)`` a stage)."""
    s = case.layout.pipeline
    return s * -(-case.desc.num_layers // s)


def measure(cases: list[Case]) -> dict[str, dict[str, object]]:
    """XLA's bytes per device of every case (extrapolated where layers are given)."""
    out: dict[str, dict[str, object]] = {}
    by_devices: dict[int, list[Case]] = {}
    for c in cases:
        by_devices.setdefault(c.devices, []).append(c)
    for devices, group in by_devices.items():
        jobs = [job for c in group for job in _jobs(c)]
        results = iter(verify(jobs, devices=devices,
                              progress=lambda line: print(line, file=sys.stderr, flush=True)))
        for c in group:
            got = [next(results) for _ in (c.layers or (None,))]
            bad = [r.error for r in got if r.bytes is None]
            if bad:
                print(f"{c.name}: compile failed: {bad[0]}", file=sys.stderr)
                continue
            sizes = [int(r.bytes or 0) for r in got]
            if c.layers is None:
                total = sizes[0]
            else:  # linear in the layers: a + b·L through the two compiled counts
                (l1, l2), (m1, m2) = c.layers, sizes
                per_layer = (m2 - m1) / (l2 - l1)
                total = round(m1 + per_layer * (_slots(c) - l1))
            # XLA's split (argument, temp, output, alias) of each compiled count: the
            # arguments are the exact terms, so a fit can see the temp bytes apart.
            out[c.name] = {**c.to_json(), "xla_bytes": total, "compiled_bytes": sizes,
                           "compiled_parts": [dict(r.parts) for r in got],
                           "compile_s": [round(r.seconds, 1) for r in got]}
    return out


def table(stored: dict[str, dict[str, object]], into: Table | None = None) -> str:
    """Predicted against XLA's bytes per case, as text (and as rows of ``into``)."""
    lines = [f"{'case':<34} {'devices':>7} {'XLA GiB':>9} {'predicted':>9} {'ratio':>6}"]
    for name, row in stored.items():
        case = Case.from_json(name, row)
        pred = predict_case(case)
        xla = int(row["xla_bytes"])  # type: ignore[call-overload]
        lines.append(f"{name:<34} {case.devices:>7} {xla / 2**30:>9.3f} {pred / 2**30:>9.3f} "
                     f"{pred / xla:>6.2f}")
        if into is not None:
            into.add(name, case.devices, xla / 2**30, pred / 2**30, pred / xla)
    return "\n".join(lines)


def _case_of(name: str) -> str:
    """A stored point's case: its name without a compiled layer count (`` L4``)."""
    head, _, tail = name.rpartition(" L")
    return head if head and tail.isdigit() else name


Fitter = Callable[[Sequence[Case], Sequence[int]], dict[str, float]]


def held_out_ratios(points: list[tuple[Case, int]], fitter: Fitter = fit_terms,
                    ) -> dict[str, dict[str, float]]:
    """Every point's predicted / XLA: in sample (with ``FIT``), refitted without its case
    and refitted without its model (the name's first word).

    Args:
        points: the stored points (:func:`meshkit.plan.memory_fit.stored_points`).
        fitter: fits the terms to some of them (:func:`fit_terms`; a test passes a stub).

    Returns:
        column (``in-sample``, ``without case``, ``without model``) -> point name -> ratio.
    """
    cols: dict[str, dict[str, float]] = {
        "in-sample": {c.name: predict_case(c) / y for c, y in points}}
    for label, key in (("without case", _case_of), ("without model",
                                                     lambda n: n.split()[0])):
        col: dict[str, float] = {}
        for group in sorted({key(c.name) for c, _ in points}):
            rest = [(c, y) for c, y in points if key(c.name) != group]
            fit = fitter([c for c, _ in rest], [y for _, y in rest])
            col.update({c.name: predict_case(c, fit) / y for c, y in points
                        if key(c.name) == group})
        cols[label] = col
    return cols


def held_out(points: list[tuple[Case, int]], into: Table | None = None,
             fitter: Fitter = fit_terms) -> str:
    """Every point's predicted / XLA in-sample, refitted without its case, and refitted
    without its model (the name's first word), and each column's worst and count within
    0.9–1.1 (the points' rows into ``into`` too; ``fitter`` as :func:`held_out_ratios`)."""
    cols = held_out_ratios(points, fitter)
    if into is not None:
        into.columns = ["point", *cols]
        for c, _ in points:
            into.add(c.name, *(col[c.name] for col in cols.values()))
    lines = [f"{'point':<52}" + "".join(f" {k:>13}" for k in cols)]
    lines += [f"{c.name:<52}" + "".join(f" {col[c.name]:>13.3f}" for col in cols.values())
              for c, _ in points]
    for what, f in (("worst low", min), ("worst high", max)):
        lines.append(f"{what:<52}" + "".join(f" {f(col.values()):>13.3f}"
                                             for col in cols.values()))
    lines.append(f"{'within 0.9-1.1':<52}" + "".join(
        f" {sum(0.9 <= r <= 1.1 for r in col.values()):>10}/{len(col)}"
        for col in cols.values()))
    return "\n".join(lines)


def markdown(stored: dict[str, dict[str, Any]], fitter: Fitter = fit_terms) -> str:
    """The README's table ("Memory, fitted to XLA"): a row per stored case, its compiled
    layer counts and the whole model (``a, b; whole``) for an extrapolated one, then a row
    of each column's range and count within 0.9–1.1 over every point.

    Args:
        stored: ``tests/plan/xla_memory.json``'s content.
        fitter: as :func:`held_out_ratios`.

    Returns:
        The table, in markdown.
    """
    points = stored_points(stored)
    cols = held_out_ratios(points, fitter)
    pred = {c.name: predict_case(c) for c, _ in points}
    xla = {c.name: y for c, y in points}

    def gib(v: float) -> str:
        return f"{v / 2**30:.3f}" if v < 2**30 else f"{v / 2**30:.1f}"

    def ratio(v: float) -> str:
        return f"{v:.2f}"

    def cell(names: list[str], of: dict[str, Any], f: Callable[[float], str]) -> str:
        # Compiled layer counts, then the whole model: "a, b; whole".
        return f(of[names[0]]) if len(names) == 1 else (
            ", ".join(f(of[n]) for n in names[1:]) + "; " + f(of[names[0]]))

    lines = ["| case (bench_parallel's model on the 7 layouts of "
             "`tests/train/test_parallel.py`; the default model; the \"act\" model; full "
             "size at 64 to 2,048 devices, batch of one micro-step) | devices | XLA GiB | "
             "predicted GiB | predicted / XLA | refitted without the case | "
             "without the model |", "|---|---|---|---|---|---|---|"]
    for name, row in stored.items():
        case = Case.from_json(name, row)
        names = [name] + [f"{name} L{n}" for n in (case.layers or ())]
        label = name if case.layers is None else (
            f"{name} ({', '.join(map(str, case.layers))}; {case.desc.num_layers})")
        lines.append("| " + " | ".join(
            [label, str(case.devices), cell(names, xla, gib), cell(names, pred, gib)]
            + [cell(names, col, ratio) for col in cols.values()]) + " |")
    lines.append("| " + " | ".join(
        [f"all {len(points)} points: worst low–high (within 0.9–1.1)", "", "", ""]
        + [f"{min(col.values()):.3f}–{max(col.values()):.3f} "
           f"({sum(0.9 <= r <= 1.1 for r in col.values())}/{len(col)})"
           for col in cols.values()]) + " |")
    return "\n".join(lines)


#: How many of ``meshkit plan``'s layouts ``--plan`` compiles: the first four, then
#: three spread down the rest of the ranking (at its quarters).
PLAN_FIRST, PLAN_SPREAD = 4, 3


def plan_layouts(count: int) -> list[int]:
    """The ranks ``--plan`` compiles of ``count`` ranked layouts: the first
    :data:`PLAN_FIRST`, then :data:`PLAN_SPREAD` at the quarters of the rest.

    Examples:
        >>> plan_layouts(54)
        [0, 1, 2, 3, 16, 29, 42]
    """
    rest = count - PLAN_FIRST
    spread = [PLAN_FIRST + round(rest * k / (PLAN_SPREAD + 1))
              for k in range(1, PLAN_SPREAD + 1)] if rest > 0 else []
    return list(range(min(PLAN_FIRST, count))) + sorted(set(spread))


def plan_check(devices: int, into: Table | None = None,
               report: Report | None = None) -> str:
    """``meshkit plan --devices N --json`` of the default config against XLA: each
    compiled layout's ``predicted_memory_bytes`` over argument + temp + output − alias of
    ``compile_step`` with its overrides (:func:`plan_layouts` of the ranking).

    Args:
        devices: the device count.
        into: a report table to fill.
        report: records the worst ratio low and high as targets (within 0.9–1.1).

    Returns:
        The table, as text, worst ratio last.
    """
    from meshkit.plan.config_plan import run_plan

    ranked = run_plan(None, [], devices=devices).ranked
    chosen = plan_layouts(len(ranked))
    jobs = [VerifyJob(f"#{i + 1} {ranked[i].candidate.name()}", None,
                      tuple(ranked[i].layout.overrides())) for i in chosen]
    results = verify(jobs, devices=devices,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    lines = [f"{'rank':>4}  {'layout':<28} {'predicted MiB':>14} {'XLA MiB':>10} {'ratio':>7}"]
    ratios = []
    for i, r in zip(chosen, results, strict=True):
        predicted = ranked[i].memory.total
        if r.bytes is None:
            lines.append(f"{i + 1:>4}  {ranked[i].candidate.name():<28} failed: {r.error}")
            continue
        ratios.append(predicted / r.bytes)
        lines.append(f"{i + 1:>4}  {ranked[i].candidate.name():<28} {predicted / 2**20:>14.2f} "
                     f"{r.bytes / 2**20:>10.2f} {ratios[-1]:>7.3f}")
        if into is not None:
            into.add(i + 1, ranked[i].candidate.name(), predicted, r.bytes, ratios[-1])
    if ratios and report is not None:
        report.target("lowest predicted / XLA of the layouts compiled", min(ratios), ">= 0.9")
        report.target("highest predicted / XLA of the layouts compiled", max(ratios),
                      "<= 1.1")
    if ratios:
        lines.append(f"{len(ratios)} of {len(ranked)} layouts: predicted / XLA "
                     f"{min(ratios):.3f}–{max(ratios):.3f}, "
                     f"{sum(0.9 <= x <= 1.1 for x in ratios)} within 0.9–1.1")
    return "\n".join(lines)


def refit() -> dict[str, float]:
    """The terms fitted to the stored numbers, to the fixed point the drift test checks:
    the search starts from the phases of the coefficients it is given, so refit from each
    result until it comes back unchanged."""
    points = stored_points(json.loads(STORED.read_text()))
    cases, xla = [c for c, _ in points], [y for _, y in points]
    fit = fit_terms(cases, xla)
    for _ in range(8):
        again = fit_terms(cases, xla, start=fit)
        if again == fit:
            break
        fit = again
    return fit


def apply_fit(fit: dict[str, float]) -> None:
    """Rewrite ``FIT = {...}`` in :mod:`meshkit.plan.memory_fit` with ``fit``."""
    text = SOURCE.read_text()
    start = text.index("FIT: dict[str, float] = {\n")
    end = text.index("\n}\n", start) + 3
    lines, line = [], "   "
    for item in (f'"{k}": {v},' for k, v in fit.items()):
        if len(line) + 1 + len(item) > 92:
            lines.append(line)
            line = "   "
        line += " " + item
    lines.append(line)
    SOURCE.write_text(text[:start] + "FIT: dict[str, float] = {\n" + "\n".join(lines)
                      + "\n}\n" + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, store, fit or print, as the flags say (module docstring).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        0; a usage error (``--apply`` without ``--fit``, what needs a source checkout
        without one) exits 2 before anything compiles.
    """
    parser = script.parser("plan_memory", __doc__.splitlines()[0])
    parser.add_argument("--only", choices=["small", "full"],
                        help="only these cases (default: all; small without a source "
                        "checkout)")
    parser.add_argument("--match", action="append",
                        help="only the cases whose name contains this (repeatable: any)")
    parser.add_argument("--write", action="store_true", help=f"store in {STORED}")
    parser.add_argument("--fit", action="store_true",
                        help="print the terms fitted to the stored numbers (after measuring "
                             "with --write; alone, compile nothing)")
    parser.add_argument("--apply", action="store_true",
                        help="with --fit: write the fitted terms into memory_fit.FIT")
    parser.add_argument("--held-out", action="store_true",
                        help="print each stored point's ratio in-sample and refitted without "
                             "its case and without its model; compile nothing")
    parser.add_argument("--markdown", action="store_true",
                        help="print the README's memory-fit table (a row per stored case, "
                             "with --held-out's ratios); compile nothing")
    parser.add_argument("--plan", type=int, metavar="N",
                        help="compile `meshkit plan --devices N`'s first four layouts of the "
                             "default config and three spread down the ranking, and print "
                             "predicted / XLA for each")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.apply and not args.fit:
        parser.error("--apply: only with --fit")
    if args.held_out and args.markdown:
        parser.error("--markdown: not with --held-out (it prints the same ratios)")
    checkout = MODELS.is_dir() and STORED.is_file()
    if not checkout:
        needs = [flag for flag, given in (("--only full", args.only == "full"),
                                          ("--write", args.write), ("--fit", args.fit),
                                          ("--held-out", args.held_out),
                                          ("--markdown", args.markdown)) if given]
        if needs:
            raise UsageError(f"{needs[0]}: needs a source checkout ({MODELS} and {STORED}; "
                             "meshkit runs from an installed package): use --only small")
        if args.only is None:
            print("no source checkout beside meshkit (configs/models, "
                  "tests/plan/xla_memory.json): measuring the small cases only",
                  file=sys.stderr)
            args.only = "small"
    # Compiles run in subprocesses (meshkit.plan.verify), each with its case's devices.
    report = Report("plan_memory", argv, args.json, devices=False)
    with report.printing():
        _run(args, report)
    report.write()
    return 0


def _run(args: argparse.Namespace, report: Report) -> None:
    """Do what the flags say; print the tables and fill the report's."""
    if args.plan is not None:
        print(plan_check(args.plan, report.table(
            f"meshkit plan --devices {args.plan}: predicted against XLA's memory",
            ["rank", "layout", "predicted bytes", "XLA bytes", "ratio"]), report))
        return
    if args.held_out:
        print(held_out(stored_points(json.loads(STORED.read_text())),
                       report.table("predicted / XLA per stored point: in sample, refitted "
                                    "without its case, refitted without its model", [])))
        return
    if args.markdown:
        print(markdown(json.loads(STORED.read_text())))
        return
    if args.write or not args.fit:
        t0 = time.monotonic()
        measured = measure([c for c in _cases(args.only) if not args.match
                            or any(m in c.name for m in args.match)])
        if args.write:
            stored = json.loads(STORED.read_text()) if STORED.exists() else {}
            stored.update(measured)
            STORED.write_text(json.dumps(stored, indent=1) + "\n")
        into = report.table("the planner's memory against XLA's, per device",
                            ["case", "devices", "XLA GiB", "predicted GiB", "ratio"])
        print(table(measured, into))
        print(f"({time.monotonic() - t0:.0f} s)")
        report.data["cases"] = measured
    if args.fit:
        fit = refit()
        print(json.dumps(fit, indent=1))
        report.data["fit"] = fit
        if args.apply:
            apply_fit(fit)
            print(f"written into {SOURCE}")


if __name__ == "__main__":
    raise SystemExit(script.run(main, "plan_memory"))
