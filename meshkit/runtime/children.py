"""The process groups a command started and must end, however it ends.

A command that starts helper processes in sessions of their own (``meshkit plan
--verify``'s compiling workers) ends them in a ``finally``. A stop signal ends the
command with ``os._exit`` instead (:func:`meshkit.cli.ending.stop_at_once`: an interpreter
teardown in the middle of an import can crash), which runs no ``finally``; and the
helpers, in their own sessions, get no signal from a terminal or a scheduler. So a
command names each group here while it lives, and the signal's exit SIGKILLs them
first (:func:`kill_all`).

This module imports nothing from meshkit: the command line's last step may use it.

Examples:
    >>> import subprocess, sys
    >>> p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
    ...                      start_new_session=True)
    >>> with tracked(p.pid):
    ...     kill_all()
    >>> p.wait() < 0  # ended by the signal
    True
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

__all__ = ["kill_all", "tracked"]

# Process group ids. A set, read with tuple() (one step under the GIL), so a signal
# handler may read it while another thread adds to it.
_groups: set[int] = set()


@contextlib.contextmanager
def tracked(pgid: int) -> Iterator[None]:
    """Name process group ``pgid`` as one to kill if the command stops on a signal.

    Args:
        pgid: the group's id (a session leader's pid).

    Yields:
        Nothing; the group is no longer named once the block exits.

    Examples:
        >>> with tracked(2**22 + 1):  # a group that does not exist: killing it is a no-op
        ...     kill_all()
    """
    _groups.add(pgid)
    try:
        yield
    finally:
        _groups.discard(pgid)


def kill_all() -> None:
    """SIGKILL every group named by :func:`tracked` (safe inside a signal handler).

    Examples:
        >>> kill_all()  # no group named: nothing happens
    """
    for pgid in tuple(_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
