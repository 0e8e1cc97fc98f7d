"""A factory's model through the pipeline: the trainer's side of the pipeline protocol.

With a pipeline axis (the ``pipeline`` role, ``parallel.pipeline``), a factory's model
must follow :mod:`meshkit.model.pipelined`'s protocol (``embed``, stacked ``layers``,
``head``; :class:`meshkit.Pipelined` is one); anything else would run the whole model on
every stage, each repeating the others' work, so :func:`plan_pipeline` refuses it before
anything compiles. :func:`pipelined_loss` then runs the user's loss with the layers as
the stages of ``parallel.schedule``:

* ``gpipe`` and ``interleaved``: the loss is called once, as without a pipeline; the
  model it gets answers ``model(tokens)`` with ``head(pipeline(layers, embed(tokens)))``
  (:func:`meshkit.model.pipeline.pipeline`), autodiff giving the backward pass. The
  loss's metrics are logged as they are.
* ``1f1b``: the loss runs inside the schedule, once per microbatch on the last stage
  (:func:`meshkit.model.pipeline.pipeline_loss`): ``embed`` takes ``batch[:, :-1]``,
  the loss gets the microbatch's rows of ``batch`` and a model whose ``model(tokens)``
  is ``head`` of the last stage's outputs for them. The step's loss is the mean over
  microbatches (the batch's loss for a loss that is a mean over rows), and so is each
  floating-point metric of the loss; an integer one (a count) is summed. Evaluation
  runs the GPipe forward pass.

The layers stay in their natural order under every schedule (the interleaved schedule
moves chunks between stages in the step), so a checkpoint is the same under every
pipeline layout and restores under any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshkit.config import Config, ConfigError
from meshkit.errors import UserCodeError
from meshkit.model.pipeline import pipeline, pipeline_loss
from meshkit.model.pipelined import pipeline_parts
from meshkit.model.transformer import Transformer
from meshkit.training.models import LossFn, ModelSpec, loss_and_metrics
from meshkit.training.user_code import culprit_of

__all__ = ["PipelineRun", "pipelined_loss", "plan_pipeline"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineRun:
    """How the trainer pipelines a factory's model.

    Attributes:
        axis: the pipeline mesh axis.
        schedule: ``parallel.schedule``.
        microbatches: ``parallel.microbatches``.
        virtual_stages: ``parallel.virtual_stages``.
        batch_axes: the mesh axes splitting the batch: under ``1f1b``, each
            microbatch's logits are laid out over them only (``None``: as XLA picks).
    """

    axis: str
    schedule: str
    microbatches: int
    virtual_stages: int
    batch_axes: tuple[str, ...] | None = None


def plan_pipeline(config: Config, spec: ModelSpec, model: nnx.Module,
                  mesh: jax.sharding.Mesh) -> PipelineRun | None:
    """How to pipeline a run's model, checked against the config and the mesh.

    Args:
        config: the run's config (its ``parallel`` section).
        spec: the run's model; meshkit's transformer pipelines itself.
        model: the model, abstract shapes being enough (``nnx.eval_shape``'s).
        mesh: the run's mesh.

    Returns:
        ``None`` for meshkit's transformer (which runs its own schedules, from the config
        or a factory) and for a run with no pipeline axis, else the :class:`PipelineRun`.

    Raises:
        ConfigError: a factory's model on a pipeline axis without the pipeline protocol
            (naming ``parallel.pipeline`` and what the model lacks), with
            ``parallel.stage_layers``, or whose stacked layers the stages (or the
            virtual stages) do not divide; ``parallel.microbatches`` above 1 with no
            pipeline axis.

    Example::

        run = plan_pipeline(config, spec, nnx.eval_shape(lambda: make(nnx.Rngs(0))), mesh)
    """
    p = config.parallel
    if spec.transformer or isinstance(model, Transformer):
        # meshkit's transformer runs its own schedules (built with its microbatches,
        # schedule and stages), whoever's factory makes it.
        return None
    axis = spec.rules.pipeline
    if axis is None:
        if p.microbatches > 1:
            raise ConfigError(f"parallel.microbatches: {p.microbatches} microbatches need a "
                              "pipeline axis (parallel.pipeline is null)")
        return None
    culprit = culprit_of(spec.factory, argument="model")
    try:
        parts = pipeline_parts(model, what=f"{culprit}'s model")
    except TypeError as e:
        raise ConfigError(
            f"parallel.pipeline: axis {axis!r} runs a model's layers as pipeline stages, but "
            f"{e}: give it embed, stacked layers and head (meshkit.Pipelined(embed=..., "
            "layers=..., head=...)), or set parallel.pipeline: null") from None
    if p.stage_layers is not None:
        raise ConfigError(f"parallel.stage_layers: uneven stages are for meshkit's "
                          f"transformer; the stages split {culprit}'s model's layers evenly "
                          "(set it to null)")
    stages = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]
    n = parts.num_layers
    if n % stages:
        raise ConfigError(f"parallel.pipeline: {stages} stages (axis {axis!r}) do not divide "
                          f"the {n} stacked layers of {culprit}'s model")
    if (n // stages) % p.virtual_stages:
        raise ConfigError(f"parallel.virtual_stages: {p.virtual_stages} does not divide the "
                          f"{n // stages} layers per stage ({n} stacked layers of {culprit}'s "
                          f"model over {stages} stages of axis {axis!r})")
    return PipelineRun(axis=axis, schedule=p.schedule, microbatches=p.microbatches,
                       virtual_stages=p.virtual_stages, batch_axes=spec.rules.batch_axes)


def pipelined_loss(run: PipelineRun, loss_fn: LossFn, model: nnx.Module, batch: jax.Array, *,
                   culprit: str | None, train: bool = True
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The user's loss of ``model`` on ``batch``, its layers run as pipeline stages.

    Args:
        run: how to pipeline (:func:`plan_pipeline`).
        loss_fn: ``loss(model, batch) -> loss`` or ``(loss, metrics)``.
        model: a model that follows the pipeline protocol.
        batch: ``[B, T+1]`` int32 tokens.
        culprit: how errors name ``loss_fn`` (:func:`meshkit.training.models.loss_and_metrics`).
        train: the training step (``1f1b`` runs its schedule); ``False`` for evaluation,
            which runs ``1f1b``'s forward pass as GPipe's.

    Returns:
        ``(loss, metrics)``; under ``1f1b`` each metric the mean over microbatches (a
        count: the sum).

    Raises:
        UserCodeError: what :func:`meshkit.training.models.loss_and_metrics` raises; a
            loss that never calls the model; under ``1f1b``, one that calls it twice or
            on tokens other than a microbatch's ``batch[:, :-1]`` rows.

    Example::

        loss, metrics = pipelined_loss(run, my_loss, model, batch, culprit="loss=my_loss")
    """
    parts = pipeline_parts(model)
    who = culprit or "the loss function"
    schedule = run.schedule if train or run.schedule != "1f1b" else "gpipe"
    if schedule != "1f1b":
        def logits(tokens: jax.Array) -> jax.Array:
            h = pipeline(parts.layers, parts.embed(tokens), microbatches=run.microbatches,
                         schedule=schedule, virtual_stages=run.virtual_stages, axis=run.axis)
            return parts.head(h)

        view = _Calls(model, logits, who=who, once=False)
        out = loss_and_metrics(loss_fn, view, batch, culprit=culprit)
        view.check_called()
        return out

    def microbatch_loss(head: Any, h: jax.Array, rows: jax.Array
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
        def logits(tokens: jax.Array) -> jax.Array:
            if tuple(tokens.shape) != (rows.shape[0], rows.shape[1] - 1):
                raise UserCodeError(
                    f"{who} called the model on tokens of shape {tuple(tokens.shape)}; under "
                    f"parallel.schedule '1f1b' the model's input is a microbatch's "
                    f"batch[:, :-1], of shape ({rows.shape[0]}, {rows.shape[1] - 1})")
            # Rows split as the batch is, the rest whole: XLA's partitioner aborts
            # (spmd_partitioner_util Check failed) on the loss's gather from logits whose
            # vocabulary is split over tensor axes inside the pipeline's shard_map.
            return _rows(run, head(h))

        view = _Calls(model, logits, who=who, once=True)
        out = loss_and_metrics(loss_fn, view, rows, culprit=culprit)
        view.check_called()
        return out

    x = parts.embed(batch[:, :-1])
    value, metrics = pipeline_loss(parts.layers, x, batch, loss=microbatch_loss,
                                   head=parts.head, microbatches=run.microbatches,
                                   schedule="1f1b", axis=run.axis, has_aux=True)
    return value, metrics


def _rows(run: PipelineRun, x: jax.Array) -> jax.Array:
    """``x`` with its rows split over the batch axes and the rest whole on every device
    (as XLA picks where ``run`` names no batch axes)."""
    if run.batch_axes is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, P(run.batch_axes or None, *([None] * (x.ndim - 1))))


class _Calls:
    """The model as the loss sees it under a pipeline: calling it runs ``logits``; every
    other attribute is the model's own.

    A loss that never calls the model would run it unpipelined (every stage repeating
    it), and under ``1f1b`` a second call would get the first call's logits whatever its
    tokens: each is the user's error, named.
    """

    def __init__(self, model: nnx.Module, logits: Callable[[jax.Array], jax.Array], *,
                 who: str, once: bool) -> None:
        self._model, self._logits, self._who, self._once = model, logits, who, once
        self._calls = 0

    def __call__(self, tokens: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        if args or kwargs:
            more = [*(type(a).__name__ for a in args), *(f"{k}=" for k in kwargs)]
            raise UserCodeError(f"{self._who} called the model with more than the tokens "
                                f"({', '.join(more)}); under parallel.pipeline its call "
                                "runs embed, the layers and head on the tokens alone")
        if self._once and self._calls:
            raise UserCodeError(f"{self._who} called the model twice; under parallel.schedule "
                                "'1f1b' the loss calls it once, on batch[:, :-1]")
        self._calls += 1
        return self._logits(tokens)

    def check_called(self) -> None:
        if not self._calls:
            raise UserCodeError(
                f"{self._who} never called the model; under parallel.pipeline the trainer "
                "pipelines the model's call, model(tokens), which the loss must make")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
