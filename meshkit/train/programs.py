"""The programs of a run: the sharded state, the jitted train and eval steps, the optimizer.

* **State** is the NNX state of ``(model, optimizer)``, created inside ``jax.jit`` with
  ``out_shardings`` from the parameters' partition metadata: expert weights (and their
  AdamW moments) are split over the expert axes, everything else replicated. The same
  recipe works with one process or many.
* **Step**: a pure ``jax.jit`` function of ``(state, batch)`` with the state donated:
  cross-entropy + ``aux_loss_weight`` · load-balancing loss + ``z_loss_weight`` · z-loss,
  gradients, optax AdamW (warmup + cosine decay, global-norm clipping).

:func:`meshkit.train.train` runs them; benchmarks, tests and notebooks use them alone.
"""

from __future__ import annotations

from collections.abc import Callable
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
from meshkit.model.transformer import Transformer
from meshkit.sharding.rules import ShardingRules

__all__ = [
    "Programs",
    "build_model",
    "compile_step",
    "init_state",
    "make_lr",
    "make_optimizer",
]


def build_model(config: Config, *, rngs: nnx.Rngs | None = None) -> Transformer:
    """The :class:`~meshkit.model.transformer.Transformer` a config describes.

    Args:
        config: the run config (model, parallel and exchange sections, mesh axes).
        rngs: initialisation randomness (default ``nnx.Rngs(config.train.seed)``).

    Returns:
        An unsharded model; :func:`init_state` creates it sharded inside ``jax.jit``.

    Example::

        model = build_model(Config())  # unsharded: see meshkit.sharding.place.shard_model
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
