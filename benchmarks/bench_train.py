"""Benchmark: the MoE train step with flat vs hierarchical exchange vs GShard einsum dispatch.

All variants train the same model (the default config unless overridden) on 8 simulated
CPU devices in one run. Each variant is compiled once, warmed up, then timed step by step
(blocking on the result); the table shows the median step time, tokens/s, the ratio to
the GShard-style baseline (one-hot einsum dispatch, flat exchange) and the compiler's
per-device memory estimate (arguments + outputs + temporaries − aliased, from
``compiled.memory_analysis()``; CPU devices report no live peak).

Usage: python benchmarks/bench_train.py [--steps N] [--quick] [key=value ...]
"""

from __future__ import annotations

import os

from meshkit.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import argparse
import statistics
import time
from collections.abc import Sequence

import jax

from meshkit.config import ConfigError, load_config
from meshkit.data import make_dataset
from meshkit.train import Programs

VARIANTS = [
    ("gshard einsum + flat", ["model.dispatch=einsum", "exchange.method=flat"]),
    ("sort + flat", ["model.dispatch=sort", "exchange.method=flat"]),
    ("sort + hierarchical", ["model.dispatch=sort", "exchange.method=hierarchical"]),
    ("sort + hierarchical (device_first)",
     ["model.dispatch=sort", "exchange.method=hierarchical", "exchange.order=device_first"]),
]
QUICK = ["model.d_model=32", "model.d_ff=64", "model.num_layers=1", "train.seq_len=32"]


def _memory_mib(compiled: object) -> float | None:
    stats = compiled.memory_analysis()  # type: ignore[attr-defined]
    if stats is None:
        return None
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return total / 2**20


def measure(overrides: Sequence[str], steps: int) -> dict[str, float | None]:
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
    data = make_dataset(config.data.kind, path=config.data.path,
                        vocab_size=config.model.vocab_size, order=config.data.order,
                        seed=config.data.seed, concentration=config.data.concentration)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run every variant and print the table.

    Args:
        argv: ``--steps N``, ``--quick`` and config overrides.

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (>= 1)")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    base = (QUICK if args.quick else []) + args.overrides
    # Every variant's config is checked before the first one compiles.
    try:
        config = load_config(None, base)
        for _, extra in VARIANTS:
            load_config(None, [*base, *extra])
    except ConfigError as e:
        parser.error(str(e))
    m = config.model
    print(f"{config.strategy()!r} on {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"d_model={m.d_model} layers={m.num_layers} experts={m.num_experts} top_k={m.top_k} "
          f"batch={config.train.batch_size}x{config.train.seq_len} tokens; "
          f"median of {args.steps} steps\n")
    results = {name: measure([*base, *extra], args.steps) for name, extra in VARIANTS}
    baseline = results[VARIANTS[0][0]]
    print(f"{'variant':<36} {'compile s':>9} {'step ms':>8} {'tokens/s':>9} "
          f"{'vs gshard':>9} {'memory MiB':>10}")
    for name, r in results.items():
        mem = "n/a" if r["memory_mib"] is None else f"{r['memory_mib']:.1f}"
        print(f"{name:<36} {r['compile_s']:>9.1f} {r['step_ms']:>8.1f} "
              f"{r['tokens_per_s']:>9,.0f} {baseline['step_ms'] / r['step_ms']:>8.2f}x "
              f"{mem:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
