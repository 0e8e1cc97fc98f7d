"""The ``meshkit`` command line: a thin layer over the library.

``meshkit train [CONFIG] [key=value ...]``   train (embedded default config without CONFIG)
``meshkit mesh [CONFIG]``                    axes, rank array and groups of a strategy
``meshkit launch -n N -- COMMAND ...``       N local processes over jax.distributed
``meshkit plot WORKDIR``                     WORKDIR/loss.png from metrics.jsonl
``meshkit bench NAME``                       run ``benchmarks/bench_NAME.py`` (source checkout)

Bad input (config errors, bad ranks, missing files) exits with code 2 and one line that
names the problem; a diverged run exits with code 3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from meshkit.strategy import Strategy

__all__ = ["main"]

_MAX_GROUPS_SHOWN = 64


class _UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2, no traceback."""


def _default_config_text() -> str:
    return (resources.files("meshkit") / "default.yaml").read_text()


def _load_strategy(config: str | None) -> Strategy:
    import yaml

    if config is None:
        return Strategy.from_config(yaml.safe_load(_default_config_text()))
    if not Path(config).is_file():
        raise ValueError(f"config file not found: {config}")
    return Strategy.from_config(config)


def _rank_report(strategy: Strategy, rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "coords": strategy.coords(rank),
        "groups": {a: list(strategy.group(rank, a)) for a in strategy.axis_names},
        "neighbors": {a: list(strategy.neighbors(rank, a)) for a in strategy.axis_names},
    }


def _mesh_report(strategy: Strategy, rank: int | None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "axes": strategy.shape,
        "size": strategy.size,
        "ranks": strategy.ranks.tolist(),
        "groups": {a: strategy.groups(a).tolist() for a in strategy.axis_names},
    }
    if rank is not None:
        report["rank"] = _rank_report(strategy, rank)
    return report


def _print_mesh(strategy: Strategy, rank: int | None) -> None:
    print(str(strategy))
    print()
    width = max(len(a) for a in strategy.axis_names)
    print(f"{'axis':<{width}}  size  groups")
    for a in strategy.axis_names:
        groups = strategy.groups(a)
        shown = " ".join(
            "(" + ",".join(map(str, g)) + ")" for g in groups[:_MAX_GROUPS_SHOWN].tolist()
        )
        more = f" ... {len(groups)} groups" if len(groups) > _MAX_GROUPS_SHOWN else ""
        print(f"{a:<{width}}  {strategy.shape[a]:>4}  {shown}{more}")
    if rank is not None:
        r = _rank_report(strategy, rank)
        print(f"\nrank {rank}: " + ", ".join(f"{a}={c}" for a, c in r["coords"].items()))
        print(f"{'axis':<{width}}  {'group':<24}  prev  next")
        for a in strategy.axis_names:
            group = "(" + ",".join(map(str, r["groups"][a])) + ")"
            prev, nxt = r["neighbors"][a]
            print(f"{a:<{width}}  {group:<24}  {prev:>4}  {nxt:>4}")


def _cmd_mesh(args: argparse.Namespace) -> int:
    try:
        return _show_mesh(args)
    except (ValueError, ImportError) as e:  # the user's strategy, flags or missing extra
        raise _UsageError(str(e)) from e


def _show_mesh(args: argparse.Namespace) -> int:
    strategy = _load_strategy(args.config)
    if args.axis is not None and args.axis not in strategy.axis_names:
        raise ValueError(f"--axis {args.axis!r} is not an axis of {list(strategy.axis_names)}")
    if args.rank is not None:
        strategy.coords(args.rank)  # validates before printing anything
    if args.json:
        print(json.dumps(_mesh_report(strategy, args.rank), indent=2))
    else:
        _print_mesh(strategy, args.rank)
    if args.plot:
        from meshkit.plot import plot_strategy

        plot_strategy(strategy, args.axis, path=args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _split_config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def _cmd_train(args: argparse.Namespace) -> int:
    from meshkit.config import load_config
    from meshkit.distributed import initialize, num_processes_from_env, set_cpu_device_count

    path, overrides = _split_config_and_overrides(args.items)
    if path is not None and not Path(path).is_file():
        raise _UsageError(f"config file not found: {path}")
    config = load_config(path, overrides)
    try:
        # Before JAX starts: simulate the strategy's devices on CPU unless the user
        # chose a count (harmless where an accelerator is used).
        set_cpu_device_count(max(1, config.num_devices // num_processes_from_env()))
        initialize()
    except ValueError as e:  # malformed launcher variables
        raise _UsageError(str(e)) from e

    from meshkit.train import TrainingDiverged, train

    try:
        train(config, progress=None if not args.no_progress else False)
    except TrainingDiverged as e:
        print(f"meshkit train: {e}", file=sys.stderr)
        return 3
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from meshkit.launch import launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    try:
        result = launch(command, args.num_processes,
                        devices_per_process=args.devices_per_process, timeout_s=args.timeout)
    except ValueError as e:
        raise _UsageError(str(e)) from e
    return result.returncode


def _cmd_plot(args: argparse.Namespace) -> int:
    from meshkit.plot import plot_metrics

    out = args.output or os.path.join(args.workdir, "loss.png")
    try:
        plot_metrics(args.workdir, path=out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise _UsageError(str(e)) from e
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        raise _UsageError(
            f"no benchmark {args.name!r} at {script} (meshkit bench runs from a source "
            "checkout installed with pip install -e .)"
        )
    return subprocess.call([sys.executable, str(script), *args.args])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the MoE transformer")
    train.add_argument("items", nargs="*", metavar="[CONFIG] key=value",
                       help="a YAML config (default: the embedded one), then overrides")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train)

    mesh = sub.add_parser("mesh", help="show a strategy's axes, rank array and groups")
    mesh.add_argument("config", nargs="?", help="YAML config (default: the embedded one)")
    mesh.add_argument("--rank", type=int, help="show this rank's coordinates and groups")
    mesh.add_argument("--json", action="store_true", help="print JSON instead of tables")
    mesh.add_argument("--plot", metavar="FILE.png", help="draw the rank grid to a PNG")
    mesh.add_argument("--axis", help="axis whose groups colour the plot (default: innermost)")
    mesh.set_defaults(func=_cmd_mesh)

    launch = sub.add_parser("launch", help="run N local processes over jax.distributed")
    launch.add_argument("-n", "--num-processes", type=int, required=True)
    launch.add_argument("--devices-per-process", type=int,
                        help="simulated CPU devices per process (default: the command's)")
    launch.add_argument("--timeout", type=float, default=60.0,
                        help="seconds within which the others end after one fails")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    launch.set_defaults(func=_cmd_launch)

    plot = sub.add_parser("plot", help="draw WORKDIR/loss.png from WORKDIR/metrics.jsonl")
    plot.add_argument("workdir")
    plot.add_argument("-o", "--output", help="PNG path (default: WORKDIR/loss.png)")
    plot.set_defaults(func=_cmd_plot)

    bench = sub.add_parser("bench", help="run a benchmark (groups, exchange, train, parallel, moe)")
    bench.add_argument("name", choices=["groups", "exchange", "train", "parallel", "moe"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``meshkit`` command line.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 for bad input (with a message on stderr).

    Example:
        >>> main(["mesh", "--rank", "5"])  # the default strategy; rank 5's groups
        Strategy(node=2, device=4)
        [[0 1 2 3]
         [4 5 6 7]]
        <BLANKLINE>
        axis    size  groups
        node       2  (0,4) (1,5) (2,6) (3,7)
        device     4  (0,1,2,3) (4,5,6,7)
        <BLANKLINE>
        rank 5: node=1, device=1
        axis    group                     prev  next
        node    (1,5)                        1     1
        device  (4,5,6,7)                    4     6
        0
    """
    from meshkit.config import ConfigError

    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (_UsageError, ConfigError) as e:
        print(f"meshkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
