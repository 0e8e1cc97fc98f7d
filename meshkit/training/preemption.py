"""Stop a run cleanly on SIGTERM or SIGHUP: finish the step, checkpoint, exit with code 4.

Clusters stop (preempt) jobs with SIGTERM and kill them a grace period later (30 s or
more on SLURM; ``meshkit launch --grace``). A closed terminal sends SIGHUP; it too leaves
a checkpoint to resume from, so it ends the run the same way, with the same code (4:
"rerun the same command to resume"), and the message names the signal.
:class:`Preemption` is a context manager that records the signal instead of dying of it;
the training loop asks :meth:`Preemption.should_stop` after each step, saves a checkpoint
at that step when the answer is yes, and raises :class:`meshkit.errors.Preempted`.

**Several processes** must stop at the same step, or the ones still training wait
forever in a collective, and all must save (the save is collective too). The signal may
reach one process or all of them, at different steps. So with several processes the
flag is combined (:func:`meshkit.runtime.agree.agree_max`) only at *agreement points*, every
``every`` steps (the training loop uses ``train.log_every``, where it fetches metrics
anyway): no host round trip is added to the other steps. The latency is therefore at
most ``every`` steps plus one checkpoint write, which must fit in the grace period. With
one process no agreement is needed and the run stops after the step in flight.

**JAX's own SIGTERM handler.** ``jax.distributed.initialize`` starts JAX's preemption
service, whose C++ handler replaces any SIGTERM handler installed before it (the process
then neither dies nor tells Python) and only serves
``jax.experimental.multihost_utils.reached_preemption_sync_point``. Entering
:class:`Preemption` after ``initialize`` puts meshkit's handler in its place, as
``meshkit train`` does; on leaving, the previous Python-level handler comes back (JAX's
C++ handler is invisible to Python, so after a multi-process run SIGTERM has its default
effect again: it ends the process).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "Preemption"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that ask a training run to checkpoint and stop (Ctrl-C, SIGINT, still
interrupts at once)."""


class Preemption:
    """Record a stop signal while training; decide, with the other processes, when to stop.

    Args:
        agree: :func:`meshkit.runtime.agree.agree_max`, or ``None`` for one process.
        every: with ``agree``, combine the processes' flags every this many steps.
        signals: the signals to catch.

    Attributes:
        received: the first signal caught here (its number), or ``None``.

    Raises:
        ValueError: ``every`` < 1.

    Examples:
        >>> import os
        >>> with Preemption() as stop:
        ...     before = stop.should_stop(1)
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     before, stop.should_stop(2), stop.received == signal.SIGTERM
        (False, True, True)
    """

    def __init__(
        self,
        agree: Callable[[Sequence[int]], list[int]] | None = None,
        *,
        every: int = 1,
        signals: Sequence[int] = STOP_SIGNALS,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be ≥ 1, got {every}")
        self._agree = agree
        self._every = every
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> Preemption:
        # Python runs signal handlers in the main thread only; elsewhere (a notebook's
        # worker thread) the signals keep their previous handling.
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only record: the loop acts at a step boundary, never mid-step or mid-save.
        if self.received is None:
            self.received = signum

    def should_stop(self, step: int) -> bool:
        """Whether the run should checkpoint and stop after ``step`` (every process agrees).

        Call it after every step, on every process.

        Args:
            step: the step just finished.

        Returns:
            One process: whether a signal arrived. Several: at an agreement point
            (``step % every == 0``), whether any process got one; elsewhere ``False``.
        """
        if self._agree is None:
            return self.received is not None
        if step % self._every:
            return False
        return bool(self._agree([int(self.received is not None)])[0])

    def describe(self) -> str:
        """Why the run stopped, for the :class:`~meshkit.errors.Preempted` message.

        Returns:
            ``"SIGTERM"`` or ``"SIGHUP"`` or, on a process that got no signal itself, a
            sentence saying another process did.
        """
        if self.received is None:
            return "a stop signal to another process"
        return signal.Signals(self.received).name
