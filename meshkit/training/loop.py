"""Training: ``train(config) -> TrainResult``, the one entry point for CLI, scripts and notebooks.

The loop, under ``jax.set_mesh(strategy.mesh())``, runs the programs of
:mod:`meshkit.training.programs` and does everything else in hooks
(:mod:`meshkit.training.hooks`, :mod:`meshkit.training.builtin_hooks`). It trains any Flax NNX
model: ``train(config, model=factory, loss=loss_fn)`` (:mod:`meshkit.training.models`), or
the one the config names (``model.factory``); meshkit's MoE transformer by default,
through the same two functions.

* **Data** is a pure function of ``(train.seed, step)``; meshkit's model has no dropout
  and the router no noise; so a run resumed from a checkpoint continues exactly as if it
  had never stopped (a user's model too, if it is deterministic).
  Each process loads only the rows its own devices hold (:mod:`meshkit.data.batches`).
* **No wait on the host per step**: each step's metrics stay on the device, and the loop
  fetches them only where a hook is due (every ``train.log_every`` steps, before a
  checkpoint and at the end), so steps queue up behind each other.
* **Checkpoints** every ``train.checkpoint_every`` steps and at the end, only after the
  loss and gradient norm of every step so far were fetched and finite: a NaN or inf
  stops the run with :class:`TrainingDiverged` naming the first bad step, and the newest
  checkpoint is a good one. A run resumes from the newest *intact* checkpoint; damaged
  ones are moved aside (:mod:`meshkit.training.recovery`). Each records the order of the
  transformer's stacked layers, which a resume under another pipeline layout puts into
  its own (:mod:`meshkit.training.layout`).
* **SIGTERM** (preemption) or **SIGHUP** (a closed terminal) ends the run after a
  checkpoint at the step where every process agrees to stop, with
  :class:`~meshkit.errors.Preempted` (exit code 4; :mod:`meshkit.training.preemption`);
  the steps up to it are fetched and checked first.
* **Metrics** every ``train.log_every`` steps to ``<workdir>/metrics.jsonl`` (process 0):
  the loss, the loss function's own metrics, model TFLOP/s per device and, on a device
  kind of known peak, MFU (:mod:`meshkit.plan.flops`). The model's FLOPs per token are
  given (``flops_per_token``), counted (meshkit's transformer) or XLA's count of the
  compiled step; XLA's count is reported next to the others as ``xla_tflops_per_device``.
* **Profile**: ``train.profile_steps`` traces those steps (:mod:`meshkit.training.profiling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import optax

from meshkit.config import (
    Config,
    ConfigError,
    check_devices,
    context_method,
    moe_tensor,
    read_config_file,
)
from meshkit.data.sources import Dataset, make_dataset
from meshkit.runtime.agree import agree_max, first_disagreement
from meshkit.sharding.place import ShardingError
from meshkit.sharding.rules import ShardingRules
from meshkit.training.builtin_hooks import (
    Checkpoint,
    Evaluation,
    Flops,
    MetricsRow,
    NonFiniteCheck,
    PreemptionStop,
    Profile,
    ProgressBar,
    Totals,
)
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.hooks import Hook, StepInfo
from meshkit.training.layout import (
    LAYOUT_KEY,
    layer_layout,
    layer_moves,
    reorder,
    saved_target,
)
from meshkit.training.metrics import MetricsWriter
from meshkit.training.models import Factory, LossFn, ModelSpec, resolve_model
from meshkit.training.preemption import Preemption
from meshkit.training.preflight import CONFIG_FILE, StateBytes, check_memory, check_workdir
from meshkit.training.profiling import profile_dir
from meshkit.training.programs import Programs, state_bytes, step_flops
from meshkit.training.recovery import restore_newest_intact
from meshkit.training.workdir_lock import lock_workdir

__all__ = ["TrainResult", "config_dataset", "train"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a call of :func:`train` did.

    Attributes:
        workdir: the run directory.
        start_step: the step it started from (0, or the checkpoint it resumed).
        final_step: the last step completed.
        losses: ``(step, loss)`` for every step this call ran.
        eval_loss: the final evaluation loss: the loss function's ``ce_loss`` metric
            where it returns one (meshkit's transformer: the cross-entropy in
            nats/token), else the loss.
        entropy_rate: the data source's entropy rate, the best possible eval
            cross-entropy (``None`` for file data).
        tokens_per_s: training throughput over this call (data, step and fetching the
            metrics; compilation, evaluation and checkpoints excluded).
        compile_s: seconds spent compiling the train step.
        dropped_fraction: fraction of expert assignments dropped over this call;
            ``None`` when no step reported ``dropped`` and ``assignments`` metrics (a
            model without a router, or a call with no step left to run).
        tflops_per_device: model TFLOP/s per device at ``tokens_per_s``
            (:func:`meshkit.plan.flops.utilization`) at ``flops_per_token``; ``None``
            where that is not known (a user's model on a backend without a cost model).
        mfu: model FLOPs utilisation, on a device kind of known peak; else ``None``.
        flops_per_token: the training FLOPs per token behind ``tflops_per_device``:
            given, counted (meshkit's transformer, :mod:`meshkit.plan.flops`), or XLA's.
        xla_flops_per_token: XLA's count of the compiled train step's FLOPs, per token
            (one device's per step × devices / tokens per step); ``None`` without a
            compiled step or a cost model.
        xla_tflops_per_device: TFLOP/s per device at ``tokens_per_s`` by XLA's count.
    """

    workdir: str
    start_step: int
    final_step: int
    losses: list[tuple[int, float]]
    eval_loss: float
    entropy_rate: float | None
    tokens_per_s: float
    compile_s: float
    dropped_fraction: float | None
    tflops_per_device: float | None
    mfu: float | None
    flops_per_token: float | None = None
    xla_flops_per_token: float | None = None
    xla_tflops_per_device: float | None = None


def config_dataset(config: Config) -> Dataset:
    """The config's data source, its errors reported as config errors (before compiling).

    Args:
        config: a validated config; its ``data`` section and ``model.vocab_size``.

    Returns:
        The :class:`meshkit.data.sources.Dataset` that ``meshkit train`` draws batches from.

    Raises:
        ConfigError: the data source cannot be made (a missing file, a vocabulary too
            small for text, a token file of another dtype than ``data.dtype`` or with a
            token outside the vocabulary), or ``train.seq_len`` does not fit it; the
            message starts with ``data:``.

    Examples:
        >>> from meshkit.config import Config
        >>> config_dataset(Config()).vocab_size
        16
    """
    d = config.data
    try:
        dataset = make_dataset(d.kind, path=d.path, vocab_size=config.model.vocab_size,
                               order=d.order, seed=d.seed, concentration=d.concentration,
                               dtype=d.dtype)
        dataset.check_seq_len(config.train.seq_len)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data: {e}") from e
    return dataset


def _mesh(config: Config) -> jax.sharding.Mesh:
    """The config's mesh; a layout that does not fit the processes is a config error."""
    try:
        return config.strategy().mesh()
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None


def _write_atomically(path: str, text: str) -> None:
    """Write via a temporary file, so a concurrent reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def train(
    config: Config,
    *,
    model: Factory | None = None,
    loss: LossFn | None = None,
    rules: ShardingRules | None = None,
    optimizer: optax.GradientTransformation | None = None,
    flops_per_token: float | None = None,
    progress: bool | None = None,
    verbose: bool = True,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    sync_every_step: bool = False,
    hooks: Sequence[Hook] = (),
) -> TrainResult:
    """Train a model (by default the MoE transformer a config describes), resuming from
    its workdir.

    The start line and the final summary are logged at INFO level on the
    ``meshkit.training`` logger (process 0 only): ``meshkit train`` shows them; a script or
    notebook sees them after ``logging.basicConfig(level=logging.INFO)``. Warnings (a
    damaged checkpoint moved aside, a resume with changed data settings) are logged as
    warnings, which Python shows on stderr even without any logging set up.

    Args:
        config: a validated :class:`~meshkit.config.Config`: the mesh and roles, the
            data, the optimisation and the run; its ``model`` section for meshkit's
            transformer (with a factory of your own, only ``model.vocab_size`` counts:
            the data's token ids). Without ``model.factory`` the config is checked
            against the transformer's sizes even when ``model`` is given.
        model: ``factory(rngs: nnx.Rngs) -> nnx.Module``, your own model (default:
            ``model.factory``, else meshkit's transformer). Its parameters name their
            dimensions in ``out_sharding`` metadata; the state is created inside
            ``jax.jit``, each device making only its share, and the model is created
            and traced under ``nnx.logical_axis_rules(rules.flax_rules())``.
        loss: ``loss(model, batch) -> loss`` or ``(loss, metrics)``, ``batch`` the
            ``[B, T+1]`` int32 token batch on the mesh, ``metrics`` a dict of arrays
            logged next to the loss (default: ``model.loss``, else the transformer's own
            loss, else next-token cross-entropy of ``model(batch[:, :-1])``'s logits).
        rules: where the parameters' logical names go on the mesh (default:
            ``ShardingRules.from_config(config)`` extended by ``parallel.logical_axes``).
        optimizer: an optax transformation (default: AdamW with warmup and cosine decay
            from the ``train`` section, :func:`meshkit.training.make_optimizer`).
        flops_per_token: training FLOPs of one token, for TFLOP/s and MFU (default:
            ``model.flops_per_token``, else counted for the transformer, else XLA's
            cost analysis of the compiled step).
        progress: show a tqdm bar (``None``: only when stderr is a terminal).
        verbose: log the start line and the final summary.
        on_log: deprecated since 0.2 (it warns, and goes in 0.3): a
            ``Hook(fn, every=None)`` in ``hooks`` sees every stop's
            :class:`~meshkit.training.hooks.StepInfo`; the rows are in ``metrics.jsonl``.
        sync_every_step: fetch every step's metrics as soon as it finishes, so only one
            step is ever queued: the old loop, kept as ``meshkit bench train``'s baseline.
            The results are the same either way.
        hooks: more :class:`~meshkit.training.hooks.Hook` s, run in order after the
            evaluation and before the metrics row (so they may add to
            :attr:`~meshkit.training.hooks.StepInfo.logs`) and the checkpoint.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: before anything compiles: processes started with different
            configs (the first differing key named), fewer devices than the mesh needs, a
            mesh that does not fit the processes' devices, more memory than the host has,
            bad data, a parameter's logical name that ``parallel.logical_axes`` does not
            map, or a workdir that cannot hold the run (see
            :func:`meshkit.training.preflight.check_workdir`: not a writable directory, a damaged
            or missing ``config.yaml``, another model's run).
            Also, once the run has started, the devices running out of memory (XLA's
            ``RESOURCE_EXHAUSTED``), naming the settings to reduce.
        ShardingError: as above, where ``rules`` were given.
        TrainingDiverged: the loss became NaN or inf; the newest checkpoint is good.
        Preempted: SIGTERM or SIGHUP arrived (in the main thread); a checkpoint of the
            step where the processes stopped was written first.
        NoIntactCheckpoint: every checkpoint in the workdir was damaged (each was moved
            aside and named in a warning).
        WorkdirLocked: another live run holds ``<workdir>/.lock`` (its PID is named);
            a lock left by a dead run is taken over with a warning.
        Exception: whatever a hook, the factory or the loss raised, unchanged.

    Example::

        config = load_config(None, ["train.steps=20", "train.workdir=/tmp/meshkit-run"])
        losses = []
        result = train(config, hooks=[Hook(lambda info: losses.append(info.loss), every=5)])
        result.final_step, result.eval_loss, result.entropy_rate, len(losses)
        # (20, <eval loss>, <the Markov source's entropy rate, the best possible loss>, 4)

        # Your own model: its parameters' logical names mapped in parallel.logical_axes
        # (or rules=), e.g. a GPT built from meshkit.ColumnParallelLinear and friends.
        result = train(config, model=lambda rngs: GPT(rngs), loss=next_token_loss)
        result.tflops_per_device  # from XLA's count of the compiled step
    """
    if on_log is not None:
        warnings.warn("train(on_log=fn) is deprecated: pass hooks=[Hook(fn, every=None)], "
                      "which sees each stop's StepInfo (info.step, info.loss, info.logs)",
                      DeprecationWarning, stacklevel=2)
    t = config.train
    # First, before any other collective: processes that disagree on the config would
    # part ways at the first key that differs (one waiting for a step the other never
    # takes) and hang; they all stop here instead, naming the key.
    _check_same_config(config)
    # Every check before anything compiles: a run that cannot finish says so at once.
    check_devices(config, jax.device_count())
    mesh = _mesh(config)
    spec = resolve_model(config, model=model, loss=loss, rules=rules,
                         flops_per_token=flops_per_token)
    local_devices = max(1, config.num_devices // jax.process_count())
    check_memory(config, platform=jax.devices()[0].platform, local_devices=local_devices,
                 state=None if spec.transformer else _state_bytes(
                     config, mesh, spec=spec, optimizer=optimizer,
                     rules_given=rules is not None))
    dataset = config_dataset(config)
    lead = jax.process_index() == 0
    workdir = check_workdir(config, lead=lead)
    agree = agree_max if jax.process_count() > 1 else None
    # From here a SIGTERM or SIGHUP is recorded, not fatal (and not swallowed by JAX's preemption
    # service): the loop acts on it at the next agreement point.
    preemption = Preemption(agree, every=t.log_every)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_out_of_memory_names_what_to_reduce())
        if lead:  # one run per workdir; the other processes never wait on the lock
            stack.enter_context(lock_workdir(workdir))
        # meshkit's transformer stacks its layers in an order of the pipeline layout's:
        # each checkpoint records it, and a restore under another order reorders them.
        layout = layer_layout(config) if spec.transformer else None
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                            metadata=None if layout is None else {LAYOUT_KEY: layout})
        stack.callback(ckpt.close)
        stack.enter_context(preemption)
        stack.enter_context(jax.set_mesh(mesh))
        programs = Programs(config, mesh, spec=spec, optimizer=optimizer)
        # Restored into the abstract state, every leaf with its NamedSharding (optimizer
        # counters too): a checkpoint of any layout lands on this mesh, and a fresh
        # state is only created when there is nothing to restore.
        start, restored = restore_newest_intact(
            ckpt, programs.abstract_state, agree=agree,
            process=(jax.process_index(), jax.process_count()),
            adapt=None if layout is None else functools.partial(
                _reordering, ckpt, programs, layout, assumed=_saved_layout(workdir),
                lead=lead))
        state = restored if start else programs.init()
        if lead:
            os.makedirs(workdir, exist_ok=True)
            _write_atomically(os.path.join(workdir, "config.yaml"), config.to_yaml())
        writer = MetricsWriter(workdir, resume_step=start, enabled=lead)
        stack.callback(writer.close)
        if verbose and lead:
            where = f"resuming from step {start}" if start else "starting"
            _log.info(f"meshkit: {where}; {config.strategy()!r} on {jax.device_count()} "
                      f"devices ({jax.process_count()} processes); roles "
                      f"{config.describe_roles()}; workdir {workdir}")
            picked = moe_tensor.picked(config) if spec.transformer else None
            if picked:
                _log.info(f"meshkit: parallel.moe_tensor auto: {picked}")
            picked = context_method.picked(config) if spec.transformer else None
            if picked:
                _log.info(f"meshkit: parallel.context_method auto: {picked}")
        batch_of = functools.partial(programs.load_batch, dataset, seed=t.seed, split="train")
        steps = range(start + 1, t.steps + 1)
        first = batch_of(start) if steps else None
        step_fn, compile_s = _compile(programs, state, first)
        flops = _flops(config, spec, step_fn)
        totals, evaluation = Totals(config, flops), Evaluation(programs, dataset, config)
        checkpoint = Checkpoint(ckpt, every=t.checkpoint_every)
        bar = ProgressBar(t.steps, start, enabled=progress if lead else False)
        trace = profile_dir(workdir, process_index=jax.process_index(),
                            process_count=jax.process_count())
        everything = [
            NonFiniteCheck(checkpoint), totals, bar, evaluation, *hooks,
            MetricsRow(writer, config, flops=flops, lr=optimizer is None,
                       on_log=[f for f in (on_log, bar.show) if f is not None]),
            checkpoint, PreemptionStop(preemption, checkpoint, every=t.log_every),
            Profile(t.profile_steps, trace, first_step=start + 1),
            *([Hook(every=1)] if sync_every_step else []),  # a stop after every step
        ]
        with contextlib.ExitStack() as closing:
            for hook in everything:
                closing.callback(hook.close)
            if step_fn is not None:
                _drive(step_fn, state, first, batch_of=batch_of, hooks=everything, steps=steps)
        if not totals.losses:  # already at the end: evaluate the restored state
            evaluation.evaluate(state)
    use, xla = totals.utilization(), totals.utilization(xla=True)
    result = TrainResult(
        workdir=workdir, start_step=start, final_step=max(start, t.steps), losses=totals.losses,
        eval_loss=evaluation.latest, entropy_rate=evaluation.entropy_rate,
        tokens_per_s=totals.tokens_per_s, compile_s=compile_s,
        dropped_fraction=totals.dropped_fraction,
        tflops_per_device=None if use is None else use.tflops_per_device,
        mfu=None if use is None else use.mfu,
        flops_per_token=flops.per_token, xla_flops_per_token=flops.xla_per_token,
        xla_tflops_per_device=None if xla is None else xla.tflops_per_device)
    if verbose and lead:
        _log.info(_summary(result))
    return result


def _saved_layout(workdir: str) -> dict[str, Any] | None:
    """The layer layout of the workdir's ``config.yaml`` (the run that wrote its
    checkpoints; :func:`meshkit.training.preflight.check_workdir` has checked it), or
    ``None``."""
    try:
        return layer_layout(Config.from_dict(read_config_file(
            os.path.join(workdir, CONFIG_FILE))))
    except (OSError, ValueError):  # none yet (a ConfigError is a ValueError)
        return None


def _reordering(ckpt: Checkpointer, programs: Programs, layout: dict[str, Any], step: int,
                *, assumed: dict[str, Any] | None, lead: bool
                ) -> tuple[Any, Callable[[Any], Any]] | None:
    """How to restore checkpoint ``step`` when its stacked layers lie in another order
    than this run's layout puts them (see :func:`restore_newest_intact`'s ``adapt``)."""
    moves = layer_moves(ckpt.saved_metadata(step, LAYOUT_KEY), layout, assumed=assumed)
    if moves is None:
        return None
    if lead:
        _log.info(f"meshkit: checkpoint {ckpt.step_dir(step)} holds the layers in another "
                  "order than this run's pipeline layout: moving each to its slot here")
    return (saved_target(programs.abstract_state, moves),
            functools.partial(reorder, moves=moves, shardings=programs.state_sharding))


def _check_same_config(config: Config) -> None:
    """Every process runs the same config, or every process raises (one collective)."""
    if jax.process_count() == 1:
        return
    flat = [(f"{section}.{key}", value)
            for section, keys in config.to_dict().items() for key, value in keys.items()]
    key = first_disagreement(flat)
    if key is not None:
        here = dict(flat)[key]
        raise ConfigError(
            f"{key} differs between the processes (process {jax.process_index()} of "
            f"{jax.process_count()} has {here!r}); every process must run the same config")


@contextlib.contextmanager
def _out_of_memory_names_what_to_reduce() -> Iterator[None]:
    """An XLA out-of-memory (compiling or running) becomes a :class:`ConfigError` (exit
    code 2) naming the settings to reduce: it is the run's size, not a bug in meshkit."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if "RESOURCE_EXHAUSTED" not in first:
            raise
        raise ConfigError(
            f"train.batch_size: the devices ran out of memory ({first[:200]}): reduce "
            "train.batch_size or train.seq_len, or the model (model.d_model, model.d_ff, "
            "model.num_layers, model.num_experts), or spread it over more devices "
            "(mesh.axes)") from e


def _state_bytes(config: Config, mesh: jax.sharding.Mesh, *, spec: ModelSpec,
                 optimizer: optax.GradientTransformation | None,
                 rules_given: bool) -> StateBytes:
    """One device's bytes of a user model's state; a logical name that the config's
    rules do not map is a config error naming ``parallel.logical_axes``."""
    try:
        return state_bytes(config, mesh, spec=spec, optimizer=optimizer)
    except ShardingError as e:
        if rules_given:
            raise
        raise ConfigError(f"parallel.logical_axes: {e}") from None


def _flops(config: Config, spec: ModelSpec, step_fn: jax.stages.Compiled | None) -> Flops:
    """The model's FLOPs per token: the spec's, and XLA's count of the compiled step."""
    per_step = None if step_fn is None else step_flops(step_fn)
    tokens = config.train.batch_size * config.train.seq_len
    xla = None if per_step is None else per_step * config.num_devices / tokens
    return Flops(per_token=spec.flops_per_token if spec.flops_per_token is not None else xla,
                 xla_per_token=xla)


def _compile(programs: Programs, state: Any, batch: Any
             ) -> tuple[jax.stages.Compiled | None, float]:
    """The train step compiled for ``(state, batch)`` (``None`` without a batch: no step
    to run), and the seconds that took: compiled ahead of time, it is timed apart from
    training."""
    began = time.perf_counter()
    step_fn = None if batch is None else programs.train_step.lower(state, batch).compile()
    return step_fn, time.perf_counter() - began


def _drive(step_fn: Callable[..., Any], state: Any, batch: Any, *,
           batch_of: Callable[[int], Any], hooks: list[Hook], steps: range) -> Any:
    """Run ``steps``; after a step where a hook is due, fetch the metrics, call the hooks.

    Returns the final state.
    """
    last = steps[-1]
    pending: list[tuple[int, dict[str, Any]]] = []  # steps whose metrics are on the device
    clock = time.perf_counter()
    for step in steps:
        for hook in hooks:
            hook.before_step(step)
        state, metrics = step_fn(state, batch)
        pending.append((step, metrics))
        if step < last:
            batch = batch_of(step)  # loads while the step runs
        for hook in hooks:
            hook.after_step(step, metrics)
        if not any(hook.due(step, last) for hook in hooks):
            continue  # nothing needs the host: queue the next step at once
        fetched, pending = _fetch(pending), []
        info = StepInfo(step=step, last_step=last, state=state, metrics=fetched,
                        seconds=time.perf_counter() - clock)
        for hook in hooks:
            hook(info)
        clock = time.perf_counter()
    return state


def _fetch(pending: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Copy queued steps' metrics to the host in one go (every copy started before any
    is waited on)."""
    local = [(step, {k: v.addressable_data(0) for k, v in m.items()}) for step, m in pending]
    return jax.device_get(local)


def _summary(result: TrainResult) -> str:
    if not result.losses:  # a finished run resumed: no throughput to speak of
        line = (f"step {result.final_step}: nothing left to train (the checkpoint is at "
                f"step {result.start_step}; raise train.steps to train further); eval loss "
                f"{result.eval_loss:.4f} nats/token")
        return line + _entropy_line(result)
    mfu = "" if result.mfu is None else f", MFU {result.mfu:.1%}"
    by_xla = result.flops_per_token == result.xla_flops_per_token
    what = "TFLOP/s per device by XLA's count" if by_xla else "model TFLOP/s per device"
    rate = ("" if result.tflops_per_device is None else
            f" ({result.tflops_per_device:.3g} {what}{mfu})")
    dropped = ("" if result.dropped_fraction is None
               else f", dropped {result.dropped_fraction:.2%}")
    line = (f"step {result.final_step}: eval loss {result.eval_loss:.4f} nats/token, "
            f"{result.tokens_per_s:,.0f} tokens/s{rate}{dropped}")
    if (result.xla_tflops_per_device is not None and result.flops_per_token is not None
            and not by_xla):
        ratio = (result.xla_flops_per_token or 0.0) / result.flops_per_token
        line += (f"\n  XLA's cost analysis of the step: {result.xla_tflops_per_device:.3g} "
                 f"TFLOP/s per device ({ratio:.2f}× the model FLOPs)")
    return line + _entropy_line(result)


def _entropy_line(result: TrainResult) -> str:
    if result.entropy_rate is None:
        return ""
    gap = result.eval_loss / result.entropy_rate - 1
    return (f"\n  source entropy rate {result.entropy_rate:.4f} nats/token "
            f"(the best possible eval loss): the model is {gap:+.1%} from it")
