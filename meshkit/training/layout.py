"""The order of meshkit's transformer's stacked layers, saved with each checkpoint.

The transformer stores its ``L`` blocks on one stacked ``layers`` dimension in an order
that depends on the pipeline layout (:func:`meshkit.model.pipeline.layer_slots`): the
interleaved schedule puts each stage's chunks together, uneven stages pad every stage
to the largest. A checkpoint holds the layers (and their AdamW moments) in the order
of the run that wrote it, with the same shapes whatever the order, so restoring it
under another order would succeed and put every layer in another's place. Each
checkpoint therefore records its layout (:func:`layer_layout`) in its metadata, and
:func:`check_layout` refuses, before the restore, a run whose layers lie in another
order, in one line naming the keys. Layouts that order the layers alike (``gpipe`` and
``1f1b``; any number of stages without ``interleaved`` or ``stage_layers``) resume.
"""

from __future__ import annotations

from typing import Any

from meshkit.config import Config, ConfigError
from meshkit.model.pipeline import layer_slots

__all__ = ["LAYOUT_KEY", "check_layout", "layer_layout"]

#: The key of the layout in a checkpoint's metadata.
LAYOUT_KEY = "meshkit_layer_layout"

# The layout's entries and the config key each one comes from ("stages" is the size of
# the pipeline axis, named at check time).
_KEYS = {"schedule": "parallel.schedule", "virtual_stages": "parallel.virtual_stages",
         "stage_layers": "parallel.stage_layers", "stages": "mesh.axes"}


def layer_layout(config: Config) -> dict[str, Any]:
    """The layout of the stacked layers of the transformer ``config`` describes.

    Args:
        config: a validated config.

    Returns:
        JSON values: ``num_layers``, ``schedule``, ``stages`` (the pipeline axis's size,
        1 without one), ``virtual_stages``, ``stage_layers`` (a list or ``None``) and
        ``pipeline`` (the pipeline axis, for naming it).

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


def check_layout(saved: Any, current: dict[str, Any], *, assumed: dict[str, Any] | None,
                 where: str) -> None:
    """Refuse to restore layers saved in another order than ``current``'s.

    Args:
        saved: the layout a checkpoint was saved with (:func:`layer_layout`), or
            ``None`` for a checkpoint without one (an older meshkit's).
        current: this run's layout.
        assumed: the layout a checkpoint without one is taken to have: that of the
            workdir's ``config.yaml`` (the run that wrote the checkpoints), or ``None``
            for the default order (layer ``l`` at slot ``l``).
        where: the checkpoint, as the message names it.

    Raises:
        ConfigError: the layers lie in another order; the message starts with the keys
            that differ and gives the checkpoint's values and this run's.

    Examples:
        >>> now = {"num_layers": 4, "schedule": "interleaved", "stages": 2,
        ...        "virtual_stages": 2, "stage_layers": None, "pipeline": "pp"}
        >>> check_layout(now, now, assumed=None, where="checkpoint 2")
        >>> check_layout({**now, "schedule": "1f1b", "virtual_stages": 1}, now, assumed=None,
        ...              where="checkpoint 2")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: parallel.schedule, parallel.virtual_stages: ...
    """
    if not _readable(saved):
        # No layout recorded (or one that cannot be read): the run that wrote it used
        # the workdir's config.yaml; without that, the default order.
        saved = assumed if assumed is not None and _readable(assumed) else {
            **current, "schedule": "gpipe", "virtual_stages": 1, "stage_layers": None}
    if _slots(saved) == _slots(current):
        return
    axis = current["pipeline"] or saved.get("pipeline")
    changed = [key for key in _KEYS if saved.get(key) != current.get(key)]
    names = [f"mesh.axes.{axis}" if key == "stages" and axis else _KEYS[key] for key in changed]
    pairs = list(zip(names, changed, strict=True))
    then = ", ".join(f"{name}={saved.get(key)!r}" for name, key in pairs)
    now = ", ".join(f"{name}={current.get(key)!r}" for name, key in pairs)
    raise ConfigError(
        f"{', '.join(names)}: {where} stores the layers in the order of {then}, and this "
        f"run's order is that of {now}; resume with the checkpoint's values (a checkpoint "
        "restores only into a layout that orders the layers alike)")
