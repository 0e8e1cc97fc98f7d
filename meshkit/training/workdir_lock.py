"""One run per workdir: ``<workdir>/.lock``, held by process 0 for the whole run.

Two runs on one workdir interleave ``metrics.jsonl`` and race each other renaming
checkpoints, so :func:`lock_workdir` takes an exclusive ``fcntl.flock`` on
``<workdir>/.lock`` and writes this process's PID and host into it. The operating system
drops a ``flock`` when its process dies, however it dies, so a lock file whose lock is
free was left by a dead run: it is taken over with a warning. A second run while the
first is alive gets :class:`WorkdirLocked` (exit code 2) naming the first one's PID.

Only process 0 of a run takes the lock (the others never wait on it). JAX-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator

from meshkit.errors import UsageError

__all__ = ["LOCK_FILE", "WorkdirLocked", "lock_workdir"]

LOCK_FILE = ".lock"
_log = logging.getLogger(__name__)


class WorkdirLocked(UsageError):
    """Another live run holds the workdir's lock (the message names its PID and host)."""


def _holder(fd: int) -> str:
    """What the lock file says about its holder: ``'PID 123 on host h'``, or a stand-in."""
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    except OSError:
        text = []
    if len(text) >= 2 and text[0].isdigit():
        return f"PID {text[0]} on host {text[1]}"
    if text and text[0].isdigit():
        return f"PID {text[0]}"
    return "an unknown process"


def _open_locked(path: str) -> int:
    """Open ``path`` and hold its ``flock``; the file is the one at ``path`` now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise WorkdirLocked(
                f"train.workdir: {os.path.dirname(path)} is in use by another run "
                f"({holder}, lock {path}); wait for it to end, or use another "
                "train.workdir") from None
        except BaseException:
            os.close(fd)
            raise
        # A run that ended between our open and flock unlinked the file we hold: the
        # lock of a file no longer at ``path`` guards nothing, so try again.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def lock_workdir(workdir: str) -> Iterator[str]:
    """Hold ``<workdir>/.lock`` for the ``with`` block; release it on every exit.

    Args:
        workdir: an existing directory.

    Yields:
        The lock file's path.

    Raises:
        WorkdirLocked: a live process holds the lock (exit code 2; the message names its
            PID and host).
        OSError: the lock file cannot be created (e.g. a read-only directory).

    Examples:
        >>> import tempfile
        >>> workdir = tempfile.mkdtemp()
        >>> with lock_workdir(workdir) as path:
        ...     os.path.basename(path)
        '.lock'
        >>> os.path.exists(path)  # removed on release
        False
    """
    path = os.path.join(workdir, LOCK_FILE)
    fd = _open_locked(path)
    try:
        if os.fstat(fd).st_size:  # the lock is ours, yet a holder wrote itself in: dead
            _log.warning(f"meshkit: warning: taking over the lock {path} left by "
                         f"{_holder(fd)}, which no longer holds it (that run ended without "
                         "removing it)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        # Unlinked while still held, so the next run never finds our PID in a free lock.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
