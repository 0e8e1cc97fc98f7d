"""Hooks: what the training loop does besides stepping, each due every ``N`` steps.

In the style of Levanter's trainer hooks: the loop (:func:`meshkit.training.train`)
only dispatches steps; everything else is a :class:`Hook`. After a step where some hook
is *due*, the loop *stops*: it copies the metrics of every step since the previous stop
to the host in one go and calls every hook, in order, with a :class:`StepInfo`. Between
stops, steps queue up on the devices without waiting for the host.

The hooks ``train`` itself runs (metrics, evaluation, checkpoints, preemption,
profiling, the progress bar) are in :mod:`meshkit.training.builtin_hooks`; a user's go
after the evaluation and before the metrics row and the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Hook", "StepInfo"]


@dataclasses.dataclass(kw_only=True)
class StepInfo:
    """A stop of the training loop, as the hooks see it.

    Attributes:
        step: the step just finished (a run's first step is 1).
        last_step: the run's last step (``train.steps``).
        state: the NNX state of ``(model, optimizer)`` after ``step``, on the devices.
            Read it during the call only: the next step donates (frees) it.
        metrics: ``(step, metrics)`` of every step since the previous stop, oldest
            first, ``step`` last, on the host: ``loss``, ``grad_norm`` and the loss
            function's own metrics (meshkit's transformer: ``ce_loss``, ``aux_loss``,
            ``z_loss``, ``dropped``, ``assignments``, ``expert_load``,
            ``nodes_per_token``).
        seconds: the training time of those steps, from the end of the previous stop's
            hooks to the end of the copy (evaluation, checkpoints and logging left out).
        logs: values for this step's ``metrics.jsonl`` row. A hook may add to it; the
            metrics hook writes a row at every stop where an earlier hook did.

    Examples:
        >>> info = StepInfo(step=10, last_step=20, state=None, seconds=0.5,
        ...                 metrics=[(9, {"loss": 2.5}), (10, {"loss": 2.25})])
        >>> info.loss
        2.25
    """

    step: int
    last_step: int
    state: Any
    metrics: list[tuple[int, dict[str, Any]]]
    seconds: float
    logs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        """This step's training loss."""
        return float(self.metrics[-1][1]["loss"])


class Hook:
    """Call ``fn(info)`` after every ``every``-th step and after the last step.

    Subclasses override :meth:`__call__` (called at every stop, due or not: it may keep
    count of what it sees) and, for work around each step's dispatch,
    :meth:`before_step` and :meth:`after_step`.

    Args:
        fn: called with the :class:`StepInfo` when the hook is due (``None``: nothing).
        every: the hook's period in steps; ``None``: at every stop the loop makes for
            another hook, so that it sees every step's metrics without adding stops.

    Raises:
        ValueError: ``every`` is not a positive integer or ``None``.

    Examples:
        >>> seen = []
        >>> hook = Hook(lambda info: seen.append(info.step), every=10)
        >>> [step for step in range(1, 26) if hook.due(step, 25)]
        [10, 20, 25]

        With :func:`meshkit.training.train` (the exception a hook raises ends the run)::

            def show(info: StepInfo) -> None:
                print(f"step {info.step}: loss {info.loss:.3f}")

            train(config, hooks=[Hook(show, every=10)])
    """

    def __init__(self, fn: Callable[[StepInfo], object] | None = None, *,
                 every: int | None = 1) -> None:
        if every is not None and (not isinstance(every, int) or isinstance(every, bool)
                                  or every < 1):
            raise ValueError(f"every must be a positive integer or None, got {every!r}")
        self.every = every
        self._fn = fn

    def due(self, step: int, last_step: int) -> bool:
        """Whether the loop must stop after ``step`` for this hook.

        Args:
            step: the step just dispatched.
            last_step: the run's last step.

        Returns:
            ``step`` is a multiple of ``every``, or the last step.
        """
        return self.every is not None and (step % self.every == 0 or step == last_step)

    def __call__(self, info: StepInfo) -> None:
        """At every stop: ``fn(info)`` if due here (every stop for ``every=None``).

        Args:
            info: the stop.
        """
        if self._fn is not None and (self.every is None or self.due(info.step, info.last_step)):
            self._fn(info)

    def before_step(self, step: int) -> None:
        """Before each step is dispatched; must not wait for the devices.

        Args:
            step: the step about to run.
        """

    def after_step(self, step: int, metrics: dict[str, Any]) -> None:
        """After each step is dispatched, before any stop.

        Args:
            step: the step just dispatched.
            metrics: its metrics, still on the devices.
        """

    def close(self) -> None:
        """Once, when the run ends (also by an exception)."""
