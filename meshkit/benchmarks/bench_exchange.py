"""Benchmark: flat vs two-stage all-to-all on 8 simulated CPU devices, plus predictions.

Run ``meshkit bench exchange [--quick] [--repeats R] [--json FILE]``. It times, in one
run, ``jax.lax.all_to_all`` over all devices (flat) and
``meshkit.hierarchical_all_to_all`` in both orders on a 2 × 4 and a 4 × 2 mesh, for
MoE-style dispatch buffers ``[P, C, 256]`` float32 (split the expert dimension, join
along capacity) of 64 KiB to 16 MiB per device. Each time is the median of ``R`` runs
after warm-up, with the methods interleaved so that load from other processes hits them
alike. Then it prints the cost model's predictions for the presets at 16, 128 and 2,048
GPUs.

On one host every "link" is a memory copy, so the two-stage exchange cannot win here:
the table measures its overhead (a second collective and one more pass over the data).
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("exchange")  # before the imports: Ctrl-C in one line, not a traceback

import os

# Before JAX starts its backend: 8 simulated CPU devices.
from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.exchange import cost
from meshkit.exchange.two_stage import hierarchical_all_to_all

KiB, MiB = 2**10, 2**20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
QUICK_SIZES = (64 * KiB, 1 * MiB, 16 * MiB)
MESHES = ((2, 4), (4, 2))
MODEL_DIM = 256
AXES = ("node", "device")
PREDICTION_GPUS = (16, 128, 2048)
PREDICTION_SIZES = (1 * MiB, 16 * MiB, 256 * MiB)


def _methods() -> dict[str, Callable[[jax.Array], jax.Array]]:
    return {
        "flat": lambda b: jax.lax.all_to_all(b, AXES, 0, 1, tiled=True),
        "node_first": lambda b: hierarchical_all_to_all(b, 0, 1, order="node_first"),
        "device_first": lambda b: hierarchical_all_to_all(b, 0, 1, order="device_first"),
    }


def _size(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


def time_exchange(
    mesh_shape: tuple[int, int], bytes_per_device: int, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each method for one mesh and buffer size.

    Args:
        mesh_shape: ``(N, M)``, nodes × devices per node; ``N·M`` devices must exist.
        bytes_per_device: size of each device's float32 buffer ``[P, C, 256]``.
        repeats: timed calls per method, after two warm-up calls.

    Returns:
        Method name (``"flat"``, ``"node_first"``, ``"device_first"``) -> median seconds.

    Raises:
        ValueError: ``bytes_per_device`` does not give a whole capacity ``C``.
        AssertionError: a two-stage result differs from the flat one.

    Examples:
        >>> times = time_exchange((2, 4), 64 * KiB, repeats=1)
        >>> sorted(times), all(t > 0 for t in times.values())
        (['device_first', 'flat', 'node_first'], True)
    """
    p = mesh_shape[0] * mesh_shape[1]
    capacity, rem = divmod(bytes_per_device, p * MODEL_DIM * 4)
    if rem or not capacity:
        raise ValueError(f"{bytes_per_device} bytes is not a whole [P={p}, C, {MODEL_DIM}] f32")
    mesh = Mesh(np.array(jax.devices()[:p]).reshape(mesh_shape), AXES)
    spec = P(AXES)
    x = jax.device_put(
        jnp.arange(p * p * capacity * MODEL_DIM, dtype=jnp.float32).reshape(
            p * p, capacity, MODEL_DIM
        ),
        NamedSharding(mesh, spec),
    )
    fns = {
        name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
        for name, f in _methods().items()
    }
    expected = np.asarray(fns["flat"](x))
    for name, f in fns.items():
        np.testing.assert_array_equal(np.asarray(f(x)), expected, err_msg=name)
        f(x).block_until_ready()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            f(x).block_until_ready()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _print_measurements(sizes: Sequence[int], repeats: int, report: Report) -> None:
    platform = jax.devices()[0].platform
    title = (f"Measured on {jax.device_count()} {platform} devices, median of {repeats} runs "
             "(ms); ratio = two-stage / flat")
    print(title)
    table = report.table(title, ["mesh", "bytes per device", "flat ms", "node_first ms",
                                 "device_first ms", "nf/flat", "df/flat"])
    header = (
        f"{'mesh':>5} {'per device':>10} {'flat':>9} {'node_first':>10} "
        f"{'device_first':>12} {'nf/flat':>8} {'df/flat':>8}"
    )
    print(header)
    print("-" * len(header))
    for mesh_shape in MESHES:
        for nbytes in sizes:
            t = time_exchange(mesh_shape, nbytes, repeats)
            flat, nf, df = t["flat"], t["node_first"], t["device_first"]
            print(
                f"{mesh_shape[0]}x{mesh_shape[1]:<3} {_size(nbytes):>10} {flat * 1e3:9.3f} "
                f"{nf * 1e3:10.3f} {df * 1e3:12.3f} {nf / flat:8.2f} {df / flat:8.2f}",
                flush=True,
            )
            table.add(f"{mesh_shape[0]}x{mesh_shape[1]}", nbytes, flat * 1e3, nf * 1e3,
                      df * 1e3, nf / flat, df / flat)


def _print_predictions(report: Report) -> None:
    print()
    title = "Cost model (meshkit.exchange.cost), predicted µs per all-to-all:"
    print(title)
    table = report.table(title.rstrip(":"), ["preset", "GPUs", "bytes per device", "flat µs",
                                             "hierarchical µs", "ratio", "chosen"])
    header = (
        f"{'preset':>12} {'GPUs':>5} {'per device':>10} {'flat':>10} "
        f"{'hierarchical':>12} {'ratio':>6} {'chosen':>12}"
    )
    print(header)
    print("-" * len(header))
    for name in cost.PRESETS:
        for gpus in PREDICTION_GPUS:
            topology = cost.preset(name, nodes=gpus // 8)
            for nbytes in PREDICTION_SIZES:
                flat = cost.predict("flat", nbytes, topology)
                hier = cost.predict("hierarchical", nbytes, topology)
                print(
                    f"{name:>12} {gpus:>5} {_size(nbytes):>10} {flat * 1e6:10.1f} "
                    f"{hier * 1e6:12.1f} {hier / flat:6.2f} {cost.choose(nbytes, topology):>12}"
                )
                table.add(name, gpus, nbytes, flat * 1e6, hier * 1e6, hier / flat,
                          cost.choose(nbytes, topology))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments.
    """
    parser = script.parser("exchange", __doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 sizes, 5 repeats")
    parser.add_argument("--repeats", type=script.positive_int, default=None,
                        help="timed runs per method (>= 1)")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print both tables.

    Args:
        argv: command-line arguments without the program name (default ``sys.argv[1:]``):
            ``--quick`` (3 sizes, 5 repeats), ``--repeats R`` and ``--json FILE``.

    Returns:
        0 on success, 2 when fewer than 8 devices are available (JAX was started before
        this module could ask for 8 simulated CPU devices).

    Raises:
        AssertionError: a two-stage result differs from the flat one.

    Example::

        main(["--quick"])  # 0, after printing the table (meshkit bench exchange --quick)
    """
    args = parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 21)
    if jax.device_count() < 8:
        print(
            f"bench_exchange needs 8 devices, found {jax.device_count()}; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
            file=sys.stderr,
        )
        return 2
    report = Report("exchange", argv, args.json)
    with report.printing():
        _print_measurements(QUICK_SIZES if args.quick else SIZES, repeats, report)
        _print_predictions(report)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "exchange"))
