"""The command-line contract of meshkit's benchmarks (``meshkit.benchmarks.bench_*``).

``meshkit bench NAME`` runs ``python -m meshkit.benchmarks.bench_NAME`` in a process of
its own; each benchmark ends the way every ``meshkit`` command does
(:data:`meshkit.errors.EXIT_CODES`):

* a usage error (argparse's, a bad ``key=value`` override, a missing file): one line
  ``meshkit bench NAME: error: ...``, exit 2, no usage block and no traceback;
* the output's reader gone (``| head``): exit 141, silently;
* Ctrl-C: one line, exit 130; SIGTERM: one line, exit 143; SIGHUP (a closed terminal):
  one line, exit 129;
* another process of a multi-process job lost (:func:`meshkit.runtime.distributed.peer_lost`):
  one line, exit 5, at once;
* any other exception: a bug, with its traceback, exit 1.

A benchmark calls :func:`start` first thing (before importing JAX), builds its parser with
:func:`parser` and ends with ``raise SystemExit(run(main, "NAME"))``.

Examples:
    >>> p = parser("groups", "a benchmark")
    >>> p.prog
    'meshkit bench groups'
    >>> run(lambda argv: 0, "groups", [])
    0
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from meshkit.cli.ending import (
    STOP_SIGNALS,
    OneLineParser,
    debugging,
    exit_code,
    leave_now,
    stop_at_once,
)
from meshkit.errors import EXIT_PEER_LOST, EXIT_USAGE
from meshkit.runtime.interrupt import raise_interrupt

__all__ = ["ScriptParser", "parser", "positive_int", "prog", "raise_interrupt", "run", "start"]


def prog(name: str) -> str:
    """The name a script's messages begin with.

    Args:
        name: the benchmark's name (``groups`` for ``bench_groups``).

    Returns:
        ``meshkit bench NAME``.

    Examples:
        >>> prog("plan")
        'meshkit bench plan'
    """
    return f"meshkit bench {name}"


_prog = "meshkit bench"  # the running script's, once start() or run() has named it


_stopping = False


def _stop_at_once(signum: int, frame: FrameType | None) -> None:
    global _stopping
    if _stopping:  # a second signal (terminal and `meshkit bench` both send one): one line
        return
    _stopping = True
    stop_at_once(_prog, signum)


def start(name: str) -> None:
    """Ctrl-C, SIGTERM and SIGHUP end the script in one line from here on (call it first).

    Before :func:`run`, a signal ends the process at once (``os._exit``): Python's own
    handling would print a ``KeyboardInterrupt`` traceback from inside an import.

    Args:
        name: the benchmark's name.
    """
    global _prog
    _prog = prog(name)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop_at_once)


# argparse, with its errors in one line (``PROG: error: ...``) and exit code 2.
ScriptParser = OneLineParser


def parser(name: str, description: str) -> ScriptParser:
    """The argument parser of benchmark ``name``.

    Args:
        name: the benchmark's name.
        description: its ``--help`` text.

    Returns:
        A :class:`ScriptParser` named ``meshkit bench NAME``.
    """
    return ScriptParser(prog=prog(name), description=description)


def positive_int(text: str) -> int:
    """An argparse ``type``: a count that must be at least 1 (steps, repeats).

    Args:
        text: the flag's value.

    Returns:
        The count.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1 (argparse names the flag).

    Examples:
        >>> positive_int("3")
        3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Interrupt:
    """Ctrl-C raises ``KeyboardInterrupt`` once (a second one, forwarded by ``meshkit
    bench`` as well as sent by the terminal, must not cut the clean-up short)."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.fired:
            try:
                raise_interrupt(signum, frame)  # returns when it sends the signal again
            except KeyboardInterrupt:
                global _stopping
                self.fired = _stopping = True  # the signals sent after it: no second line
                raise


def run(main: Callable[[Sequence[str] | None], int], name: str,
        argv: Sequence[str] | None = None) -> int:
    """Run a script's ``main`` and turn how it ended into an exit code (module docstring).

    Args:
        main: the script's ``main(argv) -> int``.
        name: the benchmark's name, for the messages.
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        ``main``'s code, or 2 / 129 / 130 / 141 / 143 / 1 as the module docstring says.
    """
    global _prog, _stopping
    name_ = _prog = prog(name)
    _stopping = False
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if in_main_thread:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _Interrupt())
        for stop in (signal.SIGTERM, signal.SIGHUP):
            previous[stop] = signal.signal(stop, _stop_at_once)
    try:
        try:
            code = int(main(argv))
            sys.stdout.flush()  # a reader gone early: here, not at exit
            return code
        except SystemExit as e:  # argparse's --help (0) and errors (2)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
        except (Exception, KeyboardInterrupt) as e:
            code = exit_code(e, name_, debug=debugging())
            if code == EXIT_PEER_LOST:
                # jax.distributed's shutdown would wait for the dead process, then abort.
                leave_now(code)
            return code
    finally:
        for sig, handler in previous.items():
            # Ending on a signal: the copies `meshkit bench` sends until this process is
            # gone must not kill it in the interpreter's teardown, which puts the default
            # handlers back (not an ignored one's): its one line is already out.
            signal.signal(sig, signal.SIG_IGN if _stopping else handler)
