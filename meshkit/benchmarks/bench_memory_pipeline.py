"""Benchmark: memory, FLOPs and compile time of each pipeline schedule as M grows.

Each row compiles one train step (:func:`meshkit.training.compile_step`: lowering and XLA
compilation, no run) of the toy model of the memory issue, pp2·tp4 with ``d_model=256``,
4 layers, 8 experts and a 32×64 batch, under one schedule and ``M`` microbatches, and
reads from the compiled program:

* argument, temp and output bytes per device (``compiled.memory_analysis()``);
* FLOPs per device (``compiled.cost_analysis()``, :func:`meshkit.training.step_flops`);
* the seconds ``compile_step`` took.

The batch is fixed, so a microbatch shrinks as ``M`` grows: a schedule whose temp memory
holds every microbatch's activations stays flat, one that holds every *tick's* values
grows. Below the table, the issue's targets: compile time at the largest ``M`` against
the smallest, per schedule; 1F1B's temp memory against GPipe's at the middle ``M`` and
against its own at the smallest; temp memory at the largest ``M`` against the smallest.

XLA's cost analysis counts a loop's body once, whatever its trip count, so the FLOPs
column of a scanned schedule is the work outside the tick loop plus two ticks (tick 0
runs before the loop).

``--flops`` compares one device's FLOPs of a pipeline layout with pure data parallelism
on the same devices instead (``pp2·dp4`` against ``dp8``), the bubble excluded. Each
pipeline row is compiled twice, as it runs and with its tick loop unrolled (``jax.lax.scan``
with ``unroll=True``, for the count only): the difference is ``ticks − 2`` ticks, which
gives one tick's FLOPs ``τ``; the unrolled count less the bubble's ticks (``S − 1`` of
GPipe's ``M + S − 1``, ``2S − 2`` of 1F1B's ``M + 2S − 2``) times ``τ`` is the work a
pipeline does, to set beside dp8's.

Then the same with uneven stages (``--stage-layers``, default ``3,1``: stage 0 holds 3
of the 4 layers, stage 1 one; GPipe and 1F1B, which take them). Every stage holds
``max(stage_layers)`` slots, and a slot past its stage's count is skipped by a
``jax.lax.cond`` on the stage's index. The program is one for all devices, and XLA's cost
analysis counts a conditional as its costlier branch, so its count is that of a stage
running every slot, whatever the stage. What a device of stage ``s`` runs is measured
instead: each uneven row is compiled with every such cond replaced by its taken branch,
once with every slot run and once with none (``_taken_conds``; everything else is the
same program), each rolled and unrolled as above. The slots are alike, so the
difference is ``max(stage_layers)`` slots' work (forward and backward, every tick) and a
device of stage ``s`` does the no-slot count plus ``stage_layers[s]`` slots' share. The
stages have as many devices each, so the mean over the stages is the mean per device:
the figure to set beside dp8's (within 5% is the memory issue's target). The slowest
stage's (stage 0's) is printed too: uneven stages trade an even load for layers placed
where memory is, not FLOPs for FLOPs.

``--schedules gpipe,1f1b,interleaved`` adds the interleaved schedule with 2 virtual
stages (its ticks ``2M + S − 1``).

Usage: meshkit bench memory_pipeline [--schedules gpipe,1f1b,interleaved]
[--microbatches 4,16,32] [--repeats N] [--quick] [--flops [--stage-layers 3,1]]
[--json FILE] [key=value ...]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("memory_pipeline")  # before the imports: Ctrl-C in one line, not a traceback

import os

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.config import load_config
from meshkit.model.transformer import skip_slots_by_cond
from meshkit.training import compile_step, step_flops

MODEL = ["model.d_model=256", "model.num_heads=4", "model.num_layers=4", "model.d_ff=512",
         "model.num_experts=8", "model.vocab_size=256", "train.batch_size=32",
         "train.seq_len=64"]
QUICK = ["model.d_model=64", "model.d_ff=128", "model.vocab_size=64", "train.seq_len=16"]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
PP_TP = ["mesh.axes={pp: 2, tp: 4}", "parallel.pipeline=pp", "parallel.tensor=tp",
         *NO_EXPERTS]
PP_DP = ["mesh.axes={pp: 2, dp: 4}", "parallel.pipeline=pp", *NO_EXPERTS]
DP = ["mesh.axes={dp: 8}", *NO_EXPERTS]
MIB = 2**20


def measure(overrides: Sequence[str], repeats: int = 1) -> dict[str, float]:
    """Compile one train step and read its memory, FLOPs and compile time.

    Args:
        overrides: config ``key=value`` overrides.
        repeats: compilations (each from scratch); the fastest one's time is kept, the
            least disturbed by other work on the machine.

    Returns:
        ``argument``, ``temp``, ``output`` (MiB per device), ``gflops`` (per device,
        0 where the backend counts none) and ``compile_s``.
    """
    config = load_config(None, list(overrides))
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = compile_step(config)
        seconds = min(seconds, time.perf_counter() - start)
    stats = compiled.memory_analysis()
    if stats is None:
        raise SystemExit(f"{jax.devices()[0].platform}: XLA reports no memory analysis")
    return {
        "argument": stats.argument_size_in_bytes / MIB,
        "temp": stats.temp_size_in_bytes / MIB,
        "output": stats.output_size_in_bytes / MIB,
        "gflops": (step_flops(compiled) or 0.0) / 1e9,
        "compile_s": seconds,
    }


#: Chunks per stage of the ``interleaved`` rows (4 layers over 2 stages: 2 of 1 layer).
VIRTUAL_STAGES = 2


def _ticks(schedule: str, m: int, stages: int) -> int:
    v = VIRTUAL_STAGES if schedule == "interleaved" else 1
    return v * m + stages - 1 + (stages - 1 if schedule == "1f1b" else 0)


def _schedule(schedule: str) -> list[str]:
    """The overrides of a schedule (interleaved: with its virtual stages)."""
    return [f"parallel.schedule={schedule}",
            *([f"parallel.virtual_stages={VIRTUAL_STAGES}"] if schedule == "interleaved" else [])]


def schedules_table(base: Sequence[str], schedules: Sequence[str],
                    microbatches: Sequence[int], report: Report, *, title: str = "",
                    repeats: int = 1) -> dict[tuple[str, int], dict[str, float]]:
    """Print one row per schedule and ``M``, then the target ratios (into ``report`` too,
    as a table titled ``title`` and its targets); return the rows."""
    print(f"{'schedule':<9} {'M':>3} {'arg MiB':>8} {'temp MiB':>9} {'out MiB':>8} "
          f"{'GFLOPs':>8} {'compile s':>9}", flush=True)
    table = report.table(title, ["schedule", "M", "arg MiB", "temp MiB", "out MiB", "GFLOPs",
                                 "compile s"])
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for schedule in schedules:
        for m in microbatches:
            r = measure([*base, *PP_TP, *_schedule(schedule),
                         f"parallel.microbatches={m}"], repeats)
            rows[schedule, m] = r
            print(f"{schedule:<9} {m:>3} {r['argument']:>8.1f} {r['temp']:>9.1f} "
                  f"{r['output']:>8.1f} {r['gflops']:>8.2f} {r['compile_s']:>9.1f}", flush=True)
            table.add(schedule, m, r["argument"], r["temp"], r["output"], r["gflops"],
                      r["compile_s"])
    lo, mid, hi = microbatches[0], microbatches[len(microbatches) // 2], microbatches[-1]
    print()
    for schedule in schedules:
        a, b = rows[schedule, lo], rows[schedule, hi]
        print(f"{schedule}: compile M={hi} / M={lo} = {b['compile_s'] / a['compile_s']:.2f}x "
              f"(target <= 1.5); temp M={hi} / M={lo} = {b['temp'] / a['temp']:.2f}x "
              "(target <= 1.25)")
        report.target(f"{schedule}: compile time M={hi} / M={lo}",
                      b["compile_s"] / a["compile_s"], "<= 1.5")
        report.target(f"{schedule}: temp M={hi} / M={lo}", b["temp"] / a["temp"], "<= 1.25")
    if "gpipe" in schedules and "1f1b" in schedules:
        one, gp = rows["1f1b", mid], rows["gpipe", mid]
        print(f"1f1b / gpipe temp at M={mid} = {one['temp'] / gp['temp']:.2f}x (target <= 0.5); "
              f"1f1b temp M={mid} / M={lo} = {one['temp'] / rows['1f1b', lo]['temp']:.2f}x "
              "(target <= 1.25)")
        report.target(f"1f1b / gpipe temp at M={mid}", one["temp"] / gp["temp"], "<= 0.5")
        report.target(f"1f1b temp M={mid} / M={lo}", one["temp"] / rows["1f1b", lo]["temp"],
                      "<= 1.25")
    return rows


@contextlib.contextmanager
def _unrolled_scans() -> Iterator[None]:
    """Every ``jax.lax.scan`` traced meanwhile unrolled, so XLA counts each tick."""
    scan = jax.lax.scan
    jax.lax.scan = functools.partial(scan, unroll=True)
    try:
        yield
    finally:
        jax.lax.scan = scan


@contextlib.contextmanager
def _taken_conds(branch: bool) -> Iterator[None]:
    """Every ``jax.lax.cond`` traced meanwhile replaced by one of its branches (``True``:
    the first), the same on every device, so XLA counts that branch's work alone."""
    cond = jax.lax.cond

    def taken(pred: Any, true_fun: Any, false_fun: Any, *operands: Any, **_: Any) -> Any:
        return (true_fun if branch else false_fun)(*operands)

    jax.lax.cond = taken
    try:
        with skip_slots_by_cond():
            yield
    finally:
        jax.lax.cond = cond


def pipeline_work(overrides: Sequence[str]) -> tuple[float, float, float]:
    """``(unrolled, tick, no bubble)`` GFLOPs per device of a pipelined config's step:
    its count with every scan unrolled, one tick's (from the rolled count), and the
    unrolled count less the bubble's ticks."""
    config = load_config(None, list(overrides))
    p = config.parallel
    if p.pipeline is None:
        raise ValueError("pipeline_work: the overrides set no parallel.pipeline")
    stages = config.mesh.strategy().shape[p.pipeline]
    ticks = _ticks(p.schedule, p.microbatches, stages)
    rolled = measure(overrides)["gflops"]
    with _unrolled_scans():
        unrolled = measure(overrides)["gflops"]
    tick = (unrolled - rolled) / (ticks - 2)
    return unrolled, tick, unrolled - (ticks - p.microbatches) * tick


def uneven_work(overrides: Sequence[str]) -> dict[str, Any]:
    """What each stage's devices run of an uneven-stage pipeline (``parallel.stage_layers``),
    its unused slots skipped, by :func:`pipeline_work` with the slots' conds taken (see
    the module docstring).

    Args:
        overrides: config overrides with ``parallel.stage_layers``.

    Returns:
        ``stages`` (one ``(unrolled, tick, no bubble)`` GFLOPs triple per stage),
        ``mean`` (the triple averaged over the stages: over the devices) and ``every_slot``
        (every stage running all its slots: what XLA counts of the real program, and
        what a select in place of the cond would run).
    """
    counts = load_config(None, list(overrides)).parallel.stage_layers
    if not counts:
        raise ValueError("uneven_work: the overrides set no parallel.stage_layers")
    with _taken_conds(True):
        full = pipeline_work(overrides)
    with _taken_conds(False):
        none = pipeline_work(overrides)
    width = max(counts)
    stages = [tuple(z + n / width * (f - z) for f, z in zip(full, none, strict=True))
              for n in counts]
    mean = tuple(sum(col) / len(stages) for col in zip(*stages, strict=True))
    return {"stages": stages, "mean": mean, "every_slot": full}


def flops_table(base: Sequence[str], schedules: Sequence[str], m: int, report: Report,
                stage_layers: Sequence[int] = (), *, title: str = "") -> None:
    """Per-device FLOPs of pp2·dp4 per schedule against dp8's, the bubble excluded; with
    ``stage_layers``, also of those uneven stages (GPipe and 1F1B), per stage and mean
    (into ``report`` too, as a table titled ``title``)."""
    dp = measure([*base, *DP])["gflops"]
    print(f"{'layout':<28} {'GFLOPs':>8} {'1 tick':>7} {'no bubble':>9} {'vs dp8':>7}")
    table = report.table(title, ["layout", "GFLOPs", "1 tick", "no bubble", "vs dp8"],
                         notes=[f"M={m}; GFLOPs: XLA's count with every scan unrolled; no "
                                "bubble: that less the bubble's ticks"])

    def row(name: str, unrolled: float, tick: float | None, work: float, *,
            label: str | None = None) -> None:
        cell = "" if tick is None else f"{tick:.3f}"
        print(f"{name:<28} {unrolled:>8.3f} {cell:>7} {work:>9.3f} {work / dp:>6.3f}x",
              flush=True)
        table.add(label or name, unrolled, tick, work, work / dp)

    row("dp8", dp, None, dp)
    for schedule in schedules:
        row(f"pp2·dp4 {schedule}", *pipeline_work(
            [*base, *PP_DP, *_schedule(schedule), f"parallel.microbatches={m}"]))
    if not stage_layers:
        return
    cut = "-".join(map(str, stage_layers))
    for schedule in (s for s in schedules if s != "interleaved"):
        overrides = [*base, *PP_DP, *_schedule(schedule), f"parallel.microbatches={m}",
                     f"parallel.stage_layers=[{', '.join(map(str, stage_layers))}]"]
        work = uneven_work(overrides)
        for s, triple in enumerate(work["stages"]):
            row(f"pp2·dp4 {schedule} {cut} stage {s}", *triple)
        row(f"pp2·dp4 {schedule} {cut} mean", *work["mean"])
        row("  every slot run (XLA's count)", *work["every_slot"],
            label=f"pp2·dp4 {schedule} {cut} every slot run (XLA's count)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table (or ``--flops``) and print it.

    Args:
        argv: ``--schedules``, ``--microbatches``, ``--quick``, ``--flops``,
            ``--stage-layers``, ``--repeats``, ``--json FILE`` and config overrides for
            every row.

    Returns:
        0.
    """
    parser = script.parser("memory_pipeline", __doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated schedules")
    parser.add_argument("--microbatches", default="4,16,32", help="comma-separated M values")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--flops", action="store_true",
                        help="FLOPs of pp2·dp4 against dp8 at the first M instead")
    parser.add_argument("--stage-layers", default="3,1",
                        help="with --flops: uneven stages to measure too ('' for none)")
    parser.add_argument("--repeats", type=script.positive_int, default=1,
                        help="compilations per row; the fastest is shown")
    add_json_flag(parser)
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    base = [*MODEL, *(QUICK if args.quick else []), *args.overrides]
    schedules = args.schedules.split(",")
    microbatches = [int(m) for m in args.microbatches.split(",")]
    stage_layers: list[int] = []
    try:
        stage_layers = [int(n) for n in args.stage_layers.split(",") if n.strip()]
        if args.flops and stage_layers:
            load_config(None, [*base, *PP_DP, f"parallel.stage_layers={stage_layers}"])
    except ValueError as e:  # ConfigError is one
        parser.error(f"--stage-layers {args.stage_layers!r}: {e}")
    m, t = load_config(None, base).model, load_config(None, base).train
    report = Report("memory_pipeline", argv, args.json)
    with report.printing():
        title = (f"{jax.device_count()} {jax.devices()[0].platform} devices; "
                 f"d_model={m.d_model} layers={m.num_layers} d_ff={m.d_ff} "
                 f"experts={m.num_experts} vocab={m.vocab_size} "
                 f"batch={t.batch_size}x{t.seq_len}; per device, from XLA's memory_analysis "
                 "and cost_analysis of the compiled train step")
        print(f"{title}\n", flush=True)
        if args.flops:
            flops_table(base, schedules, microbatches[0], report, stage_layers, title=title)
        else:
            schedules_table(base, schedules, microbatches, report, title=title,
                            repeats=args.repeats)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "memory_pipeline"))
