"""Filesystem probes for start-up checks (private helpers)."""

from __future__ import annotations

import contextlib
import os
import tempfile


def unwritable(directory: str) -> str | None:
    """Why files cannot be created in ``directory`` (an existing directory), or ``None``.

    Creates and removes a probe file: ``os.access`` answers for the user's permission
    bits only, and says yes to root on a read-only filesystem or a pseudo-filesystem.

    Args:
        directory: the directory to probe.

    Returns:
        The operating system's reason (e.g. ``'Permission denied'``), or ``None`` when a
        file could be created.

    Examples:
        >>> unwritable(tempfile.gettempdir()) is None
        True
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".meshkit-probe-", dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(probe)
    return None


def cannot_write(path: str) -> str | None:
    """Why a file cannot be written at ``path``, or ``None``: checked before the work whose
    result goes there (a planner's search, a calibration's minutes of measuring).

    Args:
        path: the file to write.

    Returns:
        ``'it is a directory'``, ``'no directory D'`` or the operating system's reason
        the directory refuses new files (e.g. ``'Permission denied'``), or ``None``.

    Examples:
        >>> cannot_write(tempfile.gettempdir())
        'it is a directory'
        >>> cannot_write("no_such_dir/x.yaml")
        'no directory no_such_dir'
    """
    if os.path.isdir(path):
        return "it is a directory"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "Permission denied"
    return unwritable(folder)
