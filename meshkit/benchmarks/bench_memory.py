"""Benchmark: what each layout and memory option costs, read from the compiler.

Every row compiles the toy model's train step (d_model 256, 4 layers, d_ff 512,
8 experts, vocabulary 256, batch 32×64 unless the row says otherwise) with
:func:`meshkit.training.compile_step`, then runs it. Per row, per device:

* argument, temp and output bytes, from XLA's ``compiled.memory_analysis()``;
* FLOPs, from ``compiled.cost_analysis()`` (:func:`meshkit.training.step_flops`);
* the optimizer state (:func:`meshkit.training.programs.state_bytes`, from the shapes);
* compile time (trace, lower and compile) and the median step time.

Then the issue's targets, each as a ratio of two rows (``n/a`` with the missing row's
name when a row was not measured). "Attention temp" is bounded by the whole step's: the
ratio of two steps' temp memory is at least the ratio of their attention parts when
everything else is the same.

The remat rows run at 8 layers twice: at the toy's T = 64, where the peak is the
gradients (one layer's activations are a few MiB), and at T = 512
(``dp8-L8-T512-remat-*``), where activations are most of it; each remat target line
names its T. A third pair holds T = 64 under fsdp8 (``fsdp8-L8``, ``fsdp8-L8-remat-full``),
whose gradients are sharded: what remat saves there is the activations again.

XLA's count of a pipelined step is not one device's work: it counts a loop body once,
whatever its trip count, and a conditional as its costlier branch. For the uneven-stage
row (``pp2dp4-uneven-3-1``: GPipe, M = 4, stage 0 three layers, stage 1 one) the
FLOPs are also counted as ``meshkit bench memory_pipeline --flops`` does
(:func:`meshkit.benchmarks.bench_memory_pipeline.uneven_work`): each stage's, every tick
counted, the bubble's ticks excluded; their mean (each stage has as many devices) is the per-device
figure of the target line, against dp8's (which has no loop to undercount).

Rows whose config keys this build does not have yet (``model.remat``,
``model.attention``, ``parallel.schedule``, ``parallel.virtual_stages``,
``parallel.stage_layers``, ...) are skipped, with the missing keys printed; they run as
soon as the keys exist. So are rows whose option the model refuses to build yet
(``NotImplementedError``).

``--quick`` shrinks the model (d_model 32, d_ff 32, vocabulary 32) and divides every
sequence length and attention chunk by 16, for a smoke test.

``--json FILE`` writes the report (:mod:`meshkit.benchmarks._report`): the table, the
targets, and in ``data`` every row's fields (``rows``) and the rows skipped (``skipped``);
``--json -`` writes it to stdout and the table to stderr.

Usage: meshkit bench memory [--rows A,B] [--steps N] [--quick] [--json FILE]
[key=value ...]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("memory")  # before the imports: Ctrl-C in one line, not a traceback

import argparse
import os

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from meshkit.benchmarks._report import Report, Table, add_json_flag
from meshkit.benchmarks.bench_memory_pipeline import uneven_work
from meshkit.choices import PIPELINE_SCHEDULES, REMAT_POLICIES
from meshkit.config import Config, ConfigError, all_keys, load_config
from meshkit.model.pipeline import bubble_fraction
from meshkit.training import compile_step, config_dataset, init_state, step_flops
from meshkit.training.programs import state_bytes

MODEL = ["model.d_model=256", "model.num_heads=4", "model.num_layers=4", "model.d_ff=512",
         "model.num_experts=8", "model.vocab_size=256", "train.batch_size=32",
         "train.seq_len=64"]
QUICK = ["model.d_model=32", "model.d_ff=32", "model.vocab_size=32"]
QUICK_DIVIDES = ("train.seq_len", "model.attention_chunk")  # by 16 under --quick
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
DP8 = ["mesh.axes={dp: 8}", *NO_EXPERTS]
FSDP8 = ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *NO_EXPERTS]
PP2TP4 = ["mesh.axes={pp: 2, tp: 4}", "parallel.pipeline=pp", "parallel.tensor=tp",
          *NO_EXPERTS]
PP2DP4 = ["mesh.axes={pp: 2, dp: 4}", "parallel.pipeline=pp", *NO_EXPERTS]
CHUNK = 128
#: The schedules of one chunk a stage (GPipe and 1F1B); the interleaved one has rows of
#: its own, with its virtual stages.
SCHEDULES = tuple(s for s in PIPELINE_SCHEDULES if s != "interleaved")
REMAT_T = 512  # the remat rows' second sequence length
#: The interleaved bubble's two rows: their step times' difference is the figure, a few
#: percent of each, so they time at least this many steps whatever ``--steps`` says (one
#: step's noise moved the ratio by 15 %).
BUBBLE_ROWS = ("pp2tp4-interleaved-v2-M8", "pp2tp4-interleaved-v2-M16-B64")
BUBBLE_STEPS = 7
#: Rows whose FLOPs per device are also counted stage by stage, the bubble excluded
#: (bench_memory_pipeline.uneven_work): XLA's count of one step undercounts a pipeline.
UNEVEN_ROWS = ("pp2dp4-uneven-3-1",)


def _rows() -> list[tuple[str, list[str]]]:
    """``(name, overrides)`` of every row, in print order: the issue's whole target list."""
    rows = [
        ("dp8", DP8),
        ("dp8-zero1", [*DP8, "parallel.zero1=true"]),
        ("fsdp8", FSDP8),
        ("fsdp8-L8", [*FSDP8, "model.num_layers=8"]),
        # fsdp shards the gradients that set dp8's floor at T = 64 (below).
        ("fsdp8-L8-remat-full", [*FSDP8, "model.num_layers=8", "model.remat=full"]),
    ]
    rows += [(f"dp8-L8-remat-{p}", [*DP8, "model.num_layers=8", f"model.remat={p}"])
             for p in REMAT_POLICIES]
    # At T = 64 dp8's peak is the whole float32 gradients (held until the global norm
    # clips them), not activations: under remat full they alone are 0.49 of none's temp.
    # At T = 512 activations are most of it.
    rows += [(f"dp8-L8-T{REMAT_T}-remat-{p}", [*DP8, "model.num_layers=8",
                                               f"train.seq_len={REMAT_T}", f"model.remat={p}"])
             for p in REMAT_POLICIES]
    for t in (512, 1024, 2048):
        rows.append((f"dp8-T{t}-xla", [*DP8, f"train.seq_len={t}", "model.attention=xla"]))
        rows.append((f"dp8-T{t}-chunked", [*DP8, f"train.seq_len={t}",
                                           "model.attention=chunked",
                                           f"model.attention_chunk={CHUNK}"]))
    for schedule in SCHEDULES:
        rows += [(f"pp2tp4-{schedule}-M{m}", [*PP2TP4, f"parallel.schedule={schedule}",
                                              f"parallel.microbatches={m}"])
                 for m in (4, 16, 32)]
    interleaved = [*PP2TP4, "parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    rows += [(f"pp2tp4-interleaved-v2-M{m}", [*interleaved, f"parallel.microbatches={m}"])
             for m in (4, 8, 32)]
    # The bubble's pair of M = 8: twice the microbatches of the same size.
    rows.append(("pp2tp4-interleaved-v2-M16-B64", [*interleaved, "parallel.microbatches=16",
                                                    "train.batch_size=64"]))
    rows.append(("pp2dp4-uneven-3-1", [*PP2DP4, "parallel.microbatches=4",
                                       "parallel.stage_layers=[3, 1]"]))
    return rows


ROWS = _rows()


def _quick(overrides: Sequence[str]) -> list[str]:
    """A row's overrides with its sequence length and chunk divided by 16."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        out.append(f"{key}={int(value) // 16}" if key in QUICK_DIVIDES else item)
    return out


def missing_keys(overrides: Sequence[str]) -> list[str]:
    """The keys of ``overrides`` that this build's config does not have.

    Args:
        overrides: ``key=value`` items.

    Returns:
        The unknown dotted keys, in order.
    """
    known = set(all_keys())
    return [k for k in (o.partition("=")[0] for o in overrides) if k not in known]


def measure(config: Config, steps: int) -> dict[str, Any]:
    """Compile one config's train step, read its memory and FLOPs, and time it.

    Args:
        config: the row's config.
        steps: timed steps, after one warm-up step.

    Returns:
        ``argument_bytes``, ``temp_bytes``, ``output_bytes``, ``alias_bytes``, ``flops``
        (per device; ``None`` where the backend reports none), ``params_bytes``,
        ``optimizer_bytes``,
        ``compile_s``, ``step_ms`` (median; ``None`` when the simulated devices would
        need more host memory than is available, see :func:`_host_bytes_short`).
    """
    start = time.perf_counter()
    compiled = compile_step(config)
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    state_sizes = state_bytes(config, config.strategy().mesh())
    result = {
        "argument_bytes": getattr(stats, "argument_size_in_bytes", None),
        "temp_bytes": getattr(stats, "temp_size_in_bytes", None),
        "output_bytes": getattr(stats, "output_size_in_bytes", None),
        "alias_bytes": getattr(stats, "alias_size_in_bytes", None),
        "flops": step_flops(compiled),
        "params_bytes": state_sizes.params,
        "optimizer_bytes": state_sizes.optimizer,
        "compile_s": compile_s,
        "step_ms": None,
    }
    short = _host_bytes_short(result)
    if short:
        # The simulated devices share this host's memory: running a step that needs
        # more than it has would end the whole benchmark (the kernel's OOM killer).
        print(f"  step not run: {short}", file=sys.stderr, flush=True)
        return result
    state = init_state(config)
    (_, batch_sharding), _ = compiled.input_shardings
    data, t = config_dataset(config), config.train
    batches = [jax.device_put(data.batch(i, t.batch_size, t.seq_len, seed=t.seed),
                              batch_sharding) for i in range(2)]
    state, metrics = compiled(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batches[i % 2])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    del state
    return {**result, "step_ms": statistics.median(times) * 1e3}


def _host_bytes_short(row: dict[str, Any]) -> str | None:
    """Why a row's step cannot run on this host (every simulated device's argument,
    temp and output bytes together above 80% of the memory available), or ``None``."""
    per_device = sum(row[k] or 0 for k in ("argument_bytes", "temp_bytes", "output_bytes"))
    need = per_device * jax.device_count()
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # not Linux: try it
    if need <= 0.8 * available:
        return None
    return (f"{jax.device_count()} simulated devices need {need / 2**30:.1f} GiB of host "
            f"memory, {available / 2**30:.1f} GiB available")


def _ratio(rows: dict[str, dict[str, Any]], target: str, limit: str,
           value: Any, *needs: str) -> dict[str, Any]:
    """One target line: its value from measured rows, or which rows it lacks."""
    lacking = [n for n in needs if n not in rows]
    if lacking:
        return {"target": target, "limit": limit, "value": None,
                "missing": lacking}
    try:
        got = value(*(rows[n] for n in needs))
    except TypeError:  # a step that was not run (its time is None)
        return {"target": target, "limit": limit, "value": None,
                "missing": [f"{n} (step not run)" for n in needs if rows[n]["step_ms"] is None]}
    return {"target": target, "limit": limit, "value": got}


def ratios(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets from the measured rows (``value`` ``None`` where rows lack).

    Args:
        rows: row name → :func:`measure`'s result.

    Returns:
        One dict per target: ``target``, ``limit`` (the issue's bound, as text),
        ``value`` and, when rows were not measured, ``missing``.
    """
    temp = "temp_bytes"
    out = []
    for s in SCHEDULES:
        out.append(_ratio(rows, f"{s}: compile time M=32 / M=4", "<= 1.5",
                          lambda a, b: a["compile_s"] / b["compile_s"],
                          f"pp2tp4-{s}-M32", f"pp2tp4-{s}-M4"))
    out.append(_ratio(rows, "interleaved v=2: compile time M=32 / M=4", "<= 1.5",
                      lambda a, b: a["compile_s"] / b["compile_s"],
                      "pp2tp4-interleaved-v2-M32", "pp2tp4-interleaved-v2-M4"))
    out.append(_ratio(rows, "1f1b M=16 temp / gpipe M=16 temp", "<= 0.5",
                      lambda a, b: a[temp] / b[temp], "pp2tp4-1f1b-M16", "pp2tp4-gpipe-M16"))
    out.append(_ratio(rows, "1f1b temp M=16 / M=4", "<= 1.25",
                      lambda a, b: a[temp] / b[temp], "pp2tp4-1f1b-M16", "pp2tp4-1f1b-M4"))

    def bubble(at_m: dict[str, Any], at_2m: dict[str, Any]) -> float:
        # bench parallel's method: M more microbatches of the same size cost M·τ; the
        # S − 1 bubble ticks are chunk ticks, τ / v each.
        s, v, m = 2, 2, 8
        tau = (at_2m["step_ms"] - at_m["step_ms"]) / m
        return (s - 1) * tau / v / at_m["step_ms"] / (bubble_fraction(s, v * m))

    out.append(_ratio(rows, "interleaved v=2 M=8: measured bubble / (S-1)/(v·M+S-1)",
                      "within 1 ± 0.1", bubble, "pp2tp4-interleaved-v2-M8",
                      "pp2tp4-interleaved-v2-M16-B64"))
    out.append(_ratio(rows, "chunked / xla step temp at T=2048 (bounds the attention's)",
                      "<= 0.25", lambda a, b: a[temp] / b[temp], "dp8-T2048-chunked",
                      "dp8-T2048-xla"))
    out.append(_ratio(rows, "chunked temp T=2048 / T=512 (linear: 4)", "<= 4",
                      lambda a, b: a[temp] / b[temp], "dp8-T2048-chunked", "dp8-T512-chunked"))
    for t, infix in ((64, ""), (REMAT_T, f"-T{REMAT_T}")):
        none = f"dp8-L8{infix}-remat-none"
        out.append(_ratio(rows, f"remat full / none temp at 8 layers, T={t}", "<= 0.4",
                          lambda a, b: a[temp] / b[temp], f"dp8-L8{infix}-remat-full", none))
        out.append(_ratio(rows, f"remat full / none step time at 8 layers, T={t}",
                          "<= 1.4 (report)", lambda a, b: a["step_ms"] / b["step_ms"],
                          f"dp8-L8{infix}-remat-full", none))
        out.append(_ratio(rows, f"remat save_dots / none temp at 8 layers, T={t}", "(report)",
                          lambda a, b: a[temp] / b[temp], f"dp8-L8{infix}-remat-save_dots",
                          none))
    out.append(_ratio(rows, "remat full / none temp at 8 layers, T=64, fsdp8", "<= 0.4",
                      lambda a, b: a[temp] / b[temp], "fsdp8-L8-remat-full", "fsdp8-L8"))
    out.append(_ratio(rows, "pp2 uneven [3,1] mean FLOPs/device, no bubble / dp8's",
                      "within 1 ± 0.05",
                      lambda a, b: None if not (a.get("stage_gflops") and b["flops"])
                      else sum(a["stage_gflops"]) / len(a["stage_gflops"]) * 1e9 / b["flops"],
                      "pp2dp4-uneven-3-1", "dp8"))
    out.append(_ratio(rows, "zero1 optimizer state / (dp8's / 8)", "within 1 ± 0.01",
                      lambda a, b: a["optimizer_bytes"] / (b["optimizer_bytes"] / 8),
                      "dp8-zero1", "dp8"))
    out.append(_ratio(rows, "fsdp8 temp / dp8 temp (4 layers)", "<= 0.6",
                      lambda a, b: a[temp] / b[temp], "fsdp8", "dp8"))
    out.append(_ratio(rows, "fsdp8 temp growth per layer, 4 -> 8 layers (MiB)",
                      "<= one layer's gathered weights + activations",
                      lambda a, b: (a[temp] - b[temp]) / 4 / 2**20, "fsdp8-L8", "fsdp8"))
    out.append(_ratio(rows, "one layer's gathered weights (MiB)", "(the bound above, less "
                      "activations)", lambda a, b: (a["params_bytes"] - b["params_bytes"]) * 8
                      / 4 / 2**20, "fsdp8-L8", "fsdp8"))
    for s in SCHEDULES:
        out.append(_ratio(rows, f"pp2tp4 {s}: temp M=32 / M=4", "<= 1.25",
                          lambda a, b: a[temp] / b[temp], f"pp2tp4-{s}-M32", f"pp2tp4-{s}-M4"))
    return out


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def _print_row(name: str, r: dict[str, Any], table: Table) -> None:
    flops = "n/a" if r["flops"] is None else f"{r['flops'] / 1e9:.3f}"
    print(f"{name:<32} {_mib(r['argument_bytes']):>9} {_mib(r['temp_bytes']):>9} "
          f"{_mib(r['output_bytes']):>9} {_mib(r['optimizer_bytes']):>8} {flops:>10} "
          f"{r['compile_s']:>9.1f} "
          f"{'not run' if r['step_ms'] is None else format(r['step_ms'], '.1f'):>9}",
          flush=True)

    def mib(n: int | None) -> float | None:
        return None if n is None else n / 2**20

    table.add(name, mib(r["argument_bytes"]), mib(r["temp_bytes"]), mib(r["output_bytes"]),
              mib(r["optimizer_bytes"]), None if r["flops"] is None else r["flops"] / 1e9,
              r["compile_s"], r["step_ms"])


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the rows and print the table and the targets.

    Args:
        argv: ``--rows A,B``, ``--steps N``, ``--quick``, ``--json FILE`` and config
            overrides applied to every row (before its own).

    Returns:
        0; a usage error (an unknown row, ``--steps`` below 1, a config a row or the
        overrides make invalid) exits 2 before anything compiles.
    """
    parser = script.parser("memory", __doc__.splitlines()[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated row names (default: all); see the table")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (>= 1)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller model, sequences and chunks / 16 (a smoke test)")
    add_json_flag(parser)
    parser.add_argument("overrides", nargs="*", help="config key=value overrides for every row")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    names = [n for n, _ in ROWS]
    chosen = names if args.rows is None else [n.strip() for n in args.rows.split(",")]
    unknown = [n for n in chosen if n not in names]
    if unknown or not chosen:
        parser.error(f"--rows: unknown rows {unknown}; valid: {', '.join(names)}")
    base = [*MODEL, *(QUICK if args.quick else []), *args.overrides]
    try:
        load_config(None, base)
    except ConfigError as e:
        parser.error(str(e))
    # Every row's config is checked before the first one compiles.
    configs: dict[str, Config] = {}
    overrides_of: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for name, overrides in ROWS:
        if name not in chosen:
            continue
        row = _quick(overrides) if args.quick else list(overrides)
        lacking = missing_keys(row)
        if lacking:
            skipped[name] = f"not in this build: {', '.join(lacking)}"
            continue
        overrides_of[name] = [*base, *row]
        try:
            configs[name] = load_config(None, overrides_of[name])
        except ConfigError as e:
            parser.error(f"row {name}: {e}")

    report = Report("memory", argv, args.json)
    with report.printing():
        _run(args, report, chosen, configs, overrides_of, skipped)
    report.write()
    return 0


def _run(args: argparse.Namespace, report: Report, chosen: Sequence[str],
         configs: dict[str, Config], overrides_of: dict[str, list[str]],
         skipped: dict[str, str]) -> None:
    """Measure the chosen rows, print the table and the targets, and fill the report."""
    c = load_config(None, [*MODEL, *(QUICK if args.quick else []), *args.overrides])
    m, t = c.model, c.train
    title = (f"{jax.device_count()} {jax.devices()[0].platform} devices; d_model={m.d_model} "
             f"layers={m.num_layers} d_ff={m.d_ff} experts={m.num_experts} top_k={m.top_k} "
             f"vocab={m.vocab_size} batch={t.batch_size}x{t.seq_len} unless the row says; "
             f"per device; median of {args.steps} steps (the bubble's two rows: at least "
             f"{BUBBLE_STEPS})")
    print(f"{title}\n")
    print(f"{'row':<32} {'args MiB':>9} {'temp MiB':>9} {'out MiB':>9} {'opt MiB':>8} "
          f"{'GFLOP/dev':>10} {'compile s':>9} {'step ms':>9}", flush=True)
    table = report.table(title, ["row", "args MiB", "temp MiB", "out MiB", "opt MiB",
                                 "GFLOP/dev", "compile s", "step ms"])
    results: dict[str, dict[str, Any]] = {}
    for name in chosen:
        if name in skipped:
            print(f"{name:<32} skipped: {skipped[name]}", flush=True)
            table.notes.append(f"{name} skipped: {skipped[name]}")
            continue
        try:
            steps = max(args.steps, BUBBLE_STEPS) if name in BUBBLE_ROWS else args.steps
            results[name] = measure(configs[name], steps)
        except NotImplementedError as e:
            skipped[name] = f"not built yet: {e}"
            print(f"{name:<32} skipped: {skipped[name]}", flush=True)
            table.notes.append(f"{name} skipped: {skipped[name]}")
            continue
        if name in UNEVEN_ROWS:
            work = uneven_work(overrides_of[name])
            results[name]["stage_gflops"] = [triple[2] for triple in work["stages"]]
        _print_row(name, results[name], table)
        if "stage_gflops" in results[name]:
            stages = results[name]["stage_gflops"]
            line = (f"{name}: GFLOP/dev by stage, each tick counted, bubble excluded: "
                    f"{', '.join(f'{g:.3f}' for g in stages)}; mean "
                    f"{sum(stages) / len(stages):.3f}")
            print(f"  {line.split(': ', 1)[1]}", flush=True)
            table.notes.append(line)
    targets = ratios(results)
    print(f"\n{'target':<62} {'value':>8}  limit")
    table = report.table("targets", ["target", "value", "limit", "not measured"])
    for r in targets:
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        gap = f"  (not measured: {', '.join(r['missing'])})" if "missing" in r else ""
        print(f"{r['target']:<62} {value:>8}  {r['limit']}{gap}")
        table.add(r["target"], r["value"], r["limit"], ", ".join(r.get("missing", [])) or None)
        report.target(r["target"], r["value"], r["limit"])
    report.data.update({"rows": results, "skipped": skipped})


if __name__ == "__main__":
    raise SystemExit(script.run(main, "memory"))
