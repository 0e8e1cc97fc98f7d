"""Files the user names: probes for start-up checks, the one reader of small text files
(configs, model descriptions, topology files) and the one writer of output files
(private helpers)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from typing import Any

from meshkit.errors import MissingFile, UsageError

MAX_TEXT_FILE_BYTES = 1 << 20
"""The most bytes :func:`read_text_file` reads (1 MiB). A whole config is about a hundred
values (a few KiB), a model description or a topology file less: a bigger file is the
wrong file, and reading it whole (``/dev/zero``, a log) would only end in ``MemoryError``."""

# What a path that is not a regular file is, for the one line that refuses it.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n:,} bytes"


def read_text_file(path: str | os.PathLike[str], *, what: str,
                   limit: int = MAX_TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of a small file the user named: a regular file of at most ``limit``
    bytes, read without blocking.

    The path is checked before it is opened, and the opened file again (it may have
    been swapped in between): a named pipe would block the reader until something wrote
    to it, a device such as ``/dev/zero`` never ends.

    Args:
        path: the file.
        what: what the file is, for the message (``"config file"``).
        limit: the most bytes read.

    Returns:
        The text (a UTF-8 byte-order mark dropped).

    Raises:
        MissingFile: no such file.
        UsageError: a directory, pipe, device or socket; a file over ``limit`` bytes;
            one that cannot be read or is not UTF-8. One line naming ``what`` and the
            path.

    Examples:
        >>> read_text_file("/dev/zero", what="config file")
        Traceback (most recent call last):
        ...
        meshkit.errors.UsageError: config file /dev/zero is a character device, not a regular file
    """
    where = os.fspath(path)
    try:
        if not stat.S_ISREG(mode := os.stat(where).st_mode):
            raise UsageError(f"{what} {where} is {_kind(mode)}, not a regular file")
        # O_NONBLOCK: should a pipe replace the file after the check, opening it does
        # not wait for a writer.
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFile(f"{what} not found: {where}") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {where}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"{what} {where} is {_kind(mode)}, not a regular file")
        chunks: list[bytes] = []
        read = 0
        while read <= limit and (chunk := os.read(fd, limit + 1 - read)):
            chunks.append(chunk)
            read += len(chunk)
    except OSError as e:
        raise UsageError(f"cannot read {what} {where}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if read > limit:
        raise UsageError(f"{what} {where} is larger than {_size(limit)}, the most meshkit "
                         f"reads as a {what}")
    data = b"".join(chunks)
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is harmless
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UsageError(
            f"cannot decode {what} {where} as UTF-8: byte 0x{data[e.start]:02x} "
            f"at line {line} (offset {e.start})") from None


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


def _held_signals() -> tuple[list[int], dict[int, Any]]:
    """Hold Ctrl-C, SIGTERM and SIGHUP back (main thread only): ``(held, previous handlers)``."""
    held: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[stop] = signal.signal(stop, lambda signum, frame: held.append(signum))
    return held, previous


def write_file(path: str | os.PathLike[str], data: str | bytes, *,
               flag: str | None = None) -> None:
    """Write an output file the user named, whole or not at all, every error reported.

    A regular file (or a new one) is written beside itself and renamed into place,
    after ``fsync``: a full disk, a quota or an I/O error shows here, not as a file
    cut short. A pipe, device or socket at ``path`` (``/dev/null``, ``/dev/stdout``) is
    written in place, never replaced; one that refuses the bytes (``/dev/full``) is
    named. Ctrl-C, SIGTERM and SIGHUP wait until the file is in place or the temporary one is
    gone.

    Args:
        path: the file.
        data: its contents (``str``: UTF-8).
        flag: the option that named the file, for the message (``"--output"``).

    Raises:
        UsageError: the file cannot be written, in one line naming ``flag`` and the path.

    Examples:
        >>> write_file("/dev/full", "x", flag="--output")
        Traceback (most recent call last):
        ...
        meshkit.errors.UsageError: --output: cannot write /dev/full: No space left on device
    """
    where = os.fspath(path)
    blob = data.encode() if isinstance(data, str) else data
    prefix = f"{flag}: " if flag else ""
    held, previous = _held_signals()
    tmp = None
    try:
        try:
            mode = os.stat(where).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if stat.S_ISDIR(mode):
            raise UsageError(f"{prefix}cannot write {where}: it is a directory")
        if not stat.S_ISREG(mode):
            _write_in_place(where, blob)
            return
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(where)),
                                   prefix=f".{os.path.basename(where)}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, where)
        tmp = None
    except OSError as e:
        raise UsageError(f"{prefix}cannot write {where}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def _write_in_place(path: str, blob: bytes) -> None:
    """Write to a pipe, device or socket: opened without waiting for a reader."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a named pipe that no process reads
            raise OSError(e.errno, "no process reads the named pipe") from None
        raise
    try:
        os.set_blocking(fd, True)  # opened: now a slow reader may take its time
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        with contextlib.suppress(OSError):  # pipes and most devices cannot be synced
            os.fsync(fd)
    finally:
        os.close(fd)
