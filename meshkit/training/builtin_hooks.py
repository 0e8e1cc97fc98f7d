"""The hooks :func:`meshkit.training.train` runs, in this order (:mod:`meshkit.training.hooks`).

* :class:`NonFiniteCheck`: a NaN/inf loss or gradient norm ends the run with
  :class:`~meshkit.errors.TrainingDiverged` before any later hook sees the step;
* :class:`Totals`: every step's loss, the dropped assignments (of a model that reports
  ``dropped`` and ``assignments``, as meshkit's MoE transformer does) and the training
  time, for the :class:`~meshkit.training.TrainResult`;
* :class:`ProgressBar`: tqdm;
* :class:`Evaluation` (``train.eval_every``): the eval loss, into the row;
* (the user's hooks;)
* :class:`MetricsRow` (``train.log_every``): the ``metrics.jsonl`` row;
* :class:`Checkpoint` (``train.checkpoint_every``);
* :class:`PreemptionStop`: after SIGTERM or SIGHUP, a checkpoint and
  :class:`~meshkit.errors.Preempted`;
* :class:`Profile` (``train.profile_steps``): a trace of a range of steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshkit.config import Config
from meshkit.data.sources import Dataset
from meshkit.errors import Preempted, TrainingDiverged
from meshkit.plan.flops import Utilization, utilization
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.hooks import Hook, StepInfo
from meshkit.training.metrics import MetricsWriter
from meshkit.training.preemption import Preemption
from meshkit.training.profiling import StepTrace
from meshkit.training.programs import Programs, make_lr

__all__ = [
    "Checkpoint",
    "Evaluation",
    "Flops",
    "MetricsRow",
    "NonFiniteCheck",
    "PreemptionStop",
    "Profile",
    "ProgressBar",
    "Totals",
]


def _first_non_finite(fetched: list[tuple[int, dict[str, Any]]]) -> tuple[int, float, float] | None:
    """``(step, loss, grad_norm)`` of the first step whose loss or gradient norm is NaN/inf.

    A finite gradient keeps the updated parameters finite, so checking both before each
    checkpoint means every checkpoint holds finite weights.
    """
    for step, m in fetched:
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return step, loss, grad_norm
    return None


# What a step's metrics count: the router's, summed into a dropped fraction.
_ROUTER = ("dropped", "assignments")


@dataclasses.dataclass(frozen=True)
class Flops:
    """Training FLOPs (forward and backward) of one token, as a run reports them.

    Attributes:
        per_token: the figure TFLOP/s and MFU use: given (``flops_per_token``), counted
            by :mod:`meshkit.plan.flops` for meshkit's transformer, else XLA's;
            ``None`` where none is known.
        xla_per_token: XLA's cost analysis of the compiled train step: one device's
            FLOPs per step × devices / tokens per step (``None``: no compiled step, or
            a backend without a cost model).

    Examples:
        >>> Flops(per_token=6e6, xla_per_token=7.2e6).per_token
        6000000.0
    """

    per_token: float | None
    xla_per_token: float | None = None


class _Rate:
    """tokens/s → TFLOP/s per device and MFU, at both counts of FLOPs, on these devices."""

    def __init__(self, config: Config, flops: Flops) -> None:
        self.flops = flops
        self._devices = config.num_devices
        self._kind = jax.devices()[0].device_kind

    def __call__(self, tokens_per_s: float) -> Utilization | None:
        """At :attr:`Flops.per_token`; ``None`` where that is not known."""
        return self._at(tokens_per_s, self.flops.per_token)

    def xla(self, tokens_per_s: float) -> Utilization | None:
        """At XLA's count; ``None`` where that is not known."""
        return self._at(tokens_per_s, self.flops.xla_per_token)

    def _at(self, tokens_per_s: float, per_token: float | None) -> Utilization | None:
        if per_token is None:
            return None
        return utilization(tokens_per_s, training_flops_per_token=per_token,
                           devices=self._devices, device_kind=self._kind)


class Checkpoint(Hook):
    """Save the state every ``every`` steps and after the last.

    Args:
        ckpt: the run's checkpoints.
        every: ``train.checkpoint_every``.

    Attributes:
        latest: the newest checkpoint's step (``None``: none yet).

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> hook = Checkpoint(Checkpointer(tempfile.mkdtemp()), every=10)
        >>> for step in (5, 10, 12):
        ...     hook(StepInfo(step=step, last_step=12, state={"w": jnp.ones(2)}, metrics=[],
        ...                   seconds=0.0))
        >>> hook.ckpt.all_steps(), hook.latest
        ([10, 12], 12)
    """

    def __init__(self, ckpt: Checkpointer, *, every: int) -> None:
        super().__init__(every=every)
        self.ckpt = ckpt
        self.latest = ckpt.latest_step()

    def __call__(self, info: StepInfo) -> None:
        if self.due(info.step, info.last_step):
            self.save(info)

    def save(self, info: StepInfo) -> None:
        """Save ``info.state`` as step ``info.step`` unless that step is saved already.

        Args:
            info: the stop.
        """
        if self.latest != info.step:
            self.ckpt.save(info.step, info.state)
            self.latest = info.step


class NonFiniteCheck(Hook):
    """At every stop: raise if a step's loss or gradient norm is NaN or inf.

    Args:
        checkpoint: the checkpoint hook, whose newest checkpoint the error names.

    Raises:
        TrainingDiverged: naming the first bad step (from :meth:`__call__`).

    Examples:
        >>> import tempfile
        >>> check = NonFiniteCheck(Checkpoint(Checkpointer(tempfile.mkdtemp()), every=10))
        >>> ok, bad = {"loss": 2.0, "grad_norm": 1.0}, {"loss": 2.0, "grad_norm": math.inf}
        >>> check(StepInfo(step=4, last_step=9, state=None, seconds=0.0,
        ...                metrics=[(3, ok), (4, bad)]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.errors.TrainingDiverged: loss became 2.0 (gradient norm inf) at step 4; ...
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(every=None)
        self._checkpoint = checkpoint

    def __call__(self, info: StepInfo) -> None:
        bad = _first_non_finite(info.metrics)
        if bad is not None:
            latest = self._checkpoint.latest
            raise TrainingDiverged(
                f"loss became {bad[1]} (gradient norm {bad[2]}) at step {bad[0]}; the "
                "newest checkpoint " + (f"(step {latest}) " if latest else "(none yet) ")
                + f"in {self._checkpoint.ckpt.directory} predates it and is intact"
            )


class Totals(Hook):
    """At every stop: keep every step's loss, the dropped assignments and the time.

    Args:
        config: the run config (the tokens of a step, the devices).
        flops: the model's FLOPs per token (default: none known).

    Attributes:
        losses: ``(step, loss)`` of every step so far.
        dropped, assignments: dropped and all expert assignments so far, of a model
            whose steps report ``dropped`` and ``assignments``.
        seconds: training time so far (:attr:`StepInfo.seconds` summed).

    Examples:
        >>> totals = Totals(Config())
        >>> m = {"loss": 2.0, "dropped": 1, "assignments": 10}
        >>> totals(StepInfo(step=2, last_step=9, state=None, metrics=[(1, m), (2, m)],
        ...                 seconds=0.5))
        >>> totals.losses, totals.dropped_fraction
        ([(1, 2.0), (2, 2.0)], 0.1)
    """

    def __init__(self, config: Config, flops: Flops | None = None) -> None:
        super().__init__(every=None)
        self._rate = _Rate(config, flops or Flops(per_token=None))
        self._tokens_per_step = config.train.batch_size * config.train.seq_len
        self.losses: list[tuple[int, float]] = []
        self.dropped = self.assignments = 0
        self._routed = False
        self.seconds = 0.0

    def __call__(self, info: StepInfo) -> None:
        for step, m in info.metrics:
            self.losses.append((step, float(m["loss"])))
            if all(name in m for name in _ROUTER):
                self._routed = True
                self.dropped += int(m["dropped"])
                self.assignments += int(m["assignments"])
        self.seconds += info.seconds

    @property
    def dropped_fraction(self) -> float | None:
        """Dropped over all expert assignments so far; ``None`` when no step reported
        them (a model without a router, or no step yet)."""
        return self.dropped / max(self.assignments, 1) if self._routed else None

    @property
    def tokens_per_s(self) -> float:
        """Training throughput over the steps so far."""
        return len(self.losses) * self._tokens_per_step / max(self.seconds, 1e-9)

    def utilization(self, *, xla: bool = False) -> Utilization | None:
        """Model TFLOP/s per device and MFU at :attr:`tokens_per_s` (zero before a step).

        Args:
            xla: at XLA's count of FLOPs instead of the model's.

        Returns:
            The :class:`~meshkit.plan.flops.Utilization`; ``None`` where that count of
            FLOPs is not known.
        """
        flops = self._rate.flops
        if (flops.xla_per_token if xla else flops.per_token) is None:
            return None
        if not self.losses:
            return Utilization(0.0, None)
        return (self._rate.xla if xla else self._rate)(self.tokens_per_s)


class ProgressBar(Hook):
    """A tqdm bar, moved at every stop; :meth:`show` puts a row's loss and tokens/s on it.

    Args:
        total: the run's last step.
        initial: the step it starts from.
        enabled: ``None``: only when stderr is a terminal.

    Examples:
        >>> bar = ProgressBar(100, 0, enabled=False)
        >>> bar.show({"loss": 2.0, "tokens_per_s": 1e5}); bar.close()
    """

    def __init__(self, total: int, initial: int, *, enabled: bool | None) -> None:
        super().__init__(every=None)
        if enabled is False:
            from tqdm import tqdm  # the plain class: tqdm.auto would warn without ipywidgets

            self._bar = tqdm(disable=True)
            return
        from tqdm.auto import tqdm as auto_tqdm

        # disable=None lets tqdm switch itself off when stderr is not a terminal.
        self._bar = auto_tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                              disable=None if enabled is None else False)

    def __call__(self, info: StepInfo) -> None:
        self._bar.update(len(info.metrics))

    def show(self, row: dict[str, Any]) -> None:
        """Show a metrics row's loss and tokens/s.

        Args:
            row: a ``metrics.jsonl`` row.
        """
        self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")

    def close(self) -> None:
        self._bar.close()


class Evaluation(Hook):
    """Every ``train.eval_every`` steps and after the last: the eval loss, into the row.

    Args:
        programs: the run's programs.
        dataset: the data source.
        config: the run config (``train.eval_every``, ``eval_batches``, ``seed``).

    Attributes:
        latest: the newest eval loss (NaN before the first).
        entropy_rate: the source's entropy rate (``None`` for file data).

    Example::

        evaluation = Evaluation(programs, config_dataset(config), config)
        evaluation.evaluate(state)  # the eval loss, also in evaluation.latest
    """

    def __init__(self, programs: Programs, dataset: Dataset, config: Config) -> None:
        super().__init__(every=config.train.eval_every)
        self._programs, self._dataset = programs, dataset
        self._seed, self._batches = config.train.seed, config.train.eval_batches
        self.latest = math.nan
        self.entropy_rate = dataset.entropy_rate()

    def evaluate(self, state: Any) -> float:
        """Evaluate ``state`` and keep the result in :attr:`latest`.

        Args:
            state: the NNX state.

        Returns:
            The eval cross-entropy (nats/token).
        """
        self.latest = self._programs.evaluate(state, self._dataset, seed=self._seed,
                                              batches=self._batches)
        return self.latest

    def __call__(self, info: StepInfo) -> None:
        if self.due(info.step, info.last_step):
            info.logs["eval_loss"] = self.evaluate(info.state)
            if self.entropy_rate is not None:
                info.logs["entropy_rate"] = self.entropy_rate


def _value(x: Any) -> Any:
    """A fetched metric as JSON: a number, or nested lists rounded to 4 decimals."""
    a = np.asarray(x)
    if a.ndim:
        return (a.round(4) if np.issubdtype(a.dtype, np.floating) else a).tolist()
    return int(a) if np.issubdtype(a.dtype, np.integer) or a.dtype == bool else float(a)


def _row(
    step: int, m: dict[str, Any], *, lr: Callable[[int], Any] | None, rate: _Rate,
    tokens_per_s: float,
) -> dict[str, Any]:
    """The metrics.jsonl row of a logged step, from its fetched metrics: the loss, the
    loss function's own metrics, then the step's."""
    row: dict[str, Any] = {"step": step, "loss": float(m["loss"])}
    row.update((name, _value(value)) for name, value in m.items()
               if name not in ("loss", "grad_norm", *_ROUTER))
    row["grad_norm"] = float(m["grad_norm"])
    if lr is not None:
        row["lr"] = float(lr(step - 1))
    row["tokens_per_s"] = tokens_per_s
    use, xla = rate(tokens_per_s), rate.xla(tokens_per_s)
    if use is not None:
        row["tflops_per_device"] = use.tflops_per_device
    if xla is not None:
        row["xla_tflops_per_device"] = xla.tflops_per_device
    if all(name in m for name in _ROUTER):
        row["dropped_fraction"] = int(m["dropped"]) / max(int(m["assignments"]), 1)
    if use is not None and use.mfu is not None:
        row["mfu"] = use.mfu
    return row


class MetricsRow(Hook):
    """Every ``train.log_every`` steps, after the last, and wherever an earlier hook put
    values in :attr:`StepInfo.logs`: write a ``metrics.jsonl`` row.

    tokens/s counts the steps since the previous row over their training time.

    A row holds ``step``, ``loss``, the loss function's metrics (arrays as lists),
    ``grad_norm``, ``lr`` (of meshkit's optimizer), ``tokens_per_s``, ``tflops_per_device`` and
    ``xla_tflops_per_device`` (where the FLOPs are known), ``dropped_fraction`` (for a
    model that reports ``dropped`` and ``assignments``), ``mfu`` (on a device of known
    peak), then what the hooks put in :attr:`StepInfo.logs`.

    Args:
        writer: the run's metrics writer.
        config: the run config (``train.log_every``, the lr schedule, the devices).
        flops: the model's FLOPs per token (default: none known).
        lr: log the learning rate of :func:`~meshkit.training.make_optimizer`'s schedule
            (false for an optimizer of the caller's, whose schedule meshkit cannot know).
        on_log: called with every row written, in order.

    Example::

        MetricsRow(MetricsWriter(workdir), config, on_log=[print])
    """

    def __init__(self, writer: MetricsWriter, config: Config, *, flops: Flops | None = None,
                 lr: bool = True, on_log: Sequence[Callable[[dict[str, Any]], None]] = ()
                 ) -> None:
        super().__init__(every=config.train.log_every)
        self._writer, self._on_log = writer, list(on_log)
        self._lr = make_lr(config) if lr else None
        self._rate = _Rate(config, flops or Flops(per_token=None))
        self._tokens_per_step = config.train.batch_size * config.train.seq_len
        self._steps, self._seconds = 0, 0.0

    def __call__(self, info: StepInfo) -> None:
        self._steps += len(info.metrics)
        self._seconds += info.seconds
        if not (self.due(info.step, info.last_step) or info.logs):
            return
        tokens_per_s = self._steps * self._tokens_per_step / max(self._seconds, 1e-9)
        row = _row(info.step, info.metrics[-1][1], lr=self._lr, rate=self._rate,
                   tokens_per_s=tokens_per_s) | info.logs
        self._steps, self._seconds = 0, 0.0
        self._writer.write(row)
        for fn in self._on_log:
            fn(row)


class PreemptionStop(Hook):
    """After a stop signal: checkpoint the step where every process agrees, and stop.

    Due at every agreement point (``every`` steps) and, on a process that got the
    signal, at every step, so that the steps up to it are fetched and checked first.

    Args:
        preemption: the run's :class:`~meshkit.training.preemption.Preemption`.
        checkpoint: the checkpoint hook (this hook goes after it: one save per step).
        every: the agreement period (``train.log_every``).

    Raises:
        Preempted: from :meth:`__call__`, after the checkpoint is saved.

    Example::

        checkpoint = Checkpoint(ckpt, every=config.train.checkpoint_every)
        hooks = [checkpoint, PreemptionStop(Preemption(), checkpoint, every=10)]
    """

    def __init__(self, preemption: Preemption, checkpoint: Checkpoint, *, every: int) -> None:
        super().__init__(every=every)
        self._preemption, self._checkpoint = preemption, checkpoint

    def due(self, step: int, last_step: int) -> bool:
        return step < last_step and (self._preemption.received is not None
                                     or super().due(step, last_step))

    def __call__(self, info: StepInfo) -> None:
        # Asked at every stop, after the logging hooks: a signal that came meanwhile
        # stops the run at this step.
        if info.step < info.last_step and self._preemption.should_stop(info.step):
            self._checkpoint.save(info)
            raise Preempted(f"stopped by {self._preemption.describe()} after step "
                            f"{info.step}; checkpoint {self._checkpoint.ckpt.step_dir(info.step)}"
                            " is saved: run the same command again to resume")


class Profile(Hook):
    """``train.profile_steps``: a ``jax.profiler`` trace of a range of steps.

    Args:
        steps: ``(start, stop)`` or ``None`` (no trace).
        directory: where the trace goes (:func:`meshkit.training.profiling.profile_dir`).
        first_step: the first step this run executes.

    Examples:
        >>> hook = Profile(None, "unused", first_step=1)  # no range: no trace
        >>> hook.before_step(1); hook.after_step(1, {}); hook.close()
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str, *, first_step: int) -> None:
        super().__init__(every=None)
        self._trace = StepTrace(steps, directory, first_step=first_step)

    def before_step(self, step: int) -> None:
        self._trace.before(step)

    def after_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._trace.after(step, metrics)

    def close(self) -> None:
        self._trace.close()
