"""Benchmark: all groups of a 2^20-rank, 5-axis strategy, vectorised vs a per-rank loop.

The loop is the obvious way (as Paddle's ``CommunicateTopology.get_comm_list`` does it):
for every combination of the other axes' coordinates, look each member up in a
coordinate → rank dictionary. Both produce the same groups; the table gives both times
and their ratio, measured in the same run. The vectorised time includes copying the
result, so cases where ``groups`` can return a view of the rank array are not flattered.

Usage: meshkit bench groups [--quick] [--repeats R] [--json FILE]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("groups")  # before the imports: Ctrl-C in one line, not a traceback

import argparse
import itertools
import statistics
import time
from collections.abc import Sequence

import numpy as np

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.strategy import Strategy

AXES = {"dp": 32, "pp": 8, "ep": 16, "cp": 16, "tp": 16}  # 2^20 ranks
QUICK_AXES = {"dp": 4, "pp": 4, "ep": 8, "cp": 4, "tp": 8}  # 2^12 ranks


def loop_groups(strategy: Strategy, axes: Sequence[str],
                coord2rank: dict[tuple[int, ...], int]) -> list[list[int]]:
    """Groups over ``axes`` by a per-rank Python loop over coordinates."""
    names = strategy.axis_names
    others = [a for a in names if a not in axes]
    out = []
    for rest in itertools.product(*(range(strategy.shape[a]) for a in others)):
        coord = dict(zip(others, rest, strict=True))
        group = []
        for inner in itertools.product(*(range(strategy.shape[a]) for a in axes)):
            coord.update(zip(axes, inner, strict=True))
            group.append(coord2rank[tuple(coord[a] for a in names)])
        out.append(group)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments.
    """
    parser = script.parser("groups", __doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^12 ranks instead of 2^20")
    # The median of no runs is no time at all.
    parser.add_argument("--repeats", type=script.positive_int, default=5,
                        help="timed runs per query (>= 1)")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table.

    Args:
        argv: command-line arguments (``--quick`` for a 2^12-rank strategy, ``--json FILE``
            for the report).

    Returns:
        0.
    """
    args = parse_args(argv)
    report = Report("groups", argv, args.json, devices=False)  # numpy only
    with report.printing():
        _run(args, report)
    report.write()
    return 0


def _run(args: argparse.Namespace, report: Report) -> None:
    """Time every query, print the table and fill the report's."""
    axes = QUICK_AXES if args.quick else AXES
    rng = np.random.default_rng(0)
    strategy = Strategy(
        rng.permutation(int(np.prod(list(axes.values())))).reshape(list(axes.values())), tuple(axes)
    )
    coord2rank = {
        tuple(int(c) for c in np.unravel_index(p, strategy.axis_sizes)): int(r)
        for p, r in enumerate(strategy.ranks.flat)
    }
    cases = [(a,) for a in strategy.axis_names] + [("dp", "ep"), ("cp", "tp")]
    title = f"{strategy!r}: {strategy.size:,} ranks (random permutation)"
    print(f"{title}\n")
    table = report.table(title, ["axes", "groups", "size", "vectorised ms", "loop ms",
                                 "loop/vec"],
                         notes=[f"vectorised: median of {args.repeats} runs, the result "
                                "copied; loop: one run of a per-rank Python loop"])
    print(
        f"{'axes':<8} {'groups':>9} {'size':>6} {'vectorised ms':>14} {'loop ms':>10} "
        f"{'loop/vec':>9}"
    )
    total = 0.0
    for case in cases:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            # .copy(): some groups are views of the rank array; time real memory.
            got = strategy.groups(case).copy()
            times.append(time.perf_counter() - t0)
        vec = statistics.median(times)
        total += vec
        t0 = time.perf_counter()
        want = loop_groups(strategy, case, coord2rank)
        loop = time.perf_counter() - t0
        if not np.array_equal(got, np.asarray(want)):
            raise AssertionError(f"groups over {case} differ between the two methods")
        print(
            f"{'+'.join(case):<8} {got.shape[0]:>9,} {got.shape[1]:>6} {vec * 1e3:>14.2f} "
            f"{loop * 1e3:>10.0f} {loop / vec:>8.0f}x"
        )
        table.add("+".join(case), int(got.shape[0]), int(got.shape[1]), vec * 1e3, loop * 1e3,
                  loop / vec)
    print(f"\nall {len(cases)} vectorised queries: {total * 1e3:.1f} ms in total")
    table.notes.append(f"all {len(cases)} vectorised queries: {total * 1e3:.1f} ms in total")


if __name__ == "__main__":
    raise SystemExit(script.run(main, "groups"))
