"""The ``meshkit`` command line: a thin layer over the library.

:func:`main` is the one place errors become exit codes (:data:`meshkit.errors.EXIT_CODES`):
meshkit's own errors (:class:`meshkit.errors.MeshkitError`) print one line naming the
problem and exit with their code (2 bad input, 3 a diverged run, 4 preempted, 126/127 a
command ``meshkit launch`` cannot run); anything else is a bug and keeps its traceback.
Each command's help (:data:`_COMMANDS`) has a description and an example; the docs'
command-line reference is generated from it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from meshkit._version import __version__
from meshkit.choices import BENCHMARKS, ROLES
from meshkit.cli.ending import (
    DEBUG_VARIABLE,
    STOP_SIGNALS,
    OneLineParser,
    debugging,
    exit_code,
    leave_now,
    signal_ending,
    silence_stdout,
    stop_at_once,
)
from meshkit.cli.logs import log_to_stderr
from meshkit.cli.script import raise_interrupt
from meshkit.errors import (
    EXIT_INTERRUPTED,
    EXIT_PEER_LOST,
    EXIT_USAGE,
    MeshkitError,
    UsageError,
)
from meshkit.runtime.launch import DEFAULT_GRACE_S

if TYPE_CHECKING:
    from meshkit.config import Config
    from meshkit.plan.measured import MeasuredModel
    from meshkit.plan.model_desc import ModelDesc

__all__ = ["main", "run"]

_MAX_GROUPS_SHOWN = 64
_BENCH_GRACE_S = 10.0  # after a forwarded signal, the benchmark's time to stop
# Subcommands whose positional items are [CONFIG] key=value ...; their flags may stand
# anywhere among the items.
_ITEM_COMMANDS = ("train", "mesh", "plan")


class _StopSignals:
    """SIGINT, SIGTERM and SIGHUP end the command at once, with one line and 130, 143 or 129.

    Entered first thing in :func:`main`, before the commands import JAX: Python's own
    handling would raise ``KeyboardInterrupt`` in the middle of an import (a traceback,
    or a crash at exit, 139) and SIGTERM or SIGHUP would end the process without a word.
    Where a command has something to clean up it takes over: :meth:`interruptible` makes
    Ctrl-C raise ``KeyboardInterrupt`` again (``main`` reports it), and training installs
    its own SIGTERM and SIGHUP handler (checkpoint, then exit 4), putting this one back
    after. The process groups a command started are killed on the way out
    (:func:`meshkit.cli.ending.stop_at_once`).
    """

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self._previous: dict[int, Any] = {}
        self._stopping = False

    def __enter__(self) -> _StopSignals:
        # Python runs handlers in the main thread only (a caller's worker thread: no-op).
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._stop)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping:  # a second signal, run inside the first handler: one line
            return
        self._stopping = True
        stop_at_once(self.prog, signum)

    def retake_sigterm(self) -> None:
        """Reinstall the SIGTERM handler (``jax.distributed.initialize`` replaces it)."""
        if signal.SIGTERM in self._previous:
            signal.signal(signal.SIGTERM, self._stop)

    def interruptible(self) -> None:
        """From here Ctrl-C raises ``KeyboardInterrupt``, so clean-up code runs."""
        if signal.SIGINT in self._previous:
            # Python's own, except where it would be dropped (a gc callback of JAX's).
            signal.signal(signal.SIGINT, raise_interrupt)


def _role_axes(config: Config) -> dict[str, tuple[str, ...]]:
    """Each role that some mesh axis has → its axes (mesh order; expert: node, device)."""
    out = {role: config.axes_with_role(role) for role in ROLES}
    out["expert"] = config.expert_axes
    return {role: axes for role, axes in out.items() if axes}


def _rank_report(config: Config, rank: int) -> dict[str, Any]:
    strategy = config.strategy()
    roles: dict[str, Any] = {}
    for role, axes in _role_axes(config).items():
        roles[role] = {"axes": list(axes), "group": list(strategy.group(rank, axes))}
        if role == "pipeline":
            roles[role]["neighbors"] = list(strategy.neighbors(rank, axes[0]))
        elif role == "context":  # where `ring` sends its K/V blocks, and takes them from
            group = roles[role]["group"]
            i = group.index(rank)
            roles[role]["neighbors"] = [group[i - 1], group[(i + 1) % len(group)]]
    return {
        "rank": rank,
        "coords": strategy.coords(rank),
        "groups": {a: list(strategy.group(rank, a)) for a in strategy.axis_names},
        "neighbors": {a: list(strategy.neighbors(rank, a)) for a in strategy.axis_names},
        "roles": roles,
    }


def _mesh_report(config: Config, rank: int | None) -> dict[str, Any]:
    strategy = config.strategy()
    report: dict[str, Any] = {
        "axes": strategy.shape,
        "roles": config.roles,
        "no_role_given": list(config.unnamed_axes),
        "size": strategy.size,
        "ranks": strategy.ranks.tolist(),
        "groups": {a: strategy.groups(a).tolist() for a in strategy.axis_names},
    }
    if rank is not None:
        report["rank"] = _rank_report(config, rank)
    return report


def _group_text(group: Sequence[int]) -> str:
    return "(" + ",".join(map(str, group)) + ")"


def _print_mesh(config: Config, rank: int | None) -> None:
    strategy = config.strategy()
    roles = {a: config.role_label(a) for a in strategy.axis_names}
    print(str(strategy))
    print()
    width = max(len("axis"), *(len(a) for a in strategy.axis_names))
    role_width = max(8, *(len(r) for r in roles.values()))
    print(f"{'axis':<{width}}  size  {'role':<{role_width}}  groups")
    for a in strategy.axis_names:
        groups = strategy.groups(a)
        shown = " ".join(_group_text(g) for g in groups[:_MAX_GROUPS_SHOWN].tolist())
        more = f" ... {len(groups)} groups" if len(groups) > _MAX_GROUPS_SHOWN else ""
        print(f"{a:<{width}}  {strategy.shape[a]:>4}  {roles[a]:<{role_width}}  {shown}{more}")
    if rank is None:
        return
    r = _rank_report(config, rank)
    print(f"\nrank {rank}: " + ", ".join(f"{a}={c}" for a, c in r["coords"].items()))
    print(f"{'axis':<{width}}  {'group':<24}  prev  next")
    for a in strategy.axis_names:
        prev, nxt = r["neighbors"][a]
        print(f"{a:<{width}}  {_group_text(r['groups'][a]):<24}  {prev:>4}  {nxt:>4}")
    print(f"\n{'role':<8}  {'axes':<16}  group")
    for role, info in r["roles"].items():
        line = f"{role:<8}  {'+'.join(info['axes']):<16}  {_group_text(info['group'])}"
        if "neighbors" in info:
            line += f"  prev {info['neighbors'][0]}, next {info['neighbors'][1]}"
        print(line)


def _cmd_mesh(args: argparse.Namespace) -> int:
    from meshkit.config import load_config

    # The same loader as `meshkit train`, so both accept and reject the same configs.
    config = load_config(*_split_config_and_overrides(args.items))
    strategy = config.strategy()
    if args.axis is not None and args.role is not None:
        raise UsageError("--axis and --role both choose the plot's colours; give one")
    if args.axis is not None and args.axis not in strategy.axis_names:
        raise UsageError(f"--axis {args.axis!r} is not an axis of {list(strategy.axis_names)}")
    colour: str | tuple[str, ...] | None = args.axis
    if args.role is not None:
        colour = _role_axes(config).get(args.role)
        if colour is None:
            raise UsageError(f"--role {args.role}: no mesh axis has this role "
                             f"(roles here: {config.roles})")
    if args.rank is not None and not 0 <= args.rank < strategy.size:
        raise UsageError(f"--rank: rank {args.rank} out of range 0..{strategy.size - 1}")
    plot_path = None
    if args.plot:
        from meshkit.plot import output_path

        plot_path = output_path(args.plot)  # checked before anything is printed
    if args.json:
        print(json.dumps(_mesh_report(config, args.rank), indent=2))
    else:
        _print_mesh(config, args.rank)
    if plot_path is not None:
        from meshkit.plot import plot_strategy

        title = None if args.role is None else f"{strategy!r}: {args.role} groups"
        plot_strategy(strategy, colour, path=plot_path, title=title)
        print(f"wrote {plot_path}", file=sys.stderr)
    return 0


def _split_config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def _cmd_train(args: argparse.Namespace) -> int:
    from meshkit.config import load_config
    from meshkit.runtime.distributed import (
        MAX_RUN_SIMULATED_DEVICES,
        initialize,
        num_processes_from_env,
        set_cpu_device_count,
    )

    config = load_config(*_split_config_and_overrides(args.items))
    # The user's model and loss, imported (each announced) and checked before JAX
    # starts: a wrong name or signature costs nothing.
    config.model.factory_function()
    config.model.loss_function()
    per_process = max(1, config.num_devices // num_processes_from_env())
    if per_process > MAX_RUN_SIMULATED_DEVICES:  # before minutes of starting them
        raise UsageError(
            f"mesh.axes: {per_process:,} devices in one process are more than the "
            f"{MAX_RUN_SIMULATED_DEVICES} that meshkit train runs (XLA:CPU aborts a "
            "collective whose devices do not all arrive in time); use fewer devices or "
            "more processes (meshkit launch -n)")
    # Before JAX starts: simulate the strategy's devices on CPU unless the user chose a
    # count (harmless where an accelerator is used).
    set_cpu_device_count(per_process)
    initialize(prog="meshkit train")
    # JAX's preemption service took SIGTERM over: until training installs its handler, a
    # SIGTERM would be swallowed without a word.
    args.stop_signals.retake_sigterm()

    from meshkit.training.loop import train

    # Imports done: Ctrl-C may now raise, so the run closes its checkpointer and writer.
    args.stop_signals.interruptible()
    train(config, progress=None if not args.no_progress else False)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from meshkit.runtime.launch import launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    result = launch(command, args.num_processes, devices_per_process=args.devices_per_process,
                    timeout_s=args.timeout, grace_s=args.grace, link_rate=args.link_rate,
                    link_burst=args.link_burst)
    return result.returncode


def _cmd_plot(args: argparse.Namespace) -> int:
    from meshkit.plot import output_path, plot_metrics

    # The file savefig really writes (it appends .png to a name without a suffix).
    out = output_path(args.output or os.path.join(args.workdir, "loss.png"))
    plot_metrics(args.workdir, path=out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


class _ForwardSignals:
    """While a child runs: SIGINT/SIGTERM/SIGHUP go on to it until it ends; SIGKILL after
    ``grace_s``.

    The child starts with SIGINT ignored (so a Ctrl-C while Python starts it is no
    traceback) and takes the signal once its script has installed its handler
    (:func:`meshkit.cli.script.start`): the signal is sent again every
    ``_RESEND_S`` until the child ends.
    """

    _RESEND_S = 0.2

    def __init__(self, prog: str, *, grace_s: float = _BENCH_GRACE_S) -> None:
        self._prog = prog
        self._grace_s = grace_s
        self._previous: dict[int, Any] = {}
        self._child: subprocess.Popen[bytes] | None = None
        self.received: int | None = None
        self.killed = False

    def start(self, command: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``command`` with SIGINT ignored, then forward the signals to it."""
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._child = subprocess.Popen(command)
        if main_thread:
            for sig in STOP_SIGNALS:
                previous = signal.signal(sig, self._forward)
                self._previous.setdefault(sig, previous)
        return self._child

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            threading.Thread(target=self._resend, daemon=True).start()

    def _resend(self) -> None:
        child, sig = self._child, self.received
        assert child is not None and sig is not None
        deadline = time.monotonic() + self._grace_s
        while child.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)
            time.sleep(self._RESEND_S)
        if child.poll() is None:
            self.killed = True
            with contextlib.suppress(OSError):
                os.write(2, f"{self._prog}: the benchmark did not stop within "
                         f"{self._grace_s:g} s of the signal; killed it\n".encode())
            with contextlib.suppress(ProcessLookupError):
                child.kill()


def _bench_command(name: str, args: Sequence[str] = ()) -> list[str]:
    """The command ``meshkit bench NAME ARGS`` runs: the benchmark's module, in a Python
    process of its own (:mod:`meshkit.benchmarks`; shipped with the package, so this
    works from any install).

    Example:
        >>> _bench_command("groups", ["--quick"])[1:]
        ['-m', 'meshkit.benchmarks.bench_groups', '--quick']
    """
    return [sys.executable, "-m", f"meshkit.benchmarks.bench_{name}", *args]


def _cmd_bench(args: argparse.Namespace) -> int:
    # The benchmark reports a signal itself, in one line (meshkit.cli.script): pass it on
    # (a terminal's Ctrl-C reaches both processes; `kill -INT` only this one) and wait.
    prog = f"meshkit bench {args.name}"
    forward = _ForwardSignals(prog)
    try:
        code = forward.start(_bench_command(args.name, args.args)).wait()
    finally:
        forward.restore()
    if code < 0 and forward.received == -code and not forward.killed:
        # It died of the signal before its script could report it (Python starting).
        print(f"{prog}: {signal_ending(-code)[0]}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell


# ------------------------------------------------------------------ plan, calibrate
def _cmd_plan(args: argparse.Namespace) -> int:
    from meshkit.plan.config_plan import run_plan

    if args.model is not None:
        return _cmd_plan_model(args)
    if args.verify_extrapolate and args.verify is None:
        raise UsageError("--verify-extrapolate: needs --verify K")
    if args.measure:
        raise UsageError("--measure: needs --model FILE (a config's factory model is "
                         "measured whenever it is planned)")

    def describe(config: Config) -> ModelDesc:
        # JAX and the user's module only for a config naming model.factory, which
        # asked for them (the import is announced, as meshkit train announces it).
        from meshkit.training.factory_desc import describe_factory

        return describe_factory(config)

    config_path, overrides = _split_config_and_overrides(args.items)
    # Ctrl-C raises KeyboardInterrupt from here, so a compiling subprocess is killed.
    args.stop_signals.interruptible()
    report = run_plan(config_path, overrides, devices=args.devices, topology=args.topology,
                      preset=args.preset, nodes=args.nodes, top=args.top, write=args.write,
                      verify=args.verify, extrapolate=args.verify_extrapolate,
                      describe=describe,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.to_json() if args.json else report.text())
    if report.written is not None:
        print(f"wrote {report.written}: meshkit train {report.written}", file=sys.stderr)
    return 0


def _cmd_plan_model(args: argparse.Namespace) -> int:
    from meshkit.plan.model_plan import run_model_plan

    if args.items:
        raise UsageError(f"--model: a model description replaces the config; drop "
                         f"{args.items[0]!r}")
    if args.write is not None:
        raise UsageError("--write: not with --model (copy a candidate's overrides instead)")
    if args.verify_extrapolate and args.verify is None:
        raise UsageError("--verify-extrapolate: needs --verify K")
    measure: Callable[[ModelDesc], MeasuredModel] | None = None
    if args.measure:  # JAX only when asked: the ranking itself is numpy
        from meshkit.training.measured import measure_model as measure
    # Ctrl-C raises KeyboardInterrupt from here, so the compiling subprocess is killed.
    args.stop_signals.interruptible()
    report = run_model_plan(args.model, devices=args.devices, topology=args.topology,
                            preset=args.preset, nodes=args.nodes, top=args.top,
                            verify=args.verify, extrapolate=args.verify_extrapolate,
                            runnable=args.runnable,
                            measure=measure,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.to_json() if args.json else report.text())
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from meshkit.runtime.distributed import set_cpu_device_count

    set_cpu_device_count(8)  # before JAX starts: the 8 simulated devices the tests use

    from meshkit.plan.calibrate import run_calibrate, summary

    print(summary(run_calibrate(args.output, processes=args.processes, quick=args.quick,
                                link_rate=args.link_rate, link_burst=args.link_burst)))
    print(f"wrote {args.output}")
    return 0


@dataclasses.dataclass(frozen=True)
class _Command:
    """A subcommand's help: one line for ``meshkit --help``, a paragraph and examples."""

    summary: str
    description: str
    examples: tuple[str, ...]


#: Every subcommand, in the order ``meshkit --help`` lists them.
_COMMANDS: dict[str, _Command] = {
    "train": _Command(
        "train the MoE transformer, or your own model",
        "Train the model a config describes (the embedded default without CONFIG), resuming "
        "from the newest intact checkpoint in train.workdir. model.factory=module:function "
        "trains your own Flax NNX model; the module is found on PYTHONPATH or in the current "
        "directory.",
        ("meshkit train", "meshkit train configs/dp_pp_ep_tp.yaml train.steps=50",
         "meshkit train model.factory=my_model:make train.workdir=runs/mine")),
    "mesh": _Command(
        "show a strategy's axes, roles, rank array and groups",
        "Show the strategy a config describes: each mesh axis with its size and role, the "
        "rank array, and each role's communication groups. It reads the config through the "
        "same loader as meshkit train, so both accept and reject the same configs.",
        ("meshkit mesh configs/dp_pp_ep_tp.yaml --rank 5",
         "meshkit mesh 'mesh.axes={node: 4, device: 2}' --json",
         "meshkit mesh configs/dp_pp_ep_tp.yaml --plot tp.png --role tensor")),
    "launch": _Command(
        "run N local processes over jax.distributed",
        "Run COMMAND in N processes on this machine, joined by jax.distributed over "
        "127.0.0.1 (CPU collectives over gloo). If one fails, the others are stopped within "
        "--timeout seconds. --link-rate rehearses a cluster: each process becomes a node "
        "with its own network namespace and a virtual NIC shaped to the rate (tc tbf), so "
        "traffic between processes crosses the shaped link and traffic inside a process "
        "does not (needs unshare and tc, no root).",
        ("meshkit launch -n 2 -- meshkit train configs/default.yaml train.steps=20",
         "meshkit launch -n 2 --link-rate 1gbit -- meshkit train configs/fine_grained.yaml")),
    "plot": _Command(
        "draw WORKDIR/loss.png from WORKDIR/metrics.jsonl",
        "Draw a run's training and eval loss (against the data's entropy rate, where known) "
        "and the experts' load, from the metrics the run wrote. Needs the [plot] extra.",
        ("meshkit plot runs/default", "meshkit plot runs/default -o loss.png")),
    "bench": _Command(
        "run a benchmark",
        "Run one of meshkit's benchmarks in a process of its own; arguments after NAME go to "
        "the benchmark (NAME --help lists them). --json FILE writes its report, the data of "
        "the docs' benchmark pages.",
        ("meshkit bench groups --repeats 1", "meshkit bench memory --quick",
         "meshkit bench moe --link-rate 0.25gbit,1gbit")),
    "plan": _Command(
        "rank the valid layouts of D devices by predicted step time",
        "Enumerate every valid layout (data, fsdp, tensor, pipeline and expert degrees, "
        "microbatches, remat, schedule) for a device count and rank them by predicted step "
        "time on a cluster preset or a calibrated topology, dropping those predicted not to "
        "fit in memory. A config's model.factory is measured and planned (importing it, "
        "as meshkit train does); --model plans a model description instead of a config. "
        "--verify K compiles the best K and shows XLA's memory beside the prediction.",
        ("meshkit plan --devices 8 --top 3",
         "meshkit plan --model configs/models/llama3_70b.yaml --preset h100-8x400g "
         "--nodes 16 --top 5",
         "meshkit plan --devices 8 --write best.yaml")),
    "calibrate": _Command(
        "measure this machine's FLOP/s and links; write a topology file",
        "Measure matmul FLOP/s and collective latency and bandwidth on this machine, inside "
        "one process and (with --processes 2) across two, and write a topology file that "
        "meshkit plan --topology reads.",
        ("meshkit calibrate --quick -o topology.yaml",
         "meshkit calibrate --link-rate 1gbit -o topology-1g.yaml")),
    "config": _Command(
        "print the resolved config as YAML, or the JSON schema",
        "Print the config that meshkit train would run (defaults, file and overrides "
        "merged and validated) as YAML, or with --schema the JSON schema of config files, "
        "for editors.",
        ("meshkit config configs/default.yaml train.steps=10",
         "meshkit config --schema")),
}


def commands() -> tuple[str, ...]:
    """The subcommands of ``meshkit``, in the order its help lists them.

    Returns:
        Their names.

    Examples:
        >>> commands()[:3]
        ('train', 'mesh', 'launch')
    """
    return tuple(_COMMANDS)


def _add_command(sub: Any, name: str) -> argparse.ArgumentParser:
    command = _COMMANDS[name]
    examples = "\n".join(f"  $ {line}" for line in command.examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=command.summary, description=command.description,
        epilog=f"examples:\n{examples}", formatter_class=_HelpFormatter)
    parser.add_argument("--debug", action="store_true", help="after an error's one line, "
                        f"print its traceback (as {DEBUG_VARIABLE}=1 does)")
    return parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped to the terminal, examples kept line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _add_plan_commands(sub: Any) -> None:
    from meshkit.exchange.cost import PRESETS

    plan = _add_command(sub, "plan")
    plan.add_argument("items", nargs="*", metavar="[CONFIG] key=value",
                      help="a YAML config (default: the embedded one), then overrides")
    plan.add_argument("--devices", type=int, help="device count (default: --nodes × the "
                      "preset's devices per node)")
    plan.add_argument("--topology", metavar="FILE.yaml",
                      help="a topology file written by meshkit calibrate")
    plan.add_argument("--preset", help=f"a cluster preset ({', '.join(PRESETS)}; default "
                      "h100-8x400g when no --topology)")
    plan.add_argument("--nodes", type=int, help="nodes of the preset")
    plan.add_argument("--top", type=int, default=5, help="layouts shown (default 5)")
    plan.add_argument("--json", action="store_true", help="print JSON, best first")
    plan.add_argument("--write", metavar="FILE.yaml",
                      help="write the best layout as a config that meshkit train runs")
    plan.add_argument("--model", metavar="FILE.yaml", help="plan a model description "
                      "(configs/models/llama2_7b.yaml, ...) instead of a meshkit config")
    plan.add_argument("--verify", type=int, metavar="K", help="compile the best K for the "
                      "target device count (simulated CPU devices, abstract inputs) and show "
                      "XLA's memory beside the prediction: a config's own model (its "
                      "model.factory's too), or as meshkit builds a --model description")
    plan.add_argument("--verify-extrapolate", action="store_true", help="with --verify: "
                      "compile 2 and 4 layers per stage and extrapolate (faster)")
    plan.add_argument("--runnable", action="store_true", help="only the remat policies and "
                      "pipeline schedules this meshkit's config can select (a config's "
                      "plan keeps its own, which are)")
    plan.add_argument("--measure", action="store_true", help="with --model: also measure "
                      "the model as meshkit builds it (parameters by jax.eval_shape, FLOPs by "
                      "XLA's cost analysis of 2 and 3 compiled layers on one device)")
    plan.set_defaults(func=_cmd_plan)

    calibrate = _add_command(sub, "calibrate")
    calibrate.add_argument("-o", "--output", default="topology.yaml",
                           help="topology file to write (default topology.yaml)")
    calibrate.add_argument("--processes", type=int, default=2, choices=(1, 2),
                           help="2: also measure across 2 processes via meshkit launch "
                           "(the inter-node link); 1: simulated devices only")
    calibrate.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    calibrate.add_argument("--link-rate", metavar="RATE",
                           help="measure the inter link between 2 processes whose NICs are "
                           "shaped to RATE (e.g. 1gbit; as meshkit launch --link-rate)")
    calibrate.add_argument("--link-burst", metavar="SIZE",
                           help="the shaped NICs' bucket (e.g. 512kb)")
    calibrate.set_defaults(func=_cmd_calibrate)


def _cmd_config(args: argparse.Namespace) -> int:
    from meshkit.config import json_schema, load_config

    if args.schema:
        if args.items:
            raise UsageError(f"--schema takes no config or overrides, got {args.items[0]!r}")
        print(json.dumps(json_schema(), indent=2))
    else:
        print(load_config(*_split_config_and_overrides(args.items)).to_yaml(), end="")
    return 0


def _add_config_command(sub: Any) -> None:
    config = _add_command(sub, "config")
    config.add_argument("items", nargs="*", metavar="[CONFIG] key=value",
                        help="a YAML config (default: the embedded one), then overrides")
    config.add_argument("--schema", action="store_true", help="print the JSON schema")
    config.set_defaults(func=_cmd_config)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="meshkit", description="meshkit: parallel strategies as JAX meshes, a two-stage "
        "all-to-all for mixture-of-experts, and a trainer for any Flax NNX model.",
        epilog="Run meshkit COMMAND --help for a command's options and examples.")
    parser.add_argument("--version", action="version", version=f"meshkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = _add_command(sub, "train")
    train.add_argument("items", nargs="*", metavar="[CONFIG] key=value",
                       help="a YAML config (default: the embedded one), then overrides")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train)

    mesh = _add_command(sub, "mesh")
    mesh.add_argument("items", nargs="*", metavar="[CONFIG] key=value",
                      help="a YAML config (default: the embedded one), then overrides")
    mesh.add_argument("--rank", type=int, help="show this rank's coordinates and groups")
    mesh.add_argument("--json", action="store_true", help="print JSON instead of tables")
    mesh.add_argument("--plot", metavar="FILE.png", help="draw the rank grid to a PNG")
    mesh.add_argument("--axis", help="axis whose groups colour the plot (default: innermost)")
    mesh.add_argument("--role", choices=ROLES,
                      help="colour the plot by this role's groups (its axes fused)")
    mesh.set_defaults(func=_cmd_mesh)

    launch = _add_command(sub, "launch")
    launch.add_argument("-n", "--num-processes", type=int, required=True,
                        help="how many processes to start")
    launch.add_argument("--devices-per-process", type=int,
                        help="simulated CPU devices per process (default: the command's)")
    launch.add_argument("--timeout", type=float, default=60.0,
                        help="seconds within which the others end after one fails "
                        "(a positive number)")
    launch.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                        help="after forwarding SIGTERM/SIGINT/SIGHUP to the processes, "
                        f"SIGKILL them this many seconds later (default: {DEFAULT_GRACE_S:g})")
    launch.add_argument("--link-rate", metavar="RATE",
                        help="rehearse a cluster link: each process gets its own network "
                        "namespace and a virtual NIC shaped to RATE (e.g. 1gbit, 250mbit; "
                        "needs unshare and tc)")
    launch.add_argument("--link-burst", metavar="SIZE",
                        help="the shaped link's bucket (e.g. 512kb; default 256kb or 1 ms "
                        "of the rate)")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    launch.set_defaults(func=_cmd_launch)

    plot = _add_command(sub, "plot")
    plot.add_argument("workdir")
    plot.add_argument("-o", "--output", help="PNG path (default: WORKDIR/loss.png)")
    plot.set_defaults(func=_cmd_plot)

    bench = _add_command(sub, "bench")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)

    _add_plan_commands(sub)
    _add_config_command(sub)
    return parser


class _OutputError(MeshkitError):
    """Standard output refused what the command printed (a full disk, ``> /dev/full``)."""


def _stdout_name() -> str:
    """What standard output is, for the message: its file where Linux says, else stdout."""
    try:
        return f"standard output ({os.readlink(f'/proc/self/fd/{sys.stdout.fileno()}')})"
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return "standard output"


class _CheckedStdout:
    """``sys.stdout``, with a failed write reported as the user's problem in one line.

    A full disk or device is the environment's fault, not a bug; a reader that went away
    (``BrokenPipeError``) passes through to its own exit code.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError(f"cannot write to {_stdout_name()}: "
                               f"{e.strerror or e}") from None

    def write(self, text: str) -> int:
        return int(self._call("write", text))

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[None]:
    """``model.factory=mypkg.gpt:make`` finds ``mypkg`` in the current directory, as
    ``python -m`` would. Last on ``sys.path``: a file there never shadows an installed
    module (a stray ``jax.py``)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``meshkit`` command line.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code (:data:`meshkit.errors.EXIT_CODES`): 0 on success; a
        :class:`~meshkit.errors.MeshkitError`'s ``exit_code`` (2 for bad input, 3 for a
        diverged run, ...) with its message on stderr in one line; 130 on Ctrl-C, 143 on
        SIGTERM and 129 on SIGHUP (outside training: there the last two save and exit
        4), each with one line, from the moment ``main`` starts (before the commands
        import JAX); 1 for
        any other exception, a bug, whose traceback is printed after a line asking for a
        report. Usage errors that ``argparse`` finds exit with 2 through ``SystemExit``.

    Examples:
        >>> main(["mesh", "--rank", "5"])  # the default strategy; rank 5's groups
        Strategy(node=2, device=4)
        [[0 1 2 3]
         [4 5 6 7]]
        <BLANKLINE>
        axis    size  role      groups
        node       2  expert    (0,4) (1,5) (2,6) (3,7)
        device     4  expert    (0,1,2,3) (4,5,6,7)
        <BLANKLINE>
        rank 5: node=1, device=1
        axis    group                     prev  next
        node    (1,5)                        1     1
        device  (4,5,6,7)                    4     6
        <BLANKLINE>
        role      axes              group
        expert    node+device       (0,1,2,3,4,5,6,7)
        0
    """
    words = list(sys.argv[1:] if argv is None else argv)
    guess = f"meshkit {words[0]}" if words and words[0].isalpha() else "meshkit"
    # Before anything slow (parsing imports the commands' modules; the commands import
    # JAX): a signal during start-up ends the command with one line, not a traceback.
    with _StopSignals(guess) as stop_signals:
        return _main(words, stop_signals)


def _main(argv: list[str], stop_signals: _StopSignals) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.stop_signals = stop_signals
    if extra:
        # argparse stops filling a positional list at the first flag: the key=value
        # items after it come back here, in order, and belong after the others.
        flags = [x for x in extra if x.startswith("-")]
        if args.command not in _ITEM_COMMANDS or flags:
            print(f"meshkit {args.command}: error: unrecognized arguments: "
                  f"{' '.join(flags or extra)} (see meshkit {args.command} --help)",
                  file=sys.stderr)
            return EXIT_USAGE
        args.items = [*args.items, *extra]
    prog = stop_signals.prog = f"meshkit {args.command}"
    try:
        # The library's start lines, summaries and warnings on stderr.
        with (log_to_stderr(prog=prog), _current_directory_importable(),
              contextlib.redirect_stdout(_CheckedStdout(sys.stdout))):
            code = int(args.func(args))
            sys.stdout.flush()  # a reader gone early, a full disk: here, not at exit
        return code
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, _OutputError):
            silence_stdout()
        return exit_code(e, prog, debug=debugging(args.debug))



def run() -> NoReturn:
    """The ``meshkit`` program (its console script and ``python -m meshkit.cli``).

    :func:`main` on ``sys.argv``, then exit with its code. After a Ctrl-C the
    command's own clean-up has run (checkpoints finished, files closed) by the time
    ``main`` returns 130, but the interpreter's teardown can still crash inside an XLA
    compilation the interrupt cut short (exit 139 after the "interrupted" line): so
    that exit skips the teardown, as does a lost peer's (5), whose teardown would wait
    for the dead process at ``jax.distributed``'s shutdown barrier and then abort.

    Raises:
        SystemExit: always, with the exit code.

    Examples:
        ``meshkit mesh --rank 5`` in a shell is ``run()`` with ``sys.argv[1:]`` set to
        ``["mesh", "--rank", "5"]``: it prints what ``main`` prints and exits 0.
    """
    code = main()
    # After a lost peer, jax.distributed's shutdown at exit waits for it at a barrier and
    # then aborts (134, a C++ stack): skip the teardown, as after Ctrl-C.
    if code in (EXIT_INTERRUPTED, EXIT_PEER_LOST):
        leave_now(code)
    sys.exit(code)
