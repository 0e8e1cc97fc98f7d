"""Ctrl-C that is never lost: ``KeyboardInterrupt`` raised where Python would drop it.

Python runs a signal handler at the next bytecode of the main thread. If that is inside
a garbage-collector callback (JAX's ``_xla_gc_callback``) or a ``__del__``, the exception
it raises is printed as "Exception ignored in ..." and dropped, and the run goes on.
:func:`raise_interrupt` sends the signal again a moment later instead, to land outside.
The CLI and the checkpoint's held-back Ctrl-C both use it.
"""

from __future__ import annotations

import gc
import os
import threading
from types import FrameType

__all__ = ["raise_interrupt", "swallowed_here"]

_RETRY_S = 0.01


def swallowed_here(frame: FrameType | None) -> bool:
    """Whether an exception raised in ``frame`` would be printed and dropped: inside a
    garbage-collector callback (JAX's ``_xla_gc_callback``) or a ``__del__``.

    Args:
        frame: the frame a signal interrupted (``None``: not a signal's).

    Returns:
        True where an exception would be dropped.

    Examples:
        >>> import sys
        >>> swallowed_here(sys._getframe())
        False
    """
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGINT handler: ``KeyboardInterrupt``, as Python's own, but never where it
    would be dropped ("Exception ignored in: _xla_gc_callback", and the run went on):
    there the signal is sent again a moment later, to land outside.

    Args:
        signum: the signal (SIGINT).
        frame: the frame it interrupted.

    Raises:
        KeyboardInterrupt: unless ``frame`` would drop it.
    """
    if swallowed_here(frame):
        threading.Timer(_RETRY_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt
