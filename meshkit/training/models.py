"""What a run trains: a model factory, its loss, the rules for its logical names, its FLOPs.

The trainer takes any Flax NNX model through two functions:

* ``factory(rngs: nnx.Rngs) -> nnx.Module``: builds the model. Its parameters name their
  dimensions in ``out_sharding`` metadata, by logical names (``("embed", "mlp")``) or
  by mesh axes; :meth:`ModelSpec.rules` says where each logical name goes on the mesh.
* ``loss(model, batch) -> loss`` or ``(loss, metrics)``: ``batch`` is the ``[B, T+1]``
  int32 token batch on the mesh, ``loss`` a scalar, ``metrics`` a ``dict`` of arrays
  (scalars, mostly) logged next to the loss. Without one, a factory's model is trained on
  :func:`next_token_loss`.

meshkit's own MoE transformer goes through the same two functions: its factory is
:func:`build_model` of the config, its loss :func:`transformer_loss`, an adapter that
returns the router's statistics as metrics.

:func:`resolve_model` makes the :class:`ModelSpec` of a run from the config (its
``model.factory``, ``model.loss``, ``model.flops_per_token`` and
``parallel.logical_axes``) and from what a caller of :func:`meshkit.training.train` passes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshkit.config import Config
from meshkit.model.transformer import Transformer
from meshkit.plan.flops import flops_per_token as count_flops
from meshkit.sharding.rules import ShardingRules
from meshkit.training.user_code import (
    blame,
    check_loss_output,
    checked_factory,
    culprit_of,
    named_loss,
)

__all__ = [
    "Factory",
    "LossFn",
    "ModelSpec",
    "build_model",
    "config_rules",
    "loss_and_metrics",
    "next_token_loss",
    "resolve_model",
    "transformer_loss",
]

#: ``factory(rngs) -> model``.
Factory = Callable[[nnx.Rngs], nnx.Module]
#: ``loss(model, batch) -> loss`` or ``(loss, metrics)``.
LossFn = Callable[[Any, jax.Array], Any]


def build_model(config: Config, *, rngs: nnx.Rngs | None = None) -> Transformer:
    """The :class:`~meshkit.model.transformer.Transformer` a config describes.

    Args:
        config: the run config (model, parallel and exchange sections, mesh axes).
        rngs: initialisation randomness (default ``nnx.Rngs(config.train.seed)``).

    Returns:
        An unsharded model; :func:`meshkit.training.init_state` creates it sharded inside
        ``jax.jit``.

    Example::

        model = build_model(Config())  # unsharded: see meshkit.sharding.place.shard_model
        model.layers.qkv.shape[0] == Config().model.num_layers
        # True
    """
    return Transformer.from_config(config, rngs=rngs)


def transformer_loss(model: Transformer, batch: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """The transformer's loss as a trainer's loss function: ``(loss, metrics)``.

    Args:
        model: meshkit's transformer.
        batch: ``[B, T+1]`` int32 tokens.

    Returns:
        ``(cross-entropy + router losses, metrics)``: ``ce_loss``, ``aux_loss``,
        ``z_loss``, ``dropped`` and ``assignments`` (int32 counts), ``expert_load``
        (``[L, E]``) and ``nodes_per_token``, as
        :meth:`~meshkit.model.transformer.Transformer.loss` computes them.

    Example::

        with jax.set_mesh(mesh):
            loss, metrics = nnx.jit(transformer_loss)(model, batch)
        sorted(metrics)[:3]
        # ['assignments', 'aux_loss', 'ce_loss']
    """
    loss, (ce, stats) = model.loss(batch)
    return loss, {
        "ce_loss": ce,
        "aux_loss": stats.aux_loss,
        "z_loss": stats.z_loss,
        "dropped": stats.dropped,
        "assignments": stats.assignments,
        "expert_load": stats.expert_load,
        "nodes_per_token": stats.nodes_per_token,
    }


def next_token_loss(model: Callable[[jax.Array], jax.Array], batch: jax.Array, *,
                    vocab_size: int | None = None) -> jax.Array:
    """Mean next-token cross-entropy of ``model(batch[:, :-1])`` against ``batch[:, 1:]``.

    The loss a factory's model trains on when no loss is given.

    Args:
        model: a model whose call maps ``[B, T]`` token ids to ``[B, T, V]`` logits.
        batch: ``[B, T+1]`` int32 tokens.
        vocab_size: the token ids the data holds: ``V`` must be at least this (a
            shorter row of logits would be read past its end).

    Returns:
        The scalar loss in nats per token, computed in float32.

    Raises:
        ValueError: the model's output is not ``[B, T, V]`` logits (its shape named).

    Examples:
        >>> logits = lambda tokens: jnp.zeros((*tokens.shape, 4))  # uniform over 4 ids
        >>> round(float(next_token_loss(logits, jnp.zeros((2, 5), jnp.int32))), 4)
        1.3863
    """
    inputs = batch[:, :-1]
    logits = model(inputs)
    shape = getattr(logits, "shape", None)
    if (shape is None or len(shape) != 3 or tuple(shape[:2]) != inputs.shape
            or (vocab_size is not None and shape[2] < vocab_size)):
        vocab = "vocab" if vocab_size is None else f"vocab >= {vocab_size}"
        got = (f"has shape {tuple(shape)}" if shape is not None
               else f"is {_a(type(logits).__name__)}")
        raise ValueError(f"the model's output {got}; the next-token loss needs logits "
                         f"[batch, seq, {vocab}] = [{inputs.shape[0]}, {inputs.shape[1]}, "
                         f"{vocab_size or 'V'}] for tokens of shape {inputs.shape}")
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def loss_and_metrics(loss_fn: LossFn, model: Any, batch: jax.Array, *,
                     culprit: str | None = "the loss function"
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Call a loss function and return ``(loss, metrics)`` whichever form it returns.

    Args:
        loss_fn: ``loss(model, batch) -> loss`` or ``(loss, metrics)``.
        model: the model.
        batch: the batch.
        culprit: how errors name ``loss_fn`` (``model.loss: gpt:loss``); ``None`` for
            meshkit's own loss, whose exceptions are meshkit's bugs, not the user's.

    Returns:
        The scalar loss and the metrics (``{}`` when it returns none).

    Raises:
        UserCodeError: ``loss_fn`` raised, or returned something other than a
            floating-point scalar loss computed from the model, or ``(loss, metrics)``
            with metrics a dict; or a metric named ``loss`` or ``grad_norm`` (the step's
            own). :func:`meshkit.training.user_code.check_loss_output` says each.

    Examples:
        >>> loss_and_metrics(lambda m, b: (b.sum(), {"n": b.size}), None, jnp.ones(3))
        (Array(3., dtype=float32), {'n': Array(3, dtype=int32, weak_type=True)})
    """
    if culprit is None:
        return check_loss_output(loss_fn(model, batch), culprit="the loss function")
    with blame(culprit):
        out = loss_fn(model, batch)
    return check_loss_output(out, culprit=culprit)


def config_rules(config: Config) -> ShardingRules:
    """The config's sharding rules: the roles' axes, extended by ``parallel.logical_axes``.

    Args:
        config: a validated config.

    Returns:
        :meth:`ShardingRules.from_config` extended by each ``parallel.logical_axes``
        entry in order (an entry may name one given before it).

    Examples:
        >>> config = Config().replace(
        ...     mesh={"axes": {"dp": 2, "tp": 4}}, parallel={"tensor": "tp",
        ...     "logical_axes": {"mlp": "tensor", "up": "mlp", "seq": None}},
        ...     exchange={"node_axis": [], "device_axis": []})
        >>> config_rules(config).spec("batch", "seq", "up")
        P('dp', None, 'tp')
    """
    rules = ShardingRules.from_config(config)
    for name, target in config.parallel.logical_axes.items():
        rules = rules.extend(**{name: target})
    return rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a run trains.

    Attributes:
        factory: ``rngs -> model``; a user's factory is wrapped so that what it raises
            or wrongly returns is the user's error
            (:func:`meshkit.training.user_code.checked_factory`).
        loss: ``(model, batch) -> loss or (loss, metrics)``.
        loss_culprit: how errors name the loss (``model.loss: gpt:loss``,
            ``loss=my_loss``, or a factory's model under the default next-token loss);
            ``None`` for meshkit's transformer loss.
        rules: where the parameters' logical names go on the mesh.
        flops_per_token: training FLOPs (forward and backward) of one token, given or
            counted; ``None``: take XLA's count of the compiled step.
        transformer: whether the model is meshkit's transformer built from the config's
            ``model`` section, for which :mod:`meshkit.plan` can estimate memory.

    Examples:
        >>> spec = resolve_model(Config(), model=lambda rngs: nnx.Linear(2, 2, rngs=rngs))
        >>> spec.loss_culprit, spec.flops_per_token, spec.transformer
        ("model=<lambda>'s model", None, False)
    """

    factory: Factory
    loss: LossFn
    loss_culprit: str | None
    rules: ShardingRules
    flops_per_token: float | None
    transformer: bool


def resolve_model(
    config: Config,
    *,
    model: Factory | None = None,
    loss: LossFn | None = None,
    rules: ShardingRules | None = None,
    flops_per_token: float | None = None,
) -> ModelSpec:
    """The :class:`ModelSpec` of a run: each argument given, else the config's, else the
    default.

    Args:
        config: a validated config.
        model: a factory; default ``model.factory`` with ``model.factory_kwargs``, else
            meshkit's transformer (:func:`build_model`).
        loss: a loss function; default ``model.loss``, else :func:`transformer_loss`
            for the transformer and :func:`next_token_loss` for a factory's model.
        rules: sharding rules; default :func:`config_rules`.
        flops_per_token: training FLOPs per token; default ``model.flops_per_token``,
            else :func:`meshkit.plan.flops.flops_per_token` for the transformer, else
            ``None`` (XLA's count).

    Returns:
        The spec.

    Raises:
        ConfigError: ``model.factory`` or ``model.loss`` does not import, or cannot be
            called with ``rngs=`` or ``model=, batch=``
            (:func:`meshkit.config.imports.import_callable`).
        ValueError: ``flops_per_token`` not positive.

    Examples:
        >>> spec = resolve_model(Config())
        >>> spec.transformer, spec.loss is transformer_loss, spec.flops_per_token
        (True, True, 897024)
    """
    m = config.model
    transformer = model is None and m.factory is None
    if model is not None:
        culprit = culprit_of(model, argument="model")
        factory = checked_factory(model, culprit=culprit)
    elif m.factory is not None:
        culprit = f"model.factory: {m.factory}"
        factory = checked_factory(m.factory_function(), culprit=culprit)
    else:
        culprit, factory = "", _transformer_factory(config)
    chosen: LossFn
    loss_culprit: str | None
    if loss is not None:
        chosen, loss_culprit = loss, culprit_of(loss, argument="loss")
    elif m.loss is not None:
        loss_culprit = f"model.loss: {m.loss}"
        chosen = named_loss(m.loss_function(), culprit=loss_culprit)
    elif transformer:
        chosen, loss_culprit = transformer_loss, None
    else:  # the model's output is the user's, so is what goes wrong with it
        loss_culprit = f"{culprit}'s model"
        chosen = named_loss(functools.partial(next_token_loss, vocab_size=m.vocab_size),
                            culprit=loss_culprit)
    flops = flops_per_token if flops_per_token is not None else m.flops_per_token
    if flops is None and transformer:
        flops = count_flops(m, seq_len=config.train.seq_len).training
    if flops is not None and not flops > 0:
        raise ValueError(f"flops_per_token must be positive, got {flops!r}")
    return ModelSpec(factory=factory, loss=chosen, loss_culprit=loss_culprit,
                     rules=rules or config_rules(config),
                     flops_per_token=flops, transformer=transformer)


def _transformer_factory(config: Config) -> Factory:
    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return build_model(config, rngs=rngs)

    return factory


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
