"""Measure a model meshkit can build: :func:`measure_model` compiles its training step
and fills a :class:`meshkit.plan.measured.MeasuredModel` (the method is described
there), which ``meshkit plan --model FILE --measure`` prints beside the formulas."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from meshkit.plan.measured import MeasuredModel
from meshkit.plan.model_desc import ModelDesc

__all__ = ["measure_model"]


def _config(desc: ModelDesc, num_layers: int) -> Any:
    """meshkit's config of the description on one device, plain step (no remat, XLA
    attention, no accumulation, no pipeline)."""
    from meshkit.config import load_config
    from meshkit.plan.planner import Layout
    from meshkit.plan.verify import known_keys

    small = dataclasses.replace(desc, num_layers=num_layers,
                                dense_layers=min(desc.dense_layers, max(num_layers - 1, 0)))
    overrides = small.overrides(remat="none", attention="xla", known=known_keys())
    return load_config(None, [*overrides, *Layout().overrides()])


def _cost(compiled: Any) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of a compiled program by XLA's cost analysis."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def measure_model(desc: ModelDesc) -> MeasuredModel:
    """Parameters by ``jax.eval_shape``; FLOPs and bytes by XLA's cost analysis of the
    step compiled with 2 and 3 layers (see the module docstring).

    Args:
        desc: the model; measured as meshkit builds it (:meth:`ModelDesc.buildable`),
            with its whole batch in one step (abstract: nothing is allocated).

    Returns:
        The :class:`MeasuredModel`.

    Raises:
        meshkit.config.ConfigError: meshkit cannot build the description (e.g. a batch
            or sequence its config rules refuse).

    Example::

        m = measure_model(load_model_desc("configs/models/mixtral_8x7b.yaml"))
        m.params, m.flops_per_token(32)
    """
    import jax

    from meshkit.training import Programs, compile_step

    built = desc.buildable()
    costs = [_cost(compile_step(_config(built, n))) for n in (2, 3)]
    layer = (costs[1][0] - costs[0][0], costs[1][1] - costs[0][1])
    config = _config(built, built.num_layers)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        state = Programs(config, mesh).abstract_state  # jax.eval_shape: no array made
    # The state is nnx.state((model, optimizer)): the model's leaves are under key 0.
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    params = sum(math.prod(leaf.shape) for path, leaf in leaves
                 if getattr(path[0], "key", None) == 0)
    return MeasuredModel(params=int(params), layer_flops=layer[0], layer_bytes=layer[1],
                         other_flops=costs[0][0] - 2 * layer[0],
                         other_bytes=costs[0][1] - 2 * layer[1], tokens=built.tokens)
