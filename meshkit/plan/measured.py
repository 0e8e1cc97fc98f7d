"""Measure a model meshkit can build instead of counting it by formula: its parameters
from ``jax.eval_shape``, its FLOPs and bytes from XLA's cost analysis of one compiled
layer, with no array allocated.

:func:`measure_model` builds the description as meshkit's transformer builds it
(:meth:`meshkit.plan.model_desc.ModelDesc.buildable`) on one device of this process:

* **parameters**: the model's abstract state (``jax.eval_shape`` through
  :class:`meshkit.train.Programs`), every layer, nothing allocated;
* **FLOPs and bytes**: ``cost_analysis()`` of the training step compiled, with abstract
  inputs, for 2 and for 3 layers (no remat, no fsdp, so the layers are unrolled and XLA
  counts each: its cost analysis counts a loop's body once). The difference is one
  layer's forward, backward and optimizer update; the 2-layer step less two of it is
  the rest (embedding, head, loss, the optimizer on their weights). A step of ``L``
  layers is ``rest + L · layer``. Two layers, not one, at the low end: a 1-layer step's
  bytes are off the line through longer ones (a 4-layer MoE of width 128: 149.6 MB from
  1 to 2 layers, then 142.7 MB a layer from 2 to 4, FLOPs within 0.2 %).

Unlike the planner's ranking (numpy only), this imports JAX and compiles two small
programs on one device: seconds for a small model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from meshkit.plan.model_desc import ModelDesc

__all__ = ["MeasuredModel", "measure_model"]


@dataclasses.dataclass(frozen=True)
class MeasuredModel:
    """A model's parameters, and one training step's FLOPs and bytes, by XLA's count.

    Attributes:
        params: parameter elements of the whole model (``jax.eval_shape``).
        layer_flops, layer_bytes: one layer's, per step of ``tokens`` tokens.
        other_flops, other_bytes: everything but the layers, per step.
        tokens: tokens of the compiled step (the description's batch).
    """

    params: int
    layer_flops: float
    layer_bytes: float
    other_flops: float
    other_bytes: float
    tokens: int

    def step_flops(self, num_layers: int) -> float:
        """One training step's FLOPs with ``num_layers`` layers.

        Example:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).step_flops(3)
            20.0
        """
        return self.other_flops + num_layers * self.layer_flops

    def flops_per_token(self, num_layers: int) -> float:
        """Training FLOPs of one token with ``num_layers`` layers (the optimizer's share
        included, spread over the step's tokens).

        Example:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).flops_per_token(3)
            5.0
        """
        return self.step_flops(num_layers) / self.tokens

    def bytes_per_token(self, num_layers: int) -> float:
        """Bytes XLA's cost model says one token's step accesses.

        Example:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).bytes_per_token(3)
            1.0
        """
        return (self.other_bytes + num_layers * self.layer_bytes) / self.tokens


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

    from meshkit.train import Programs, compile_step

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
