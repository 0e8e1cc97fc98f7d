"""The command line's view of the library's logging: messages as they are, on stderr.

Library code logs on the ``meshkit`` logger hierarchy and never prints. While a command
runs, :func:`log_to_stderr` shows every message of INFO level and above on stderr as the
library wrote it (no level or logger name: the messages carry their own ``meshkit:
warning:`` prefixes), but that the command names itself where the library wrote
``meshkit:`` (``meshkit train: warning: ...``): the library cannot know which command,
if any, called it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["log_to_stderr"]


_LIBRARY = "meshkit: "


class _Stderr(logging.Handler):
    """Write each message to ``sys.stderr`` as it is at that moment (pytest's capsys and
    a caller's redirection replace it), the library's ``meshkit:`` as ``prog:``."""

    def __init__(self, prog: str | None) -> None:
        super().__init__()
        self._prog = prog

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if self._prog is not None and text.startswith(_LIBRARY):
                text = f"{self._prog}: {text[len(_LIBRARY):]}"
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def log_to_stderr(level: int = logging.INFO, *, prog: str | None = None) -> Iterator[None]:
    """Show the ``meshkit`` loggers' messages of ``level`` and above on stderr, inside.

    The messages do not also reach the root logger's handlers meanwhile (no line twice
    where an application has set up logging); everything is restored on leaving.

    Args:
        level: the lowest level shown.
        prog: the command (``"meshkit train"``): a message that starts with the
            library's ``meshkit:`` starts with ``meshkit train:`` instead.

    Examples:
        >>> import logging
        >>> with log_to_stderr(prog="meshkit train"):
        ...     logging.getLogger("meshkit.training").info("meshkit: starting")
    """
    logger = logging.getLogger("meshkit")
    handler = _Stderr(prog)
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
