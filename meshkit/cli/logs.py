"""The command line's view of the library's logging: messages as they are, on stderr.

Library code logs on the ``meshkit`` logger hierarchy and never prints. While a command
runs, :func:`log_to_stderr` shows every message of INFO level and above on stderr,
exactly as the library wrote it (no level or logger name: the messages carry their own
``meshkit train: warning:`` prefixes).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["log_to_stderr"]


class _Stderr(logging.Handler):
    """Write each message to ``sys.stderr`` as it is at that moment (pytest's capsys and
    a caller's redirection replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def log_to_stderr(level: int = logging.INFO) -> Iterator[None]:
    """Show the ``meshkit`` loggers' messages of ``level`` and above on stderr, inside.

    The messages do not also reach the root logger's handlers meanwhile (no line twice
    where an application has set up logging); everything is restored on leaving.

    Args:
        level: the lowest level shown.

    Example:
        >>> import logging
        >>> with log_to_stderr():
        ...     logging.getLogger("meshkit.train").info("meshkit train: starting")
    """
    logger = logging.getLogger("meshkit")
    handler = _Stderr()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
