"""A dense layer's feed-forward block, written per device: column, then row parallel.

``y = (act(x W_gate) ⊙ x W_up) W_down`` (``swiglu``) or ``y = act(x W_up) W_down``
(``gelu``), :data:`meshkit.choices.MLP_KINDS`. The hidden width ``f`` is the logical
dimension ``mlp``, which the tensor axes split (Megatron): each tensor rank multiplies
the whole ``[n, d]`` input by its ``f/t`` columns of ``W_gate`` and ``W_up`` and its
``f/t`` rows of ``W_down``, so its output is a partial sum, and one all-reduce over the
tensor axes completes it. The model width is ``embed``, which FSDP shards; the weights are
all-gathered for compute (their gradients reduce-scattered).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit.choices import MLP_KINDS
from meshkit.model.experts import gated_ffn
from meshkit.sharding import sequence
from meshkit.sharding.params import gather_fsdp, normal, param
from meshkit.sharding.rules import ShardingRules

__all__ = ["MLP"]


class MLP(nnx.Module):
    """A dense MLP, tensor- and FSDP-parallel, to call per device inside ``jax.shard_map``.

    Args:
        d_model: ``d``.
        d_ff: ``f``, the hidden width (divisible by the tensor devices).
        kind: one of :data:`meshkit.choices.MLP_KINDS`.
        rules: the sharding rules (``mlp`` over the tensor axes, ``embed`` over fsdp).
        dtype: the compute dtype (parameters stay float32).
        rngs: ``nnx.Rngs``; ``swiglu`` draws ``w_gate``, ``w_up``, ``w_down`` in that order,
            ``gelu`` ``w_up``, ``w_down``.

    Raises:
        ValueError: an unknown ``kind``.

    Examples:
        >>> mlp = MLP(d_model=8, d_ff=32, kind="swiglu", rules=ShardingRules(tensor="tp"),
        ...           rngs=nnx.Rngs(0))
        >>> mlp.w_up.shape, mlp.w_up.out_sharding, mlp.w_down.out_sharding
        ((8, 32), P(None, 'tp'), P('tp', None))
        >>> MLP(d_model=8, d_ff=32, kind="gelu", rules=ShardingRules(),
        ...     rngs=nnx.Rngs(0)).local(jnp.ones((2, 4, 8))).shape
        (2, 4, 8)
    """

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        kind: str,
        rules: ShardingRules,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        if kind not in MLP_KINDS:
            raise ValueError(f"MLP: kind must be one of {', '.join(MLP_KINDS)}, got {kind!r}")
        d, f = d_model, d_ff
        if kind == "swiglu":
            self.w_gate = param(normal(rngs, (d, f), d), rules.spec("embed", "mlp"))
        self.w_up = param(normal(rngs, (d, f), d), rules.spec("embed", "mlp"))
        self.w_down = param(normal(rngs, (f, d), f), rules.spec("mlp", "embed"))
        self.kind, self.rules, self.dtype = kind, rules, jnp.dtype(dtype)

    def local(self, x: jax.Array, *, split: bool = False) -> jax.Array:
        """The block on this device's ``[..., d]`` activations.

        Args:
            x: the same on every tensor rank, or (``split``) this tensor rank's own
                tokens (sequence parallelism: gathered first, the output
                reduce-scattered back to them).
            split: whether the tensor ranks hold different tokens.

        Returns:
            ``[..., d]`` in ``x.dtype``, summed over the tensor axes.
        """
        fsdp, tensor = self.rules.fsdp, self.rules.tensor
        shape = x.shape
        # Tokens in any order (an MLP treats each alike): gathered on the flat token axis.
        flat = sequence.gather(x.reshape(-1, shape[-1]), tensor, split=split, axis=0)
        rows = flat[None]  # one "expert": gated_ffn's [L, S, d] layout
        up = gather_fsdp(self.w_up[...], self.w_up.out_sharding, fsdp)[None]
        down = gather_fsdp(self.w_down[...], self.w_down.out_sharding, fsdp)[None]
        if self.kind == "swiglu":
            gate = gather_fsdp(self.w_gate[...], self.w_gate.out_sharding, fsdp)[None]
            y = gated_ffn(rows, gate, up, down, dtype=self.dtype)
        else:
            h = jax.nn.gelu(jnp.einsum("esd,edf->esf", rows.astype(self.dtype),
                                       up.astype(self.dtype)))
            y = jnp.einsum("esf,efd->esd", h, down.astype(self.dtype))
        # Each tensor rank holds f/t of the hidden units: a partial sum of the output.
        y = sequence.reduce(y[0].astype(x.dtype), tensor, split=split, axis=0)
        return y.reshape(shape)
