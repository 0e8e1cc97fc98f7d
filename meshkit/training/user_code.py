"""Calling a user's own code (the model factory, the model it makes, the loss) and
blaming it, not meshkit, when it fails.

A mistake in code the user wrote is the user's error: one line, exit 2
(:class:`~meshkit.errors.UserCodeError`), naming the code the way the user named it
(``model.factory: gpt:make``, ``model.loss: gpt:loss``, or a Python argument,
``loss=my_loss``) and the user's own exception, which stays the ``__cause__`` for
``meshkit --debug``. What the code returns is checked as it returns it: a factory's
model is an ``nnx.Module`` with floating-point parameters, a loss a floating-point
scalar computed from the model (a constant would train nothing, with a gradient of 0),
with metrics that do not take the step's own names.

Examples:
    >>> factory = checked_factory(lambda rngs: None, culprit="model=make")
    >>> factory(nnx.Rngs(0))
    Traceback (most recent call last):
    meshkit.errors.UserCodeError: model=make returned None, not an nnx.Module
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshkit.errors import MeshkitError, UserCodeError
from meshkit.sharding.hints import explain

__all__ = ["RESERVED_METRICS", "blame", "check_loss_output", "checked_factory", "culprit_of",
           "named_loss"]

RESERVED_METRICS = ("loss", "grad_norm")
"""The step's own metrics: a loss's metrics may not take these names."""

# Where a wrapped function keeps its culprit: a function resolved once (by train) and
# passed on (to Programs) keeps the name the user gave it, and is not wrapped twice.
_CULPRIT = "meshkit_culprit"


def culprit_of(fn: Any, *, argument: str) -> str:
    """How an error names a function passed as a Python argument: ``loss=my_loss``.

    Args:
        fn: the function.
        argument: the parameter it was passed as (``model``, ``loss``).

    Returns:
        ``argument=name``.

    Examples:
        >>> culprit_of(len, argument="loss")
        'loss=len'
    """
    named = getattr(fn, _CULPRIT, None)
    if isinstance(named, str):
        return named
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{argument}={name}"


@contextlib.contextmanager
def blame(culprit: str) -> Iterator[None]:
    """Report an exception the user's code raises inside as the user's error.

    meshkit's own errors (and ``KeyboardInterrupt``) pass through as they are.

    Args:
        culprit: how the message names the code (``model.factory: gpt:make``).

    Raises:
        UserCodeError: ``CULPRIT raised TYPE: first line of its message``.

    Examples:
        >>> with blame("model.loss: gpt:loss"):
        ...     {}["x"]
        Traceback (most recent call last):
        meshkit.errors.UserCodeError: model.loss: gpt:loss raised KeyError: 'x'
    """
    try:
        yield
    except MeshkitError:
        raise
    except Exception as e:
        hint = explain(e)  # a known sharding error: its fix, not JAX's wording
        if hint:
            raise UserCodeError(f"{culprit}: {hint}") from e
        lines = str(e).strip().splitlines()
        said = f": {lines[0][:300]}" if lines else ""
        raise UserCodeError(f"{culprit} raised {type(e).__name__}{said}") from e


def checked_factory(fn: Callable[[nnx.Rngs], Any], *, culprit: str
                    ) -> Callable[[nnx.Rngs], nnx.Module]:
    """``fn``, with what it raises and returns checked.

    Args:
        fn: ``rngs -> model``, the user's.
        culprit: how errors name it.

    Returns:
        ``rngs -> model``, raising :class:`~meshkit.errors.UserCodeError` where ``fn``
        raises, returns no ``nnx.Module``, or returns one with no ``nnx.Param`` or a
        parameter that is not floating point (it could not be trained). ``fn`` itself
        when it is checked already.

    Examples:
        >>> make = checked_factory(lambda rngs: nnx.Embed(4, 2, rngs=rngs), culprit="model=m")
        >>> make(nnx.Rngs(0)).embedding.shape
        (4, 2)
    """
    if isinstance(getattr(fn, _CULPRIT, None), str):
        return fn

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        with blame(culprit):
            model = fn(rngs)
        if not isinstance(model, nnx.Module):
            shown = "None" if model is None else _a(type(model).__name__)
            raise UserCodeError(f"{culprit} returned {shown}, not an nnx.Module")
        params = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        if not params:
            raise UserCodeError(f"{culprit} returned a model with no parameters (nnx.Param) "
                                "to train")
        for path, leaf in params:
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise UserCodeError(f"{culprit} returned a model whose parameter "
                                    f"{_path(path)} is {leaf.dtype}: a parameter must be "
                                    "floating point to have a gradient")
        return model

    setattr(factory, _CULPRIT, culprit)
    return factory


def named_loss(fn: Callable[[Any, Any], Any], *, culprit: str) -> Callable[[Any, Any], Any]:
    """``fn``, carrying the name errors give it (read by :func:`culprit_of`).

    Args:
        fn: ``loss(model, batch)``.
        culprit: how errors name it (``model.loss: gpt:loss``).

    Returns:
        A function calling ``fn``.

    Examples:
        >>> culprit_of(named_loss(min, culprit="model.loss: gpt:loss"), argument="loss")
        'model.loss: gpt:loss'
    """

    def loss(model: Any, batch: Any) -> Any:
        return fn(model, batch)

    setattr(loss, _CULPRIT, culprit)
    return loss


def check_loss_output(out: Any, *, culprit: str) -> tuple[jax.Array, dict[str, jax.Array]]:
    """What a loss function returned, as ``(loss, metrics)``, or the reason it is wrong.

    Args:
        out: the loss, or ``(loss, metrics)``.
        culprit: how errors name the loss function.

    Returns:
        The scalar loss and the metrics (``{}`` when it returned none).

    Raises:
        UserCodeError: not a loss or a ``(loss, metrics)`` pair; a loss that is no
            floating-point scalar, or a constant (a Python or NumPy number: its gradient
            is 0); a metric named ``loss`` or ``grad_norm``.

    Examples:
        >>> check_loss_output(1.5, culprit="loss=f")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.errors.UserCodeError: loss=f returned the constant 1.5 (a float), ...
    """
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            shape = f"a tuple of {len(out)}" if len(out) != 2 else (
                f"a pair whose second item is {_a(type(out[1]).__name__)}")
            raise UserCodeError(f"{culprit} returned {shape}: a loss function returns the "
                                "loss, or (loss, metrics) with metrics a dict of arrays")
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if isinstance(loss, (bool, int, float, complex, np.number, np.ndarray)):
        shown = loss if np.size(loss) == 1 else f"array of shape {np.shape(loss)}"
        raise UserCodeError(f"{culprit} returned the constant {shown} "
                            f"({_a(type(loss).__name__)}), not a JAX array computed from the "
                            "model: its gradient would be 0 and nothing would train")
    if not isinstance(loss, jax.Array):
        raise UserCodeError(f"{culprit} returned {_a(type(loss).__name__)}, not a JAX array")
    if loss.shape != ():
        raise UserCodeError(f"{culprit} returned a loss of shape {loss.shape}: the loss must "
                            "be a scalar (take its mean)")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise UserCodeError(f"{culprit} returned a loss of dtype {loss.dtype}: the loss must "
                            "be floating point to have a gradient")
    clash = [name for name in RESERVED_METRICS if name in metrics]
    if clash:
        raise UserCodeError(f"{culprit} returned a metric named {clash[0]!r}: the step logs "
                            f"its own {', '.join(RESERVED_METRICS)}")
    with blame(f"{culprit}: metrics"):
        return loss, {str(name): jnp.asarray(value) for name, value in metrics.items()}


def _path(path: tuple[Any, ...]) -> str:
    keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return "/".join(k for k in keys if k not in ("value", ".value"))


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
