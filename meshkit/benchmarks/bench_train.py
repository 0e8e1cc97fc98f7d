"""Benchmark: the MoE train step with flat vs hierarchical exchange vs GShard einsum dispatch,
and the training loop as ``meshkit train`` runs it.

All variants train the same model (the default config unless overridden) in one run, on
the default JAX backend (8 simulated CPU devices where there is no accelerator; set
``JAX_PLATFORMS=cpu`` to force them). Two tables:

* **Step**: each variant is compiled once, warmed up, then timed step by step (blocking
  on the result); median step time, tokens/s, the ratio to the GShard-style baseline
  (one-hot einsum dispatch, flat exchange), model TFLOP/s per device (training FLOPs per
  token from :mod:`meshkit.plan.flops`), MFU where the device kind's peak is known, and the
  compiler's per-device memory estimate (arguments + outputs + temporaries − aliased,
  from ``compiled.memory_analysis()``; CPU devices report no live peak).
* **Loop**: ``meshkit.training.train`` itself (data loading, the NaN check, metrics.jsonl,
  progress off), once fetching every step's metrics as soon as it finishes (the old loop,
  ``sync_every_step=True``: one step in flight) and once fetching them every
  ``train.log_every`` steps (the loop now), alternating, ``--loop-repeats`` times each;
  tokens/s as ``train`` reports it (compilation, evaluation and checkpoints excluded),
  the median per row, and the ratio to the old loop.

Usage: meshkit bench train [--steps N] [--loop-steps N] [--loop-repeats N] [--quick]
[--json FILE] [key=value ...]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("train")  # before the imports: Ctrl-C in one line, not a traceback

from meshkit.runtime.distributed import set_cpu_device_count

set_cpu_device_count(8)

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import TypedDict

import jax

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.config import Config, load_config
from meshkit.plan.flops import flops_per_token, utilization
from meshkit.training import Programs, config_dataset, train

VARIANTS = [
    ("gshard einsum + flat", ["model.dispatch=einsum", "exchange.method=flat"]),
    ("sort + flat", ["model.dispatch=sort", "exchange.method=flat"]),
    ("sort + hierarchical", ["model.dispatch=sort", "exchange.method=hierarchical"]),
    ("sort + hierarchical (device_first)",
     ["model.dispatch=sort", "exchange.method=hierarchical", "exchange.order=device_first"]),
]
QUICK = ["model.d_model=32", "model.d_ff=64", "model.num_layers=1", "train.seq_len=32"]
LOOPS = [("fetch every step (old)", True), ("fetch every log_every (now)", False)]


def _memory_mib(compiled: object) -> float | None:
    stats = compiled.memory_analysis()  # type: ignore[attr-defined]
    if stats is None:
        return None
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return total / 2**20


class Measured(TypedDict):
    """One variant's train step, as :func:`measure` times it."""

    compile_s: float
    step_ms: float  # the median
    fastest_ms: float
    tokens_per_s: float
    memory_mib: float | None  # None where the backend reports no memory analysis


def measure(overrides: Sequence[str], steps: int) -> Measured:
    """Compile and time one variant's train step.

    Args:
        overrides: config ``key=value`` overrides.
        steps: timed steps after 3 warm-up steps.

    Returns:
        ``compile_s``, ``step_ms`` (median), ``fastest_ms``, ``tokens_per_s``,
        ``memory_mib``.
    """
    config = load_config(None, list(overrides))
    t = config.train
    mesh = config.strategy().mesh()
    data = config_dataset(config)
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        state = programs.init()
        batches = [programs.put_batch(data.batch(i, t.batch_size, t.seq_len, seed=t.seed))
                   for i in range(4)]
        start = time.perf_counter()
        step = programs.train_step.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - start
        for i in range(3):
            state, metrics = step(state, batches[i % 4])
        jax.block_until_ready(metrics)
        times = []
        for i in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, batches[i % 4])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"compile_s": compile_s, "step_ms": step_s * 1e3, "fastest_ms": min(times) * 1e3,
            "tokens_per_s": t.batch_size * t.seq_len / step_s, "memory_mib": _memory_mib(step)}


def _loop_config(base: Sequence[str], steps: int) -> Config:
    """The loop rows' config: evaluation and the one checkpoint only at the end."""
    config = load_config(None, [*base, f"train.steps={steps}"])
    return config.replace(train={"eval_every": steps, "checkpoint_every": steps,
                                 "log_every": min(config.train.log_every, steps)})


def measure_loop(config: Config, *, sync_every_step: bool) -> float:
    """Run ``train`` from scratch in a fresh workdir and return its tokens/s.

    Args:
        config: the loop config (its workdir is replaced by a temporary one).
        sync_every_step: the old loop (fetch every step) or the new one.

    Returns:
        ``TrainResult.tokens_per_s``.
    """
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-") as workdir:
        result = train(config.replace(train={"workdir": workdir}), progress=False,
                       verbose=False, sync_every_step=sync_every_step)
    return result.tokens_per_s


def _rate(config: Config, tokens_per_s: float) -> tuple[float, float | None]:
    """The TFLOP/s per device and the MFU (``None``: the device's peak is unknown) of a
    throughput."""
    use = utilization(
        tokens_per_s,
        training_flops_per_token=flops_per_token(config.model,
                                                 seq_len=config.train.seq_len).training,
        devices=config.num_devices, device_kind=jax.devices()[0].device_kind,
    )
    return use.tflops_per_device, use.mfu


def _cells(rate: tuple[float, float | None]) -> tuple[str, str]:
    """The TFLOP/s-per-device and MFU cells of :func:`_rate`'s figures."""
    tflops, mfu = rate
    return f"{tflops:.3g}", "n/a" if mfu is None else f"{mfu:.1%}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments; every variant's config loads with the overrides.

    Raises:
        meshkit.config.ConfigError: an override that some variant's config refuses (exit 2).
    """
    parser = script.parser("train", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=script.positive_int, default=20,
                        help="timed steps per variant (>= 1)")
    parser.add_argument("--loop-steps", type=script.positive_int, default=40,
                        help="steps of each train() run in the loop table (>= 1)")
    parser.add_argument("--loop-repeats", type=script.positive_int, default=3,
                        help="train() runs per loop row, alternating the rows (>= 1)")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    add_json_flag(parser)
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    base = (QUICK if args.quick else []) + args.overrides
    # Every variant's config is checked before the first one compiles.
    load_config(None, base)
    for _, extra in VARIANTS:
        load_config(None, [*base, *extra])
    _loop_config(base, args.loop_steps)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every variant and print the table.

    Args:
        argv: ``--steps N``, ``--quick``, ``--json FILE`` and config overrides.

    Returns:
        0.
    """
    args = parse_args(argv)
    report = Report("train", argv, args.json)
    with report.printing():
        _run(args, report)
    report.write()
    return 0


def _run(args: argparse.Namespace, report: Report) -> None:
    """Time the variants and the loops, print both tables and fill the report's."""
    base = (QUICK if args.quick else []) + args.overrides
    config = load_config(None, base)
    loop_config = _loop_config(base, args.loop_steps)
    m = config.model
    device = jax.devices()[0]
    title = (f"{config.strategy()!r} on {jax.device_count()} {device.platform} devices "
             f"({device.device_kind}); d_model={m.d_model} layers={m.num_layers} "
             f"experts={m.num_experts} top_k={m.top_k} "
             f"batch={config.train.batch_size}x{config.train.seq_len} tokens; "
             f"median of {args.steps} steps")
    print(f"{title}\n")
    steps = report.table(title, ["variant", "compile s", "step ms", "tokens/s", "vs gshard",
                                 "TFLOP/s/dev", "MFU", "memory MiB"])
    results = {name: measure([*base, *extra], args.steps) for name, extra in VARIANTS}
    baseline = results[VARIANTS[0][0]]
    print(f"{'variant':<36} {'compile s':>9} {'step ms':>8} {'tokens/s':>9} "
          f"{'vs gshard':>9} {'TFLOP/s/dev':>11} {'MFU':>6} {'memory MiB':>10}")
    for name, r in results.items():
        mem = "n/a" if r["memory_mib"] is None else f"{r['memory_mib']:.1f}"
        rate = _rate(config, r["tokens_per_s"])
        tflops, mfu = _cells(rate)
        print(f"{name:<36} {r['compile_s']:>9.1f} {r['step_ms']:>8.1f} "
              f"{r['tokens_per_s']:>9,.0f} {baseline['step_ms'] / r['step_ms']:>8.2f}x "
              f"{tflops:>11} {mfu:>6} {mem:>10}")
        steps.add(name, r["compile_s"], r["step_ms"], r["tokens_per_s"],
                  baseline["step_ms"] / r["step_ms"], *rate, r["memory_mib"])

    t = loop_config.train
    title = (f"the training loop as meshkit train runs it: train() for {t.steps} steps, "
             f"log_every={t.log_every}, {loop_config.exchange.method} exchange, "
             f"{loop_config.model.dispatch} dispatch; median of {args.loop_repeats} runs "
             "per row, alternating")
    print(f"\n{title}\n")
    loops = report.table(title, ["loop", "tokens/s", "vs old", "TFLOP/s/dev", "MFU",
                                 "runs tokens/s"])
    runs: dict[str, list[float]] = {name: [] for name, _ in LOOPS}
    for _ in range(args.loop_repeats):
        for name, sync in LOOPS:
            runs[name].append(measure_loop(loop_config, sync_every_step=sync))
    old = statistics.median(runs[LOOPS[0][0]])
    print(f"{'loop':<36} {'tokens/s':>9} {'vs old':>7} {'TFLOP/s/dev':>11} {'MFU':>6}  runs")
    for name, values in runs.items():
        median = statistics.median(values)
        rate = _rate(loop_config, median)
        tflops, mfu = _cells(rate)
        each = " ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<36} {median:>9,.0f} {median / old:>6.2f}x {tflops:>11} {mfu:>6}  {each}")
        loops.add(name, median, median / old, *rate, each)


if __name__ == "__main__":
    raise SystemExit(script.run(main, "train"))
