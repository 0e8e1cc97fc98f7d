"""The launcher's reaper: ends the launched process groups if the launcher dies first.

A launcher killed with SIGKILL (or by the OOM killer) runs no clean-up, and its
processes, each the leader of a session of its own, would keep running: orphans holding
devices and ports. So ``meshkit launch`` starts this small program first, in a session
of its own (a Ctrl-C at the terminal does not reach it), with a pipe from the launcher
as its standard input. The launcher writes one line per process group it starts
(``+PGID``) and, once it has ended them all itself, ``done``. End of input without
``done`` means the launcher is gone: every group it named gets SIGKILL at once.

The pipe's end of input is the kernel's notice that the launcher died (its last write
end is closed), so there is no polling and no race with process id reuse for the
launcher itself. Standard library only: it starts in a fraction of a second and imports
nothing that could fail.

Run as ``python -I -S _reaper.py``; :func:`main` is the whole program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import TextIO

__all__ = ["main"]


def main(lines: TextIO | None = None) -> int:
    """Read the launcher's lines until ``done`` or end of input (then kill the groups).

    Args:
        lines: the launcher's pipe (default ``sys.stdin``).

    Returns:
        0 (it has nothing to report to anyone: the launcher may be gone).

    Examples:
        >>> import io
        >>> main(io.StringIO("+999999999\\ndone\\n"))  # no kill: the launcher said done
        0
    """
    lines = sys.stdin if lines is None else lines
    groups: list[int] = []
    for line in lines:
        word = line.strip()
        if word == "done":
            return 0
        if word.startswith("+") and word[1:].isdigit():
            groups.append(int(word[1:]))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    # Signals meant for the launcher's terminal or job are not meant for the reaper:
    # only SIGKILL or the end of its input ends it.
    for _sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(_sig, signal.SIG_IGN)
    sys.exit(main())
