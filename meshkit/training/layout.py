"""The order of meshkit's transformer's stacked layers, saved with each checkpoint.

The transformer stores its ``L`` blocks on one stacked ``layers`` dimension in an order
that depends on the pipeline layout (:func:`meshkit.model.pipeline.layer_slots`): the
interleaved schedule puts each stage's chunks together, uneven stages pad every stage
to the largest. A checkpoint holds the layers (and their AdamW moments) in the order
of the run that wrote it, often with the same shapes whatever the order, so restoring
it as it is under another layout would put every layer in another's place. Each
checkpoint therefore records its layout (:func:`layer_layout`); a resume under a
layout that orders the layers otherwise restores them in the checkpoint's order
(:func:`saved_target`) and moves every layer to its slot in this run's
(:func:`reorder`), the unused slots of uneven stages zero as in a fresh run.
Layouts that order the layers alike (``gpipe`` and ``1f1b``; any number of stages
without ``interleaved`` or ``stage_layers``) restore as they are.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.config import Config
from meshkit.model.pipeline import layer_slots

__all__ = ["LAYOUT_KEY", "Moves", "layer_layout", "layer_moves", "reorder", "saved_target"]

#: The key of the layout in a checkpoint's metadata.
LAYOUT_KEY = "meshkit_layer_layout"


class Moves(NamedTuple):
    """Where each layer lies in a checkpoint and where this run keeps it.

    Attributes:
        source: the checkpoint's slot of each layer, in layer order.
        source_size: the checkpoint's stacked dimension.
        target: this run's slot of each layer.
        target_size: this run's stacked dimension.
    """

    source: tuple[int, ...]
    source_size: int
    target: tuple[int, ...]
    target_size: int


def layer_layout(config: Config) -> dict[str, Any]:
    """The layout of the stacked layers of the transformer ``config`` describes.

    Args:
        config: a validated config.

    Returns:
        JSON values: ``num_layers``, ``schedule``, ``stages`` (the pipeline axis's size,
        1 without one), ``virtual_stages``, ``stage_layers`` (a list or ``None``) and
        ``pipeline`` (the pipeline axis's name, or ``None``).

    Examples:
        >>> layer_layout(Config())["schedule"], layer_layout(Config())["stages"]
        ('gpipe', 1)
    """
    p = config.parallel
    return {
        "num_layers": config.model.num_layers,
        "schedule": p.schedule,
        "stages": 1 if p.pipeline is None else config.mesh.strategy().shape[p.pipeline],
        "virtual_stages": p.virtual_stages,
        "stage_layers": None if p.stage_layers is None else list(p.stage_layers),
        "pipeline": p.pipeline,
    }


def _slots(layout: dict[str, Any]) -> tuple[list[int], int]:
    return layer_slots(int(layout["num_layers"]), schedule=str(layout["schedule"]),
                       stages=int(layout["stages"]),
                       virtual_stages=int(layout["virtual_stages"]),
                       stage_layers=layout["stage_layers"])


def _readable(layout: Any) -> bool:
    try:
        _slots(layout)
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return False
    return True


def _resolved(saved: Any, current: dict[str, Any], assumed: dict[str, Any] | None
              ) -> dict[str, Any]:
    if _readable(saved):
        return dict(saved)
    # No layout recorded (or one that cannot be read): the run that wrote it used the
    # workdir's config.yaml; without that, the default order.
    if assumed is not None and _readable(assumed):
        return assumed
    return {**current, "schedule": "gpipe", "virtual_stages": 1, "stage_layers": None}


def layer_moves(saved: Any, current: dict[str, Any], *, assumed: dict[str, Any] | None
                ) -> Moves | None:
    """How the stacked layers of a checkpoint move into this run's order.

    Args:
        saved: the layout a checkpoint was saved with (:func:`layer_layout`), or
            ``None`` for a checkpoint without one (an older meshkit's).
        current: this run's layout.
        assumed: the layout a checkpoint without one is taken to have: that of the
            workdir's ``config.yaml`` (the run that wrote the checkpoints), or ``None``
            for the default order (layer ``l`` at slot ``l``).

    Returns:
        ``None`` when both order the layers alike; else the :class:`Moves`.

    Examples:
        >>> now = {"num_layers": 4, "schedule": "interleaved", "stages": 2,
        ...        "virtual_stages": 2, "stage_layers": None, "pipeline": "pp"}
        >>> layer_moves(now, now, assumed=None) is None
        True
        >>> layer_moves({**now, "schedule": "1f1b", "virtual_stages": 1}, now, assumed=None)
        Moves(source=(0, 1, 2, 3), source_size=4, target=(0, 2, 1, 3), target_size=4)
    """
    (source, source_size), (target, target_size) = (
        _slots(_resolved(saved, current, assumed)), _slots(current))
    if (source, source_size) == (target, target_size):
        return None
    return Moves(tuple(source), source_size, tuple(target), target_size)


def _stacked(path: tuple[Any, ...]) -> bool:
    """A leaf of the stacked layers: the model's ``layers`` or an optimizer state of them."""
    return any(getattr(key, "key", None) == "layers" for key in path)


def saved_target(target: Any, moves: Moves) -> Any:
    """``target`` with the stacked layers' leaves as the checkpoint holds them.

    Each keeps its sharding, but for a stacked dimension its mesh axes do not divide
    (uneven stages), which is then left whole.

    Args:
        target: the abstract state of this run (every leaf with a ``NamedSharding``).
        moves: from :func:`layer_moves`.

    Returns:
        The abstract state to restore the checkpoint onto.

    Examples:
        >>> mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2],
        ...                      axis_types=(jax.sharding.AxisType.Auto,))
        >>> stacked = NamedSharding(mesh, P("pp", None))
        >>> target = {"layers": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=stacked)}
        >>> onto = saved_target(target, Moves((0, 1, 2, 3), 6, (0, 2, 1, 3), 4))["layers"]
        >>> onto.shape, onto.sharding.spec
        ((6, 8), P('pp', None))
    """
    def one(path: tuple[Any, ...], leaf: Any) -> Any:
        if not _stacked(path):
            return leaf
        sharding = leaf.sharding
        spec = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        if moves.source_size % math.prod(sharding.mesh.shape[a] for a in axes if a):
            spec[0] = None
        return jax.ShapeDtypeStruct((moves.source_size, *leaf.shape[1:]), leaf.dtype,
                                    sharding=NamedSharding(sharding.mesh, P(*spec)))

    return jax.tree_util.tree_map_with_path(one, target)


def reorder(state: Any, moves: Moves, shardings: Any) -> Any:
    """Move the stacked layers of a restored ``state`` to this run's slots.

    Args:
        state: restored onto :func:`saved_target`.
        moves: from :func:`layer_moves`.
        shardings: this run's state shardings (the result's).

    Returns:
        The state in this run's order: layer ``l`` of each stacked leaf moved from
        slot ``moves.source[l]`` to ``moves.target[l]``, unused slots zero.

    Examples:
        >>> mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2],
        ...                      axis_types=(jax.sharding.AxisType.Auto,))
        >>> stacked = NamedSharding(mesh, P("pp"))
        >>> saved = {"layers": jnp.array([0.0, 2.0, 1.0, 3.0]), "head": jnp.ones(2)}
        >>> moves = Moves((0, 2, 1, 3), 4, (0, 1, 2, 3), 4)  # interleaved to in order
        >>> got = reorder(saved, moves, {"layers": stacked, "head": NamedSharding(mesh, P())})
        >>> got["layers"].tolist(), got["head"].tolist()
        ([0.0, 1.0, 2.0, 3.0], [1.0, 1.0])
    """
    source, target = np.asarray(moves.source), np.asarray(moves.target)

    def one(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        if not _stacked(path):
            return x
        return jnp.zeros((moves.target_size, *x.shape[1:]), x.dtype).at[target].set(
            x[source])

    return jax.jit(lambda s: jax.tree_util.tree_map_with_path(one, s),
                   out_shardings=shardings)(state)
