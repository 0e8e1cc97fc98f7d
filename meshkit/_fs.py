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

    Example:
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
