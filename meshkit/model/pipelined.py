"""The pipeline protocol: how a user's model tells the trainer what to pipeline.

A model the trainer can pipeline is ``embed → stacked layers → head``: three attributes,

* ``embed``: ``tokens [B, T] -> h [B, T, d]`` (any callable module);
* ``layers``: an NNX module whose every variable is stacked on a leading layer dimension
  (made with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})``, so
  the rules split it over the pipeline axis), one layer mapping ``h -> h``;
* ``head``: ``h [B, T, d] -> logits`` (e.g. a final norm and the output projection),

with ``model(tokens) == head(layers applied in order to embed(tokens))``.
:class:`Pipelined` is such a model made from the three parts; a model of one's own may
have the three attributes instead. Under a pipeline axis (``parallel.pipeline``) the
trainer runs ``embed``, then the layers as the schedule's stages
(:func:`meshkit.model.pipeline.pipeline` / :func:`~meshkit.model.pipeline.pipeline_loss`),
then ``head`` and the user's loss; without one it calls the model as it is.
:func:`pipeline_parts` reads the three parts, or says what is missing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx

__all__ = ["PARTS", "Parts", "Pipelined", "pipeline_parts"]

#: The attributes of the pipeline protocol, in the order the model runs them.
PARTS = ("embed", "layers", "head")


class Parts(NamedTuple):
    """A model's three parts under the pipeline protocol.

    Attributes:
        embed: ``tokens -> h``.
        layers: the stacked layers (an ``nnx.Module``, every variable ``[L, ...]``).
        head: ``h -> logits``.
        num_layers: ``L``.
    """

    embed: Any
    layers: nnx.Module
    head: Any
    num_layers: int


class Pipelined(nnx.Module):
    """A model ``head(layers(embed(tokens)))`` that the trainer can pipeline.

    Called directly, it runs the stacked layers in order on the device(s) it is on;
    under ``train()`` with ``parallel.pipeline``, the trainer runs the layers as the
    pipeline's stages under ``parallel.schedule`` (``gpipe``, ``1f1b`` or
    ``interleaved`` with ``parallel.virtual_stages``), with ``parallel.microbatches``.

    Args:
        embed: ``tokens [B, T] -> h [B, T, d]``, an NNX module.
        layers: the stacked layers: an NNX module whose every variable has a leading
            layer dimension (``nnx.vmap`` with
            ``transform_metadata={nnx.PARTITION_NAME: "layers"}``); one layer maps
            ``h -> h``.
        head: ``h -> logits``, an NNX module (e.g. a final norm and the output
            projection).

    Raises:
        TypeError: a part that is not an NNX module, or layers that are not stacked
            (:func:`pipeline_parts`).

    Example::

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):
            return Block(rngs)

        model = meshkit.Pipelined(embed=nnx.Embed(64, 32, rngs=rngs), layers=stack(rngs),
                                  head=nnx.Linear(32, 64, rngs=rngs))
        logits = model(tokens)  # [B, T, 64]
    """

    def __init__(self, *, embed: nnx.Module, layers: nnx.Module, head: nnx.Module) -> None:
        for name, part in (("embed", embed), ("layers", layers), ("head", head)):
            if not isinstance(part, nnx.Module):
                raise TypeError(f"Pipelined: {name} must be an nnx.Module, got "
                                f"{type(part).__name__}")
        self.embed, self.layers, self.head = embed, layers, head
        pipeline_parts(self, what="Pipelined")  # the layers are stacked

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(run_in_order(self.layers, self.embed(tokens)))


def run_in_order(layers: nnx.Module, h: jax.Array) -> jax.Array:
    """``h`` through stacked layers one after another, on the devices it is on.

    Args:
        layers: an NNX module whose every variable is ``[L, ...]``.
        h: the first layer's input.

    Returns:
        The last layer's output.

    Example::

        h = run_in_order(model.layers, model.embed(tokens))
    """
    graphdef, state = nnx.split(layers)

    def one(h: jax.Array, params: Any) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, params)(h), None

    # A loop, not unrolled: one copy of a layer in the program, whatever L.
    h, _ = jax.lax.scan(one, h, state)
    return h


def pipeline_parts(model: Any, *, what: str = "the model") -> Parts:
    """The three parts of a model that follows the pipeline protocol.

    Args:
        model: the model (abstract shapes are enough: ``nnx.eval_shape``'s).
        what: how errors name the model.

    Returns:
        Its :class:`Parts`.

    Raises:
        TypeError: an attribute of :data:`PARTS` missing (the message names them all),
            ``embed`` or ``head`` not callable, ``layers`` not an NNX module, holding no
            variables, or whose variables do not share one leading layer dimension
            named ``layers`` (the first that differs named).

    Examples:
        >>> pipeline_parts(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), what="model=make")
        Traceback (most recent call last):
        TypeError: model=make has no embed, layers, head
    """
    missing = [name for name in PARTS if not hasattr(model, name)]
    if missing:
        raise TypeError(f"{what} has no {', '.join(missing)}")
    for name in ("embed", "head"):
        part = getattr(model, name)
        if isinstance(part, nnx.Variable) or not callable(part):  # a Variable is callable
            raise TypeError(f"{what}: its {name} is {_a(type(part).__name__)}, not a "
                            "callable module")
    layers = model.layers
    stack = "stack them with nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: 'layers'})"
    if not isinstance(layers, nnx.Module) or isinstance(layers, nnx.List | nnx.Sequential):
        raise TypeError(f"{what}: its layers are {_a(type(layers).__name__)}, not one "
                        f"nnx.Module of stacked layers; {stack}")
    variables = [(path, v) for path, v in nnx.iter_graph(layers) if isinstance(v, nnx.Variable)]
    if not variables:
        raise TypeError(f"{what}: its layers hold no variables")
    first = variables[0][1].shape[:1]
    for path, v in variables:
        # A stacked variable's leading name is the vmap's partition name; a variable
        # named otherwise is one layer's own, e.g. of a module that was never stacked.
        names = v.get_metadata().get("out_sharding")
        if v.shape[:1] != first or not first or (names and names[0] != "layers"):
            raise TypeError(
                f"{what}: its layers are not stacked: variable 'layers/{_path(path)}' has "
                f"shape {tuple(v.shape)}" + (f" named {tuple(names)}" if names else "")
                + f", where a stacked one is [{first[0] if first else 'L'}, ...] named "
                f"('layers', ...); {stack}")
    return Parts(embed=model.embed, layers=layers, head=model.head, num_layers=first[0])


def _path(path: tuple[Any, ...]) -> str:
    keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return "/".join(k for k in keys if k not in ("value", ".value"))


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
