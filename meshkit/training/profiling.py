"""``train.profile_steps``: a ``jax.profiler`` trace of a range of training steps.

The trace lands in ``<workdir>/profile`` (``<workdir>/profile/process_<i>`` when there
are several processes, so processes on one host do not overwrite each other's files) as
``plugins/profile/<time>/<host>.xplane.pb`` for TensorBoard's profile plugin and
``<host>.trace.json.gz`` for Perfetto (``ui.perfetto.dev``).
"""

from __future__ import annotations

import os
from typing import Any

import jax

__all__ = ["StepTrace", "profile_dir"]


def profile_dir(workdir: str, *, process_index: int, process_count: int) -> str:
    """Where a process writes its trace.

    Args:
        workdir: the run directory.
        process_index: this process's index.
        process_count: how many processes the run has.

    Returns:
        ``<workdir>/profile``, or ``<workdir>/profile/process_<i>`` with several processes.

    Examples:
        >>> profile_dir("run", process_index=1, process_count=2)
        'run/profile/process_1'
    """
    base = os.path.join(workdir, "profile")
    return base if process_count == 1 else os.path.join(base, f"process_{process_index}")


class StepTrace:
    """Start a trace before step ``start`` and stop it once step ``stop - 1`` has run.

    A run resumed inside the range traces the rest of it; one resumed past it traces
    nothing. Call :meth:`close` in a ``finally`` so an error mid-range ends the trace.

    Args:
        steps: ``(start, stop)`` from ``train.profile_steps``, or ``None`` (no trace).
        directory: where the trace goes (see :func:`profile_dir`).
        first_step: the first step this run executes.

    Examples:
        >>> trace = StepTrace(None, "unused", first_step=1)
        >>> trace.before(1); trace.after(1, None); trace.close()
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str, *, first_step: int) -> None:
        self._directory = directory
        self._begin: int | None = None
        self._end: int | None = None
        if steps is not None and max(steps[0], first_step) < steps[1]:
            self._begin, self._end = max(steps[0], first_step), steps[1] - 1
        self._active = False

    def before(self, step: int) -> None:
        """Called before a step is dispatched: starts the trace at the range's first step.

        Args:
            step: the step about to run.
        """
        if step == self._begin:
            os.makedirs(self._directory, exist_ok=True)
            jax.profiler.start_trace(self._directory)
            self._active = True

    def after(self, step: int, outputs: Any) -> None:
        """Called after a step is dispatched: at the range's last step, waits for its
        ``outputs`` (so the trace holds its device work) and stops the trace.

        Args:
            step: the step just dispatched.
            outputs: that step's results.
        """
        if self._active and step == self._end:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stop the trace if it is running (a no-op otherwise)."""
        if self._active:
            self._active = False
            jax.profiler.stop_trace()
