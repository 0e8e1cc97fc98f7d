"""The programs of a run: the sharded state, the jitted train and eval steps, the optimizer.

* **Model**: any NNX model, from a factory and a loss (:mod:`meshkit.training.models`);
  meshkit's MoE transformer is the default. With a pipeline axis, a factory's model
  runs as pipeline stages by the pipeline protocol (:mod:`meshkit.training.pipelining`).
* **State** is the NNX state of ``(model, optimizer)``, created inside ``jax.jit`` with
  ``out_shardings`` from the parameters' names
  (:func:`meshkit.sharding.place.logical_shardings` with the run's
  :class:`~meshkit.sharding.rules.ShardingRules`), so each device creates only its share:
  the transformer's expert weights (and their AdamW moments) split over the expert axes,
  a user model's ``mlp`` columns over the tensor axes, and so on. Every leaf, optimizer
  counters included, carries a ``NamedSharding`` on the mesh. The same recipe works with
  one process or many.
* **Step**: a pure ``jax.jit`` function of ``(state, batch)`` with the state donated: the
  loss and its metrics, gradients, an optax update (by default AdamW with warmup +
  cosine decay and global-norm clipping, fused per leaf: :mod:`meshkit.training.optimizer`).

The model is created and traced inside ``nnx.logical_axis_rules(rules.flax_rules())``,
so Flax's own sharding and meshkit's parallel layers
(:mod:`meshkit.sharding.linear`) resolve the same logical names.

:func:`meshkit.training.train` runs them; benchmarks, tests and notebooks use them alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.config import Config, check_devices
from meshkit.data.batches import load_batch
from meshkit.data.sources import Dataset
from meshkit.sharding.place import logical_shardings
from meshkit.sharding.rules import ShardingRules
from meshkit.sharding.zero import reduce_scatter_gradients, zero1_shardings
from meshkit.training.models import (
    Factory,
    LossFn,
    ModelSpec,
    build_model,
    loss_and_metrics,
    resolve_model,
)
from meshkit.training.optimizer import clipped_adamw
from meshkit.training.pipelining import pipelined_loss, plan_pipeline
from meshkit.training.preflight import StateBytes

__all__ = [
    "Programs",
    "build_model",
    "compile_step",
    "init_state",
    "make_lr",
    "make_optimizer",
    "state_bytes",
    "step_flops",
]


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW with linear warmup, cosine decay to 10 %, and global-norm clipping.

    Weight decay applies to matrices only (not norms' scales). Clipping and AdamW run
    fused, leaf by leaf (:func:`meshkit.training.optimizer.clipped_adamw`: the state and
    updates of ``optax.chain(optax.clip_by_global_norm, optax.adamw)``, without a
    second full-size gradient tree).

    Args:
        config: the run config (``train.lr``, ``warmup_steps``, ``steps``,
            ``weight_decay``, ``grad_clip``).

    Returns:
        The optax transformation.

    Examples:
        >>> tx = make_optimizer(Config())
    """
    t = config.train
    return clipped_adamw(make_lr(config), grad_clip=t.grad_clip, b1=0.9, b2=0.95,
                         weight_decay=t.weight_decay, decay=lambda p: p.ndim >= 2)


def make_lr(config: Config) -> Callable[[int], Any]:
    """The learning-rate schedule of :func:`make_optimizer`, for logging and plots.

    Args:
        config: the run config.

    Returns:
        ``step -> learning rate``.

    Examples:
        >>> float(make_lr(Config())(0))
        0.0
    """
    t = config.train
    return optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1), t.lr * 0.1
    )


class Programs:
    """The jitted init, train and eval functions of one config and model on one mesh.

    Used by :func:`train` and the training benchmark; build it under
    ``jax.set_mesh(mesh)``.

    Args:
        config: the run config.
        mesh: the config's mesh (``config.strategy().mesh()``).
        model: ``factory(rngs) -> nnx.Module`` (default: ``model.factory``, else meshkit's
            transformer; :func:`meshkit.training.models.resolve_model`).
        loss: ``loss(model, batch) -> loss or (loss, metrics)`` (default: ``model.loss``,
            else the model's own).
        rules: where logical names go on the mesh (default: the config's roles and
            ``parallel.logical_axes``).
        optimizer: the optax transformation (default :func:`make_optimizer`).
        spec: the run's :class:`~meshkit.training.models.ModelSpec`, resolved already
            (as :func:`meshkit.training.train` has it), instead of ``model``, ``loss``
            and ``rules``.

    Attributes:
        init: ``() -> state``, the sharded NNX state of ``(model, optimizer)``.
        abstract_state, abstract_batch: shapes, dtypes and ``NamedSharding`` s of the
            state (every leaf) and of one batch: for ahead-of-time lowering, and the
            target a checkpoint is restored into.
        train_step: ``(state, batch) -> (state, metrics)``, state donated; the metrics
            are ``loss``, ``grad_norm`` and the loss function's own.
        eval_step: ``(state, batch) -> eval loss``: the loss's ``ce_loss`` metric if it
            returns one, else the loss.
        state_sharding: the state's shardings (with ``parallel.zero1``, the optimizer's
            split over the data axes: :mod:`meshkit.sharding.zero`).
        rules: the sharding rules in use.

    Raises:
        ShardingError: a parameter's logical name the rules do not know, a mesh axis on
            two dimensions of one parameter, or a dimension the mesh does not divide
            (:mod:`meshkit.sharding.place`; each names the parameter).
        ConfigError: a factory's model on a pipeline axis without the pipeline protocol,
            or pipeline settings it cannot take
            (:func:`meshkit.training.pipelining.plan_pipeline`).

    Example::

        config = load_config()
        mesh = config.strategy().mesh()
        batch = np.zeros((config.train.batch_size, config.train.seq_len + 1), np.int32)
        with jax.set_mesh(mesh):
            programs = Programs(config, mesh)
            state = programs.init()
            state, metrics = programs.train_step(state, programs.put_batch(batch))
    """

    def __init__(
        self,
        config: Config,
        mesh: jax.sharding.Mesh,
        *,
        model: Factory | None = None,
        loss: LossFn | None = None,
        rules: ShardingRules | None = None,
        optimizer: optax.GradientTransformation | None = None,
        spec: ModelSpec | None = None,
    ) -> None:
        spec = spec or resolve_model(config, model=model, loss=loss, rules=rules)
        self.rules, self._loss, self._loss_culprit = spec.rules, spec.loss, spec.loss_culprit
        self._zero1_on = config.parallel.zero1
        self._flax_rules = spec.rules.flax_rules()
        create = _creator(spec, optimizer or make_optimizer(config), seed=config.train.seed,
                          logical=self._logical)
        # Under the logical names: Flax's eval_shape gives each variable a sharding.
        with self._logical():
            abstract = nnx.eval_shape(create)
            # Before anything compiles: a factory's model on a pipeline axis must say
            # what its stages are, or every stage would repeat the whole model.
            self._pipeline = plan_pipeline(config, spec, abstract[0], mesh)
            self.graphdef, abstract_state = nnx.split(abstract)
        self.state_sharding = _optimizer_zero1(
            config, abstract_state, logical_shardings(abstract_state, mesh, spec.rules),
            spec.rules)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, self.state_sharding,
        )
        t = config.train
        self.batch_sharding = NamedSharding(mesh, spec.rules.spec("batch", None))
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

    @contextlib.contextmanager
    def _logical(self) -> Iterator[None]:
        """The run's logical names, for Flax and meshkit's parallel layers while tracing."""
        with nnx.logical_axis_rules(self._flax_rules):
            yield

    def _zero1(self) -> contextlib.AbstractContextManager[None]:
        """Under ZeRO-1, modules run through ``shard_call`` (meshkit's transformer, a
        user's per-device modules) hand back reduce-scattered gradients."""
        if not self._zero1_on:
            return contextlib.nullcontext()
        return reduce_scatter_gradients(self.rules.data)

    def _objective(self, model: Any, batch: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        return self._loss_and_metrics(model, batch, train=True)

    def _loss_and_metrics(self, model: Any, batch: jax.Array, *, train: bool
                          ) -> tuple[jax.Array, dict[str, Any]]:
        if self._pipeline is not None:
            return pipelined_loss(self._pipeline, self._loss, model, batch,
                                  culprit=self._loss_culprit, train=train)
        return loss_and_metrics(self._loss, model, batch, culprit=self._loss_culprit)

    def _train_step(self, state: Any, batch: jax.Array) -> tuple[Any, dict[str, Any]]:
        with self._logical(), self._zero1():
            model, optimizer = nnx.merge(self.graphdef, state)
            grad_fn = nnx.value_and_grad(self._objective, has_aux=True)
            (loss, metrics), grads = grad_fn(model, batch)
            optimizer.update(model, grads)
            step = {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}
            return nnx.split((model, optimizer))[1], step

    def _eval_step(self, state: Any, batch: jax.Array) -> jax.Array:
        with self._logical():
            model, _ = nnx.merge(self.graphdef, state)
            loss, metrics = self._loss_and_metrics(model, batch, train=False)
            return metrics.get("ce_loss", loss)

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

    def evaluate(self, state: Any, dataset: Dataset, *, seed: int, batches: int) -> float:
        """The mean cross-entropy of ``state`` over the first ``batches`` eval batches.

        Args:
            state: the NNX state (not donated).
            dataset: the data source.
            seed: the run's data seed (``train.seed``).
            batches: how many eval batches (``train.eval_batches``).

        Returns:
            Nats per token.
        """
        losses = [self.eval_step(state, self.load_batch(dataset, i, seed=seed, split="eval"))
                  for i in range(batches)]
        return float(np.mean(_to_host(losses)))


def init_state(
    config: Config,
    *,
    model: Factory | None = None,
    rules: ShardingRules | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> Any:
    """The sharded initial state of a config's ``(model, optimizer)`` on this process's mesh.

    The same ``train.seed`` gives the same values under every strategy: only where they
    are placed differs.

    Args:
        config: a validated config whose mesh fits on ``jax.devices()``.
        model, rules, optimizer: as for :class:`Programs`.

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
        return Programs(config, mesh, model=model, rules=rules, optimizer=optimizer).init()


def compile_step(
    config: Config,
    *,
    model: Factory | None = None,
    loss: LossFn | None = None,
    rules: ShardingRules | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> jax.stages.Compiled:
    """The ahead-of-time compiled train step of a config, on this process's devices.

    Read its collectives with :func:`meshkit.strategy.hlo.collectives` to see which groups each
    role's communication uses, and its FLOPs with :func:`step_flops`.

    Args:
        config: a validated config whose mesh fits on ``jax.devices()``.
        model, loss, rules, optimizer: as for :class:`Programs`.

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
        programs = Programs(config, mesh, model=model, loss=loss, rules=rules,
                            optimizer=optimizer)
        return programs.train_step.lower(programs.abstract_state, programs.abstract_batch).compile()


def step_flops(compiled: jax.stages.Compiled) -> float | None:
    """The FLOPs one device runs in one call of a compiled program, by XLA's count.

    XLA's cost analysis of the partitioned program (one device's share): every
    floating-point operation it emits, the backward pass, the optimizer update and the
    work a layout repeats on several devices included.

    Args:
        compiled: e.g. the train step's ``.lower(...).compile()``.

    Returns:
        The FLOPs, or ``None`` where the backend reports none.

    Example::

        flops = step_flops(compile_step(config))  # one device, one step
        flops * config.num_devices / (config.train.batch_size * config.train.seq_len)
        # training FLOPs per token, by XLA's count
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without a cost model says so in its own way
        return None
    # Older JAX returns one dict per program (always one here).
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = cost.get("flops") if isinstance(cost, dict) else None
    return float(flops) if isinstance(flops, int | float) and flops > 0 else None


def state_bytes(
    config: Config,
    mesh: jax.sharding.Mesh,
    *,
    model: Factory | None = None,
    rules: ShardingRules | None = None,
    optimizer: optax.GradientTransformation | None = None,
    spec: ModelSpec | None = None,
) -> StateBytes:
    """One device's bytes of the ``(model, optimizer)`` state, from its abstract shapes
    and shardings: nothing is allocated or compiled.

    Args:
        config: the run config.
        mesh: the run's mesh.
        model, rules, optimizer, spec: as for :class:`Programs`.

    Returns:
        The :class:`~meshkit.training.preflight.StateBytes` of the device holding the most.

    Raises:
        ShardingError: as :class:`Programs`.

    Example::

        state_bytes(config, config.strategy().mesh(), model=make_gpt).total
    """
    spec = spec or resolve_model(config, model=model, rules=rules)
    flax_rules = spec.rules.flax_rules()

    @contextlib.contextmanager
    def logical() -> Iterator[None]:
        with nnx.logical_axis_rules(flax_rules):
            yield

    create = _creator(spec, optimizer or make_optimizer(config), seed=config.train.seed,
                      logical=logical)
    # Shapes and metadata only (jax's eval_shape, not Flax's, which would place each
    # variable) and no eager sharding: a logical name the rules lack is reported below
    # by logical_shardings, naming its parameter.
    with jax.set_mesh(mesh), nnx.use_eager_sharding(False):
        model_state, optimizer_state = jax.eval_shape(
            lambda: tuple(nnx.state(part) for part in create()))
    # The model's first, so that an error names its parameter as the model's own path.
    params = _bytes(model_state, logical_shardings(model_state, mesh, spec.rules))
    optimizer_sharding = logical_shardings(optimizer_state, mesh, spec.rules)
    if config.parallel.zero1:
        optimizer_sharding = zero1_shardings(optimizer_state, optimizer_sharding,
                                             data_axes=spec.rules.data)
    return StateBytes(params=params, optimizer=_bytes(optimizer_state, optimizer_sharding))


def _optimizer_zero1(config: Config, abstract: Any, shardings: Any,
                     rules: ShardingRules) -> Any:
    """The ``(model, optimizer)`` state's shardings, the optimizer's split over the data
    axes when ``parallel.zero1`` is on (:mod:`meshkit.sharding.zero`)."""
    if not config.parallel.zero1:
        return shardings

    def place(path: tuple[Any, ...], array: Any, sharding: Any) -> Any:
        # The state is nnx.state((model, optimizer)): its first key says which part.
        if getattr(path[0], "key", None) != 1:
            return sharding
        return zero1_shardings(array, sharding, data_axes=rules.data)

    return jax.tree_util.tree_map_with_path(place, abstract, shardings)


def _bytes(tree: Any, shardings: Any) -> int:
    """One device's bytes of ``tree`` laid out by ``shardings`` (the largest share)."""
    return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


def _creator(spec: ModelSpec, tx: optax.GradientTransformation, *, seed: int,
             logical: Callable[[], contextlib.AbstractContextManager[None]]
             ) -> Callable[[], tuple[nnx.Module, nnx.Optimizer]]:
    """``() -> (model, optimizer)``, the model made under the run's logical names."""

    def create() -> tuple[nnx.Module, nnx.Optimizer]:
        with logical():
            model = spec.factory(nnx.Rngs(seed))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return create




def _to_host(tree: Any) -> Any:
    """Fetch replicated results; in a multi-process run only local shards are readable."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
