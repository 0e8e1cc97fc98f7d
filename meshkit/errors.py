"""meshkit's own error types and the exit codes the ``meshkit`` command gives them.

The command line has one boundary (:func:`meshkit.cli.main.main`): an exception derived from
:class:`MeshkitError` is the user's problem or an expected end of a run, so it is printed
as one line (``meshkit train: error: ...``) and the command exits with the exception's
``exit_code``. Any other exception is a bug in meshkit: its traceback is kept, behind a
line asking the user to report it, and the exit code is :data:`EXIT_BUG`.

Library code raises these types where the culprit is the caller's input, so scripts and
notebooks get the same messages. They also derive from the built-in type a caller would
expect (:class:`UsageError` is a ``ValueError``, :class:`TrainingDiverged` a
``FloatingPointError``), so existing ``except ValueError`` clauses keep working.

This module imports nothing from meshkit or JAX: every layer may raise these.

Examples:
    >>> try:
    ...     raise UsageError("train.steps: must be >= 1, got 0")
    ... except ValueError as e:
    ...     print(e.exit_code, e)
    2 train.steps: must be >= 1, got 0
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "EXIT_BUG",
    "EXIT_CODES",
    "EXIT_DIVERGED",
    "EXIT_HANGUP",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PEER_LOST",
    "EXIT_PIPE_CLOSED",
    "EXIT_PREEMPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "MeshkitError",
    "MissingExtra",
    "MissingFile",
    "PeerLost",
    "Preempted",
    "TrainingDiverged",
    "UsageError",
    "UserCodeError",
    "format_exit_codes",
]

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 4
EXIT_PEER_LOST = 5
EXIT_NOT_EXECUTABLE = 126  # as a shell: the command exists but cannot be run
EXIT_NOT_FOUND = 127  # as a shell: no such command
EXIT_HANGUP = 129  # 128 + SIGHUP, as a shell reports a closed terminal
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell reports a reader that went away
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_BUG: "a bug in meshkit: the traceback follows a line asking you to report it",
    EXIT_USAGE: "bad input (a usage, config, workdir or data error; a workdir in use by another "
    "run; a full disk or the devices out of memory), named in one line",
    EXIT_DIVERGED: "the training loss became NaN or inf; the newest checkpoint predates it",
    EXIT_PREEMPTED: "preempted: SIGTERM or SIGHUP stopped the run after a checkpoint of the "
    "step it stopped at; rerun the same command to resume",
    EXIT_PEER_LOST: "another process of a multi-process job died or became unreachable "
    "(its connection closed mid-collective); `meshkit launch` names the process that ended "
    "first and how",
    EXIT_NOT_EXECUTABLE: "`meshkit launch`: the command is not executable",
    EXIT_NOT_FOUND: "`meshkit launch`: the command was not found",
    EXIT_HANGUP: "the terminal closed (SIGHUP) where there was nothing to save (start-up, or "
    "outside `meshkit train`'s training loop); the processes the command started are ended",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (SIGINT)",
    EXIT_PIPE_CLOSED: "the output's reader closed it early (e.g. output piped into `head`)",
    EXIT_TERMINATED: "stopped by SIGTERM where there was nothing to save (start-up, or "
    "outside `meshkit train`'s training loop); the processes the command started are ended",
}
"""Every exit code of the ``meshkit`` command and its meaning (the exit-codes guide lists them).
``meshkit launch`` also passes on a failed process's own code, and gives ``128 + N`` when
signal ``N`` stopped it."""


def format_exit_codes() -> str:
    """A markdown table of :data:`EXIT_CODES`, for docs/guides/exit-codes.md.

    Returns:
        The table, one row per code.

    Examples:
        >>> print(format_exit_codes().splitlines()[4])  # doctest: +ELLIPSIS
        | 2 | bad input (a usage, config, workdir or data error; ...), named in one line |
    """
    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES.items()]
    return "\n".join(rows) + "\n"


class MeshkitError(Exception):
    """Base of meshkit's expected errors: reported in one line, exit code ``exit_code``."""

    exit_code: ClassVar[int] = EXIT_USAGE


class UsageError(MeshkitError, ValueError):
    """Bad input from the user (a flag, a config value, a file, the environment).

    The message names the culprit: the key, flag, path, variable or rank at fault.
    """

    exit_code: ClassVar[int] = EXIT_USAGE


class UserCodeError(UsageError):
    """A user's own code failed: the model factory, the model it made, or the loss.

    The message names the culprit the way the user named it (``model.factory``,
    ``model.loss``, or a Python argument such as ``train(loss=...)``) and the user's own
    exception in one line; that exception is the ``__cause__``, and ``meshkit --debug``
    (or ``MESHKIT_DEBUG=1``) prints its traceback.
    """

    exit_code: ClassVar[int] = EXIT_USAGE


class MissingFile(UsageError, FileNotFoundError):
    """A file or directory the user named (or that a run needs) does not exist."""

    exit_code: ClassVar[int] = EXIT_USAGE


class MissingExtra(MeshkitError, ImportError):
    """An optional dependency is not installed; the message names the ``pip`` command."""

    exit_code: ClassVar[int] = EXIT_USAGE


class TrainingDiverged(MeshkitError, FloatingPointError):
    """The loss became NaN or inf; the newest checkpoint predates it."""

    exit_code: ClassVar[int] = EXIT_DIVERGED


class PeerLost(MeshkitError):
    """Another process of a multi-process job died or became unreachable.

    The collectives that joined it fail (gloo: the connection was reset or closed); the
    message says so instead of calling it a bug. The process that died is named by its
    launcher (``meshkit launch``) or scheduler.
    """

    exit_code: ClassVar[int] = EXIT_PEER_LOST


class Preempted(MeshkitError):
    """The run was asked to stop (SIGTERM from a scheduler, SIGHUP from a closed terminal)
    and stopped cleanly.

    Raise it once the state worth keeping is saved; the command exits with
    :data:`EXIT_PREEMPTED` so a job script can tell "resume me" from a failure.
    """

    exit_code: ClassVar[int] = EXIT_PREEMPTED
