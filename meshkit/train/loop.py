"""Training: ``train(config) -> TrainResult``, the one entry point for CLI, scripts and notebooks.

The loop, under ``jax.set_mesh(strategy.mesh())``:

* **State** is the NNX state of ``(model, optimizer)``, created inside ``jax.jit`` with
  ``out_shardings`` from the parameters' partition metadata: expert weights (and their
  AdamW moments) are split over the expert axes, everything else replicated. The same
  recipe works with one process or many.
* **Step**: a pure ``jax.jit`` function of ``(state, batch)`` with the state donated:
  cross-entropy + ``aux_loss_weight`` · load-balancing loss + ``z_loss_weight`` · z-loss,
  gradients, optax AdamW (warmup + cosine decay, global-norm clipping).
* **Data** is a pure function of ``(train.seed, step)``; the model has no dropout and the
  router no noise; so a run resumed from a checkpoint continues exactly as if it had
  never stopped.
  Each process loads only the rows its own devices hold (:mod:`meshkit.data.batches`).
* **No wait on the host per step**: each step's metrics stay on the device, and the loop
  fetches them only every ``train.log_every`` steps, before a checkpoint and at the end,
  so steps queue up behind each other.
* **Checkpoints** every ``train.checkpoint_every`` steps and at the end, only after the
  loss and gradient norm of every step so far were fetched and finite: a NaN or inf
  stops the run with :class:`TrainingDiverged` naming the first bad step, and the newest
  checkpoint is a good one. A run resumes from the newest *intact* checkpoint; damaged
  ones are moved aside (:mod:`meshkit.train.recovery`).
* **SIGTERM** (preemption) ends the run after a checkpoint at the step where every
  process agrees to stop, with :class:`~meshkit.errors.Preempted` (exit code 4;
  :mod:`meshkit.train.preemption`); the steps up to it are fetched and checked first.
* **Metrics** every ``train.log_every`` steps to ``<workdir>/metrics.jsonl`` (process 0),
  with model TFLOP/s per device and, on a device kind of known peak, MFU
  (:mod:`meshkit.plan.flops`).
* **Profile**: ``train.profile_steps`` traces those steps (:mod:`meshkit.train.profiling`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.config import Config, ConfigError, check_devices
from meshkit.data.batches import load_batch
from meshkit.data.sources import Dataset, make_dataset
from meshkit.errors import Preempted, TrainingDiverged
from meshkit.model.transformer import Transformer
from meshkit.plan.flops import Utilization, flops_per_token, utilization
from meshkit.runtime.agree import agree_max
from meshkit.sharding.rules import ShardingRules
from meshkit.train.checkpoint import Checkpointer
from meshkit.train.metrics import MetricsWriter
from meshkit.train.preemption import Preemption
from meshkit.train.preflight import check_memory, check_workdir
from meshkit.train.profiling import StepTrace, profile_dir
from meshkit.train.recovery import restore_newest_intact

__all__ = [
    "Programs",
    "TrainResult",
    "TrainingDiverged",
    "build_model",
    "compile_step",
    "config_dataset",
    "init_state",
    "make_lr",
    "make_optimizer",
    "train",
]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a call of :func:`train` did.

    Attributes:
        workdir: the run directory.
        start_step: the step it started from (0, or the checkpoint it resumed).
        final_step: the last step completed.
        losses: ``(step, loss)`` for every step this call ran.
        eval_loss: the final evaluation cross-entropy (nats/token).
        entropy_rate: the data source's entropy rate, the best possible eval loss
            (``None`` for file data).
        tokens_per_s: training throughput over this call (data, step and fetching the
            metrics; compilation, evaluation and checkpoints excluded).
        compile_s: seconds spent compiling the train step.
        dropped_fraction: fraction of expert assignments dropped over this call.
        tflops_per_device: model TFLOP/s per device at ``tokens_per_s``
            (:func:`meshkit.plan.flops.utilization`).
        mfu: model FLOPs utilisation, on a device kind of known peak; else ``None``.
    """

    workdir: str
    start_step: int
    final_step: int
    losses: list[tuple[int, float]]
    eval_loss: float
    entropy_rate: float | None
    tokens_per_s: float
    compile_s: float
    dropped_fraction: float
    tflops_per_device: float
    mfu: float | None


def build_model(config: Config, *, rngs: nnx.Rngs | None = None) -> Transformer:
    """The :class:`~meshkit.model.transformer.Transformer` a config describes.

    Args:
        config: the run config (model, parallel and exchange sections, mesh axes).
        rngs: initialisation randomness (default ``nnx.Rngs(config.train.seed)``).

    Returns:
        An unsharded model; :func:`init_state` creates it sharded inside ``jax.jit``.

    Example::

        model = build_model(Config())  # unsharded: see meshkit.model.moe.shard_model
        model.layers.qkv.shape[0] == Config().model.num_layers
        # True
    """
    return Transformer.from_config(config, rngs=rngs)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW with linear warmup, cosine decay to 10 %, and global-norm clipping.

    Weight decay applies to matrices only (not norms' scales).

    Args:
        config: the run config (``train.lr``, ``warmup_steps``, ``steps``,
            ``weight_decay``, ``grad_clip``).

    Returns:
        The optax transformation.

    Example:
        >>> tx = make_optimizer(Config())
    """
    t = config.train
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(
            make_lr(config),
            b1=0.9,
            b2=0.95,
            weight_decay=t.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def _loss(model: Transformer, batch: jax.Array) -> tuple[jax.Array, Any]:
    return model.loss(batch)


def _step_metrics(loss: jax.Array, ce: jax.Array, stats: Any, grads: Any) -> dict[str, Any]:
    return {
        "loss": loss,
        "ce_loss": ce,
        "aux_loss": stats.aux_loss,
        "z_loss": stats.z_loss,
        "grad_norm": optax.tree.norm(grads),
        "dropped": stats.dropped,
        "assignments": stats.assignments,
        "expert_load": stats.expert_load,
        "nodes_per_token": stats.nodes_per_token,
    }


class Programs:
    """The jitted init, train and eval functions of one config on one mesh.

    Used by :func:`train` and the training benchmark; build it under
    ``jax.set_mesh(mesh)``.

    Args:
        config: the run config.
        mesh: the config's mesh (``config.strategy().mesh()``).

    Attributes:
        init: ``() -> state``, the sharded NNX state of ``(model, optimizer)``.
        abstract_state, abstract_batch: shapes, dtypes and shardings of the state and
            of one batch, for ahead-of-time lowering.
        train_step: ``(state, batch) -> (state, metrics)``, state donated.
        eval_step: ``(state, batch) -> cross-entropy``.
        state_sharding: the state's shardings (expert weights split over expert axes).

    Example::

        config = load_config()
        mesh = config.strategy().mesh()
        batch = np.zeros((config.train.batch_size, config.train.seq_len + 1), np.int32)
        with jax.set_mesh(mesh):
            programs = Programs(config, mesh)
            state = programs.init()
            state, metrics = programs.train_step(state, programs.put_batch(batch))
    """

    def __init__(self, config: Config, mesh: jax.sharding.Mesh) -> None:
        tx = make_optimizer(config)

        def create() -> tuple[Transformer, nnx.Optimizer]:
            model = build_model(config)
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        abstract = nnx.eval_shape(create)
        self.graphdef, abstract_state = nnx.split(abstract)
        specs = nnx.get_partition_spec(abstract_state)
        self.state_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, self.state_sharding,
        )
        t = config.train
        self.batch_sharding = NamedSharding(
            mesh, ShardingRules.from_config(config).spec("batch", None)
        )
        self.abstract_batch = jax.ShapeDtypeStruct(
            (t.batch_size, t.seq_len + 1), jnp.int32, sharding=self.batch_sharding
        )
        self.init = jax.jit(lambda: nnx.split(create())[1], out_shardings=self.state_sharding)
        # Fixed output shardings: the state comes back exactly as it went in, so the
        # ahead-of-time compiled step accepts its own output on the next call.
        replicated = NamedSharding(mesh, P())
        self.train_step = jax.jit(
            self._train_step, donate_argnums=0, out_shardings=(self.state_sharding, replicated)
        )
        self.eval_step = jax.jit(self._eval_step, out_shardings=replicated)

    def _train_step(self, state: Any, batch: jax.Array) -> tuple[Any, dict[str, Any]]:
        model, optimizer = nnx.merge(self.graphdef, state)
        grad_fn = nnx.value_and_grad(_loss, has_aux=True)
        (loss, (ce, stats)), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        metrics = _step_metrics(loss, ce, stats, grads)
        return nnx.split((model, optimizer))[1], metrics

    def _eval_step(self, state: Any, batch: jax.Array) -> jax.Array:
        model, _ = nnx.merge(self.graphdef, state)
        _, (ce, _) = model.loss(batch)
        return ce

    def put_batch(self, batch: np.ndarray) -> jax.Array:
        """Place a global host batch on the mesh (every process holds the same batch).

        :meth:`load_batch` is the way that loads only this process's rows.

        Args:
            batch: ``[B, T+1]`` int32 tokens, the same on every process.

        Returns:
            The batch split over the batch axes (data, fsdp, expert) on its first
            dimension, replicated over the tensor and pipeline axes.
        """
        return jax.make_array_from_callback(batch.shape, self.batch_sharding, lambda i: batch[i])

    def load_batch(self, dataset: Dataset, step: int, *, seed: int, split: str) -> jax.Array:
        """Batch ``step`` of ``dataset`` on the mesh, this process loading only its rows.

        Args:
            dataset: the data source.
            step: the batch's step.
            seed: the run's data seed (``train.seed``).
            split: ``"train"`` or ``"eval"``.

        Returns:
            The same array as ``put_batch(dataset.batch(step, ...))``.
        """
        shape = self.abstract_batch.shape
        return load_batch(dataset, step, sharding=self.batch_sharding,
                          shape=(shape[0], shape[1]), seed=seed, split=split)


def init_state(config: Config) -> Any:
    """The sharded initial state of a config's ``(model, optimizer)`` on this process's mesh.

    The same ``train.seed`` gives the same values under every strategy: only where they
    are placed differs.

    Args:
        config: a validated config whose mesh fits on ``jax.devices()``.

    Returns:
        The NNX state, a pytree of ``jax.Array``; sum each leaf's
        ``addressable_shards[0].data.nbytes`` for one device's share.

    Raises:
        ConfigError: the mesh needs more devices than there are.

    Example::

        state = init_state(load_config(None, ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp",
                                              "exchange.node_axis=[]", "exchange.device_axis=[]"]))
    """
    check_devices(config, jax.device_count())
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        return Programs(config, mesh).init()


def compile_step(config: Config) -> jax.stages.Compiled:
    """The ahead-of-time compiled train step of a config, on this process's devices.

    Read its collectives with :func:`meshkit.strategy.hlo.collectives` to see which groups each
    role's communication uses.

    Args:
        config: a validated config whose mesh fits on ``jax.devices()``.

    Returns:
        ``jax.stages.Compiled`` of ``(state, batch) -> (state, metrics)``.

    Raises:
        ConfigError: the mesh needs more devices than there are.

    Example::

        from meshkit.strategy.hlo import collectives
        ops = collectives(compile_step(load_config("configs/dp_pp_ep_tp.yaml")))
    """
    check_devices(config, jax.device_count())
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        return programs.train_step.lower(programs.abstract_state, programs.abstract_batch).compile()


def _to_host(tree: Any) -> Any:
    """Fetch replicated results; in a multi-process run only local shards are readable."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _fetch(pending: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Copy queued steps' metrics to the host in one go (every copy started before any
    is waited on)."""
    local = [(step, {k: v.addressable_data(0) for k, v in m.items()}) for step, m in pending]
    return jax.device_get(local)


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


def _evaluate(programs: Programs, state: Any, dataset: Dataset, config: Config) -> float:
    t = config.train
    losses = [
        programs.eval_step(state, programs.load_batch(dataset, i, seed=t.seed, split="eval"))
        for i in range(t.eval_batches)
    ]
    return float(np.mean(_to_host(losses)))


def config_dataset(config: Config) -> Dataset:
    """The config's data source, its errors reported as config errors (before compiling).

    Args:
        config: a validated config; its ``data`` section and ``model.vocab_size``.

    Returns:
        The :class:`meshkit.data.sources.Dataset` that ``meshkit train`` draws batches from.

    Raises:
        ConfigError: the data source cannot be made (a missing file, a vocabulary too
            small for text), or ``train.seq_len`` does not fit it; the key is named.

    Example:
        >>> from meshkit.config import Config
        >>> config_dataset(Config()).vocab_size
        16
    """
    d = config.data
    try:
        dataset = make_dataset(d.kind, path=d.path, vocab_size=config.model.vocab_size,
                               order=d.order, seed=d.seed, concentration=d.concentration)
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


def _progress(total: int, initial: int, enabled: bool | None) -> Any:
    if enabled is False:
        from tqdm import tqdm  # the plain class: tqdm.auto would warn without ipywidgets

        return tqdm(disable=True)
    from tqdm.auto import tqdm

    # disable=None lets tqdm switch itself off when stderr is not a terminal.
    return tqdm(total=total, initial=initial, disable=None if enabled is None else False,
                unit="step", dynamic_ncols=True)


def train(
    config: Config,
    *,
    progress: bool | None = None,
    verbose: bool = True,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    sync_every_step: bool = False,
) -> TrainResult:
    """Train the MoE transformer a config describes, resuming from its workdir.

    Args:
        config: a validated :class:`~meshkit.config.Config`.
        progress: show a tqdm bar (``None``: only when stderr is a terminal).
        verbose: print the start line and the final summary (process 0 only).
        on_log: called with every metrics row written (e.g. a notebook's live plot).
        sync_every_step: fetch every step's metrics as soon as it finishes, so only one
            step is ever queued: the old loop, kept as ``meshkit bench train``'s baseline.
            The results are the same either way.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: before anything compiles: fewer devices than the mesh needs, a
            mesh that does not fit the processes' devices, more memory than the host has,
            bad data, or a workdir that cannot hold the run (see
            :func:`meshkit.train.preflight.check_workdir`: not a writable directory, a damaged
            or missing ``config.yaml``, another model's run, an incomplete checkpoint).
        TrainingDiverged: the loss became NaN or inf; the newest checkpoint is good.
        Preempted: SIGTERM arrived (in the main thread); a checkpoint of the step where
            the processes stopped was written first.
        NoIntactCheckpoint: every checkpoint in the workdir was damaged (each was moved
            aside and named in a warning).

    Example::

        config = load_config(None, ["train.steps=20", "train.workdir=/tmp/meshkit-run"])
        result = train(config)
        result.final_step, result.eval_loss, result.entropy_rate
        # (20, <eval loss>, <the Markov source's entropy rate, the best possible loss>)
    """
    t = config.train
    # Every check before anything compiles: a run that cannot finish says so at once.
    check_devices(config, jax.device_count())
    mesh = _mesh(config)
    check_memory(config, platform=jax.devices()[0].platform,
                 local_devices=max(1, config.num_devices // jax.process_count()))
    dataset = config_dataset(config)
    lead = jax.process_index() == 0
    workdir = check_workdir(config, lead=lead)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints)
    agree = agree_max if jax.process_count() > 1 else None
    # From here a SIGTERM is recorded, not fatal (and not swallowed by JAX's preemption
    # service): the loop acts on it at the next agreement point.
    preemption = Preemption(agree, every=t.log_every)
    try:
        with preemption, jax.set_mesh(mesh):
            programs = Programs(config, mesh)
            state = programs.init()
            start, state = restore_newest_intact(
                ckpt, state, agree=agree, process=(jax.process_index(), jax.process_count()))
            if lead:
                os.makedirs(workdir, exist_ok=True)
                _write_atomically(os.path.join(workdir, "config.yaml"), config.to_yaml())
            writer = MetricsWriter(workdir, resume_step=start, enabled=lead)
            if verbose and lead:
                where = f"resuming from step {start}" if start else "starting"
                print(f"meshkit train: {where}; {config.strategy()!r} on "
                      f"{jax.device_count()} devices ({jax.process_count()} processes); "
                      f"workdir {workdir}", file=sys.stderr)
            try:
                result = _loop(
                    config, programs, state, dataset=dataset, ckpt=ckpt, writer=writer,
                    start=start, workdir=workdir, progress=progress if lead else False,
                    on_log=on_log, preemption=preemption, sync_every_step=sync_every_step,
                )
            finally:
                writer.close()
    finally:
        ckpt.close()
    if verbose and lead:
        print(_summary(result), file=sys.stderr)
    return result


def _summary(result: TrainResult) -> str:
    mfu = "" if result.mfu is None else f", MFU {result.mfu:.1%}"
    line = (f"step {result.final_step}: eval loss {result.eval_loss:.4f} nats/token, "
            f"{result.tokens_per_s:,.0f} tokens/s ({result.tflops_per_device:.3g} model "
            f"TFLOP/s per device{mfu}), dropped {result.dropped_fraction:.2%}")
    if result.entropy_rate is not None:
        gap = result.eval_loss / result.entropy_rate - 1
        line += (f"\n  source entropy rate {result.entropy_rate:.4f} nats/token "
                 f"(the best possible eval loss): the model is {gap:+.1%} from it")
    return line


class _Rate:
    """tokens/s → model TFLOP/s per device and MFU, for this config on these devices."""

    def __init__(self, config: Config) -> None:
        self._flops = flops_per_token(config.model, seq_len=config.train.seq_len).training
        self._devices = config.num_devices
        self._kind = jax.devices()[0].device_kind

    def __call__(self, tokens_per_s: float) -> Utilization:
        return utilization(tokens_per_s, training_flops_per_token=self._flops,
                           devices=self._devices, device_kind=self._kind)


def _loop(
    config: Config,
    programs: Programs,
    state: Any,
    *,
    dataset: Dataset,
    ckpt: Checkpointer,
    writer: MetricsWriter,
    start: int,
    workdir: str,
    progress: bool | None,
    on_log: Callable[[dict[str, Any]], None] | None,
    preemption: Preemption,
    sync_every_step: bool,
) -> TrainResult:
    t = config.train
    entropy = dataset.entropy_rate()
    lr = make_lr(config)
    rate = _Rate(config)
    batch_of = functools.partial(programs.load_batch, dataset, seed=t.seed, split="train")
    tokens_per_step = t.batch_size * t.seq_len
    compile_start = time.perf_counter()
    first = batch_of(start) if start < t.steps else None
    # Compiled ahead of time so that compilation is timed apart from training.
    step_fn = (programs.train_step if first is None
               else programs.train_step.lower(state, first).compile())
    compile_s = time.perf_counter() - compile_start
    trace = StepTrace(t.profile_steps, first_step=start + 1, directory=profile_dir(
        workdir, process_index=jax.process_index(), process_count=jax.process_count()))
    losses: list[tuple[int, float]] = []
    # Steps dispatched whose metrics are still on the device: (step, metrics).
    pending: list[tuple[int, dict[str, Any]]] = []
    dropped = assignments = 0
    eval_loss = math.nan
    bar = _progress(t.steps, start, progress)
    # Training time only: evaluation, checkpointing and logging are left out of tokens/s.
    # The clock runs from the end of the last fetch (or pause) to the end of the next.
    step_seconds = window_seconds = 0.0
    window_steps = 0
    last_ckpt = ckpt.latest_step()
    try:
        batch = first
        clock = time.perf_counter()
        for step in range(start + 1, t.steps + 1):
            trace.before(step)
            state, m = step_fn(state, batch)
            pending.append((step, m))
            # The step runs asynchronously: prepare the next batch meanwhile.
            if step < t.steps:
                batch = batch_of(step)
            trace.after(step, m)
            window_steps += 1
            evaluate = step % t.eval_every == 0 or step == t.steps
            log = step % t.log_every == 0 or evaluate
            save = step % t.checkpoint_every == 0 or step == t.steps
            # A stop signal (SIGTERM) may end the run at this step, with a checkpoint.
            signalled = preemption.received is not None
            if not (log or save or signalled or sync_every_step):
                continue  # nothing needs the host: queue the next step at once
            fetched, pending = _fetch(pending), []
            elapsed = time.perf_counter() - clock
            step_seconds, window_seconds = step_seconds + elapsed, window_seconds + elapsed
            bad = _first_non_finite(fetched)
            if bad is not None:
                raise TrainingDiverged(
                    f"loss became {bad[1]} (gradient norm {bad[2]}) at step {bad[0]}; the "
                    "newest checkpoint "
                    + (f"(step {last_ckpt}) " if last_ckpt else "(none yet) ")
                    + f"in {ckpt.directory} predates it and is intact"
                )
            for s, ms in fetched:
                losses.append((s, float(ms["loss"])))
                dropped += int(ms["dropped"])
                assignments += int(ms["assignments"])
            bar.update(len(fetched))
            if log:
                row = _row(step, fetched[-1][1], lr=lr, rate=rate,
                           tokens_per_s=window_steps * tokens_per_step / max(window_seconds, 1e-9))
                window_seconds, window_steps = 0.0, 0
                if evaluate:
                    eval_loss = _evaluate(programs, state, dataset, config)
                    row["eval_loss"] = eval_loss
                    if entropy is not None:
                        row["entropy_rate"] = entropy
                writer.write(row)
                if on_log is not None:
                    on_log(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            # Asked after logging, so a signal that came meanwhile stops at this step.
            stop = step < t.steps and preemption.should_stop(step)
            if save or stop:  # every step so far was fetched and finite
                ckpt.save(step, state)
                last_ckpt = step
            if stop:
                raise Preempted(f"stopped by {preemption.describe()} after step {step}; "
                                f"checkpoint {ckpt.step_dir(step)} is saved: run the same "
                                "command again to resume")
            clock = time.perf_counter()
    finally:
        trace.close()
        bar.close()
    if not losses:  # already at the end: evaluate the restored state
        eval_loss = _evaluate(programs, state, dataset, config)
    tokens_per_s = len(losses) * tokens_per_step / max(step_seconds, 1e-9)
    use = rate(tokens_per_s) if losses else Utilization(0.0, None)
    return TrainResult(
        workdir=workdir,
        start_step=start,
        final_step=max(start, t.steps),
        losses=losses,
        eval_loss=eval_loss,
        entropy_rate=entropy,
        tokens_per_s=tokens_per_s,
        compile_s=compile_s,
        dropped_fraction=dropped / max(assignments, 1),
        tflops_per_device=use.tflops_per_device,
        mfu=use.mfu,
    )


def _row(
    step: int, m: dict[str, Any], *, lr: Callable[[int], Any], rate: _Rate, tokens_per_s: float
) -> dict[str, Any]:
    """The metrics.jsonl row of a logged step, from its fetched metrics."""
    d, a = int(m["dropped"]), int(m["assignments"])
    use = rate(tokens_per_s)
    row: dict[str, Any] = {
        "step": step,
        "loss": float(m["loss"]),
        "ce_loss": float(m["ce_loss"]),
        "aux_loss": float(m["aux_loss"]),
        "z_loss": float(m["z_loss"]),
        "grad_norm": float(m["grad_norm"]),
        "lr": float(lr(step - 1)),
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": use.tflops_per_device,
        "dropped_fraction": d / max(a, 1),
        "expert_load": np.asarray(m["expert_load"]).round(4).tolist(),
        "nodes_per_token": float(m["nodes_per_token"]),
    }
    if use.mfu is not None:
        row["mfu"] = use.mfu
    return row


def make_lr(config: Config) -> Callable[[int], Any]:
    """The learning-rate schedule of :func:`make_optimizer`, for logging and plots.

    Args:
        config: the run config.

    Returns:
        ``step -> learning rate``.

    Example:
        >>> float(make_lr(Config())(0))
        0.0
    """
    t = config.train
    return optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1), t.lr * 0.1
    )
