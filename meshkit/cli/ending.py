"""How a meshkit command ends: the one place an exception becomes an exit code.

``meshkit`` itself (:mod:`meshkit.cli.main`) and each benchmark script
(:mod:`meshkit.cli.script`) end the same way (:data:`meshkit.errors.EXIT_CODES`): a
usage error or a :class:`~meshkit.errors.MeshkitError` in one line, a signal in one
line, a reader gone silently, a lost peer in one line, and anything else as a bug with
its traceback. Both use these helpers, so the two cannot drift apart.

Examples:
    >>> import io, contextlib
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     code = exit_code(KeyboardInterrupt(), "meshkit train")
    >>> code, err.getvalue()
    (130, 'meshkit train: interrupted\\n')
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import traceback
from typing import NoReturn

from meshkit.errors import (
    EXIT_BUG,
    EXIT_HANGUP,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    MeshkitError,
)
from meshkit.runtime import children
from meshkit.runtime.distributed import peer_lost

__all__ = ["DEBUG_VARIABLE", "STOP_SIGNALS", "OneLineParser", "debugging", "exit_code",
           "leave_now", "signal_ending", "silence_stdout", "stop_at_once"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that end a command in one line: Ctrl-C, a scheduler's stop, a closed terminal."""

_ENDINGS: dict[int, tuple[str, int]] = {
    signal.SIGINT: ("interrupted", EXIT_INTERRUPTED),
    signal.SIGTERM: ("stopped by SIGTERM", EXIT_TERMINATED),
    signal.SIGHUP: ("stopped by SIGHUP", EXIT_HANGUP),
}


def signal_ending(signum: int) -> tuple[str, int]:
    """How a command that a signal ended reports it: the words after ``PROG:`` and the code.

    Args:
        signum: the signal (one of :data:`STOP_SIGNALS`; any other: ``128 + signum``).

    Returns:
        ``(words, exit code)``.

    Examples:
        >>> signal_ending(signal.SIGHUP)
        ('stopped by SIGHUP', 129)
    """
    if signum in _ENDINGS:
        return _ENDINGS[signum]
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"stopped by {name}", 128 + signum

DEBUG_VARIABLE = "MESHKIT_DEBUG"
"""Set to 1 (as ``--debug`` does): an error's one line is followed by its traceback."""


def debugging(flag: bool = False) -> bool:
    """Whether an error's traceback is wanted: ``--debug`` given, or ``MESHKIT_DEBUG``
    set to anything but empty or ``0``.

    Args:
        flag: the command's ``--debug``.

    Returns:
        True to print tracebacks.

    Examples:
        >>> debugging(True)
        True
    """
    return flag or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


class OneLineParser(argparse.ArgumentParser):
    """argparse, reporting a usage error in one line (``PROG: error: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def stop_at_once(prog: str, signum: int) -> NoReturn:
    """End the process on a signal: one line on stderr, then 130 (SIGINT), 143 (SIGTERM)
    or 129 (SIGHUP).

    For signals that arrive while there is nothing to save (start-up, imports): an
    interpreter teardown inside a half-imported native library can crash (139), so the
    process leaves without one. No ``finally`` runs, so the process groups the command
    started (:mod:`meshkit.runtime.children`) are killed here first.

    Args:
        prog: the name the line begins with (``meshkit train``).
        signum: the signal received.
    """
    children.kill_all()
    what, code = signal_ending(signum)
    with contextlib.suppress(OSError):
        os.write(2, f"{prog}: {what}\n".encode())
    os._exit(code)


def silence_stdout() -> None:
    """Point stdout at devnull, so that the flush at interpreter exit does not fail again
    on what is still buffered (a second message, and exit code 120)."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def leave_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, streams flushed.

    After a lost peer, ``jax.distributed``'s shutdown would wait for the dead process at
    a barrier and then abort (134, a C++ stack); after Ctrl-C the teardown can crash
    inside an XLA compilation the interrupt cut short (139).

    Args:
        code: the exit code.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def exit_code(error: BaseException, prog: str, *, debug: bool = False) -> int:
    """Report how a command ended with ``error`` and return its exit code.

    Args:
        error: what the command raised (not ``SystemExit``, which carries its own code).
        prog: the name each line begins with (``meshkit plan``, ``meshkit bench moe``).
        debug: after a :class:`~meshkit.errors.MeshkitError`'s line, print its
            traceback too (the user's own exception's first, for a
            :class:`~meshkit.errors.UserCodeError`).

    Returns:
        The :class:`~meshkit.errors.MeshkitError`'s own code with its message in one
        line; 130 for ``KeyboardInterrupt`` (one line); 141 for a reader that went away
        (silently, stdout silenced); a lost peer's 5 (one line); otherwise 1, a bug,
        after a line asking for a report and the traceback.
    """
    if isinstance(error, MeshkitError):
        print(f"{prog}: error: {error}", file=sys.stderr)
        if debug:
            traceback.print_exception(error)
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(error, BrokenPipeError):
        # The reader (`| head`) has all it wanted; the flush at exit must not fail again.
        silence_stdout()
        return EXIT_PIPE_CLOSED
    lost = peer_lost(error)
    if lost is not None:  # another process died: not a bug here
        print(f"{prog}: error: {lost}", file=sys.stderr)
        return lost.exit_code
    print(f"{prog}: internal error: this is a bug in meshkit; please report it with "
          "the command line and the traceback below", file=sys.stderr)
    traceback.print_exception(error)
    return EXIT_BUG
