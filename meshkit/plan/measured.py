"""Measure a model meshkit can build instead of counting it by formula: its parameters
from ``jax.eval_shape``, its FLOPs and bytes from XLA's cost analysis of one compiled
layer, with no array allocated.

:func:`meshkit.training.measured.measure_model` (a layer up: it compiles the training
step) builds the description as meshkit's transformer builds it
(:meth:`meshkit.plan.model_desc.ModelDesc.buildable`) on one device of this process:

* **parameters**: the model's abstract state (``jax.eval_shape`` through
  :class:`meshkit.training.Programs`), every layer, nothing allocated;
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

__all__ = ["MeasuredModel"]


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

        Examples:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).step_flops(3)
            20.0
        """
        return self.other_flops + num_layers * self.layer_flops

    def flops_per_token(self, num_layers: int) -> float:
        """Training FLOPs of one token with ``num_layers`` layers (the optimizer's share
        included, spread over the step's tokens).

        Examples:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).flops_per_token(3)
            5.0
        """
        return self.step_flops(num_layers) / self.tokens

    def bytes_per_token(self, num_layers: int) -> float:
        """Bytes XLA's cost model says one token's step accesses.

        Examples:
            >>> MeasuredModel(10, 6.0, 1.0, 2.0, 1.0, 4).bytes_per_token(3)
            1.0
        """
        return (self.other_bytes + num_layers * self.layer_bytes) / self.tokens
