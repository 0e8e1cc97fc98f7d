"""The routed experts of an MoE layer: NNX modules that run per device on dispatched rows.

An :class:`Experts` module holds ``E`` feed-forward networks whose parameters are
stacked on a leading expert dimension ``[E, ...]``, and each parameter's ``out_sharding``
metadata starts with the expert axes (:func:`expert_param` creates such a parameter).
Inside ``jax.shard_map`` with the module's partition specs (``nnx.get_partition_spec``;
:class:`meshkit.model.moe.MoE` passes them itself) every device therefore holds only its
``E/P`` local experts, and the module runs them on the
:class:`~meshkit.exchange.dispatch.ExpertBatch` a dispatcher delivered, in either layout:

- **padded**, ``[E/P, C, d]`` (the capacity dispatchers): :meth:`Experts.padded`;
- **grouped**, ``[R, d]`` rows with ``group_sizes [E/P]`` (the ragged dispatcher):
  :meth:`Experts.grouped`, which a subclass may leave out; the MoE layer then never
  chooses the ragged exchange for it.

Built in: :class:`SwiGLUExperts` (gated, the layer's default), :class:`MLPExperts`
(``activation(x W_in) W_out``, GELU unless told otherwise) and :class:`FunctionExperts`
(a plain per-expert function of its weights and rows). FSDP-sharded parameters (an
``"embed"`` entry in their spec) are gathered by :func:`meshkit.sharding.params.gather_fsdp_params`
before the call; the modules themselves never communicate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit.exchange.dispatch import ExpertBatch
from meshkit.sharding.params import normal, param
from meshkit.sharding.rules import ShardingRules

__all__ = [
    "Experts",
    "FunctionExperts",
    "MLPExperts",
    "SwiGLUExperts",
    "expert_param",
    "gated_ffn",
]

Activation = Callable[[jax.Array], jax.Array]


def _default_rules(rules: ShardingRules | None) -> ShardingRules:
    # The MoE layer's own default, so experts built without rules fit a layer built so.
    return ShardingRules(node="node", device="device") if rules is None else rules


def expert_param(value: jax.Array, rules: ShardingRules | None, *dims: str | None) -> nnx.Param:
    """A stacked expert parameter: ``value`` is ``[E, ...]``, split over the expert axes.

    Args:
        value: the initial value, the expert dimension first.
        rules: the sharding rules (``None``: experts over ``node`` × ``device``, the
            :class:`~meshkit.model.moe.MoE` default).
        *dims: the logical name (:data:`meshkit.sharding.rules.LOGICAL_AXES`) or ``None``
            of each dimension after the expert one; ``"embed"`` marks the model width,
            which FSDP shards.

    Returns:
        An ``nnx.Param`` whose ``out_sharding`` is ``rules.spec("experts", *dims)``.

    Raises:
        ValueError: ``dims`` does not name every dimension after the first.

    Examples:
        >>> w = expert_param(jnp.zeros((8, 4, 16)), ShardingRules(fsdp="f", node="n"),
        ...                  "embed", None)
        >>> w.out_sharding
        P('n', 'f', None)
    """
    if value.ndim != len(dims) + 1:
        raise ValueError(
            f"expert_param: a value of shape {value.shape} needs {value.ndim - 1} dims after "
            f"the expert dimension, got {len(dims)}: {dims}"
        )
    return param(value, _default_rules(rules).spec("experts", *dims))


def gated_ffn(
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    group_sizes: jax.Array | None = None,
    activation: Activation = jax.nn.silu,
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Gated FFN per expert, ``(activation(x W_gate) ⊙ x W_up) W_down`` (SwiGLU for silu).

    Args:
        rows: ``[L, S, d]`` padded rows per expert, or ``[R, d]`` rows grouped by expert
            when ``group_sizes`` is given.
        w_gate: ``[L, d, f]``.
        w_up: ``[L, d, f]``.
        w_down: ``[L, f, d]``.
        group_sizes: ``[L]`` rows per expert (grouped layout), or ``None``.
        activation: the gate's nonlinearity.
        dtype: the compute dtype (rows and weights are cast to it).

    Returns:
        The outputs, shaped like ``rows``, in ``dtype``; grouped rows past the groups
        come out 0.

    Examples:
        >>> w = jnp.ones((2, 3, 4))
        >>> gated_ffn(jnp.ones((2, 5, 3)), w, w, jnp.ones((2, 4, 3))).shape
        (2, 5, 3)
    """
    rows = rows.astype(dtype)
    w_gate, w_up, w_down = (w.astype(dtype) for w in (w_gate, w_up, w_down))
    if group_sizes is None:
        g = jnp.einsum("esd,edf->esf", rows, w_gate)
        u = jnp.einsum("esd,edf->esf", rows, w_up)
        return _gated_down(activation, g, u, w_down, None)
    # ragged_dot multiplies each group by its expert's matrix: the rows arrive grouped,
    # and a padded [L, S, d] buffer would bring back the worst-case memory and FLOPs the
    # ragged exchange avoids.
    g = jax.lax.ragged_dot(rows, w_gate, group_sizes)
    u = jax.lax.ragged_dot(rows, w_up, group_sizes)
    return _gated_down(activation, g, u, w_down, group_sizes)


def _down(activation: Activation, g: jax.Array, u: jax.Array, w_down: jax.Array,
          group_sizes: jax.Array | None) -> jax.Array:
    h = activation(g) * u
    if group_sizes is None:
        return jnp.einsum("esf,efd->esd", h, w_down)
    return jax.lax.ragged_dot(h, w_down, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_down(activation: Activation, g: jax.Array, u: jax.Array, w_down: jax.Array,
                group_sizes: jax.Array | None) -> jax.Array:
    """``(activation(g) ⊙ u) W_down``, keeping only ``g``, ``u`` and ``W_down`` for the
    backward pass, which recomputes the gate's elementwise work (no matmul).

    Differentiated plainly, the nonlinearity, the product and their derivatives keep four
    more ``[L, S, f]`` arrays per layer until the backward pass: the largest activations
    of an MoE layer. A fused SwiGLU kernel keeps only its inputs too. A custom VJP rather
    than ``jax.checkpoint``: an enclosing remat policy (FSDP's, which keeps everything but
    the gathers) would override a nested checkpoint's. Under FSDP ``W_down`` is a gathered
    weight, which that policy gathers again rather than keeps.
    """
    return _down(activation, g, u, w_down, group_sizes)


def _gated_down_fwd(activation: Activation, g: jax.Array, u: jax.Array, w_down: jax.Array,
                    group_sizes: jax.Array | None) -> tuple[jax.Array, tuple[Any, ...]]:
    return _down(activation, g, u, w_down, group_sizes), (g, u, w_down, group_sizes)


def _gated_down_bwd(activation: Activation, res: tuple[Any, ...], dy: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    g, u, w_down, group_sizes = res
    # Tied to dy, the recomputation cannot start before the backward pass reaches this
    # layer: XLA:CPU drops optimization barriers before it schedules, and would compute
    # activation(g) and the product right after the forward pass's g and keep them until
    # here (three more [L, S, f] arrays a layer; 2.3 MiB of the matched dp8 step's temp).
    # g + 0·dy[0] is g; a NaN in dy makes every gradient NaN whichever way.
    g = g + dy.reshape(-1)[0].astype(g.dtype) * 0
    # The primal product this recomputes is unused: only the elementwise part runs.
    _, vjp = jax.vjp(lambda g, u, w: _down(activation, g, u, w, group_sizes), g, u, w_down)
    dg, du, dw = vjp(dy)
    return dg, du, dw, None


_gated_down.defvjp(_gated_down_fwd, _gated_down_bwd)


class Experts(nnx.Module):
    """Base class of an MoE layer's routed experts, run per device on an ``ExpertBatch``.

    A subclass stores its parameters stacked on a leading expert dimension (every
    ``nnx.Param`` ``[E, ...]`` with its ``out_sharding`` starting with the expert axes:
    :func:`expert_param`) and implements

    - :meth:`padded` (required): ``rows [L, S, d] -> [L, S, d]``, expert ``j`` of the
      ``L`` experts the parameters hold on rows ``rows[j]``;
    - :meth:`grouped` (optional): ``rows [R, d], group_sizes [L] -> [R, d]``.

    ``L`` is whatever the parameters' leading dimension is: ``E/P`` inside
    ``jax.shard_map`` with the parameters' partition specs, ``E`` outside it (handy for
    a dense reference). Calling the module picks the method by the batch's layout.

    Examples:
        >>> class Scaled(Experts):  # expert e multiplies its rows by scale[e]
        ...     def __init__(self, num_experts: int) -> None:
        ...         self.scale = expert_param(jnp.arange(1.0, num_experts + 1), None)
        ...     def padded(self, rows: jax.Array) -> jax.Array:
        ...         return rows * self.scale[...][:, None, None]
        >>> Scaled(2)(ExpertBatch(jnp.ones((2, 1, 3))))[:, 0, 0].tolist()
        [1.0, 2.0]
        >>> Scaled.supports_grouped()
        False
    """

    def __call__(self, batch: ExpertBatch) -> jax.Array:
        """Run the experts on a dispatched batch.

        Args:
            batch: padded rows (``group_sizes`` ``None``) or grouped rows.

        Returns:
            The outputs, shaped like ``batch.rows``.

        Raises:
            NotImplementedError: grouped rows for a subclass without :meth:`grouped`.

        Examples:
            >>> experts = MLPExperts(num_experts=2, d_model=3, d_ff=4, rngs=nnx.Rngs(0))
            >>> experts(ExpertBatch(jnp.ones((2, 5, 3)))).shape
            (2, 5, 3)
        """
        if batch.group_sizes is None:
            return self.padded(batch.rows)
        if not self.supports_grouped():
            raise NotImplementedError(
                f"{type(self).__name__} runs padded rows only: it does not implement "
                "grouped(rows, group_sizes), which the ragged (grouped) layout needs; "
                "implement it, or use a capacity dispatcher"
            )
        return self.grouped(batch.rows, batch.group_sizes)

    def padded(self, rows: jax.Array) -> jax.Array:
        """The experts on padded rows.

        Args:
            rows: ``[L, S, d]``, ``S`` slots per expert (padding slots are 0).

        Returns:
            ``[L, S, d]``; what comes out for padding slots is never used.

        Raises:
            NotImplementedError: always, in the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement padded(rows)")

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The experts on rows grouped by expert (the ragged layout).

        Args:
            rows: ``[R, d]``: expert ``j``'s ``group_sizes[j]`` rows follow expert
                ``j − 1``'s; rows past the last group are padding.
            group_sizes: ``[L]`` int32.

        Returns:
            ``[R, d]``; what comes out for padding rows is never used.

        Raises:
            NotImplementedError: always, in the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement grouped()")

    @classmethod
    def supports_grouped(cls) -> bool:
        """Whether the experts run the grouped (ragged) layout: :meth:`grouped` overridden.

        Returns:
            ``True`` when a subclass defines :meth:`grouped`.

        Examples:
            >>> SwiGLUExperts.supports_grouped(), FunctionExperts.supports_grouped()
            (True, False)
        """
        return cls.grouped is not Experts.grouped


class SwiGLUExperts(Experts):
    """Gated experts ``(activation(x W_gate) ⊙ x W_up) W_down``: SwiGLU with ``silu``.

    The MoE layer's default experts (which it keeps, under the same names ``w_gate``,
    ``w_up``, ``w_down``, on the layer itself). ``activation=jax.nn.gelu`` gives GeGLU.

    Args:
        num_experts: ``E``.
        d_model: ``d``, the model width (FSDP-sharded, logical ``"embed"``).
        d_ff: ``f``, each expert's hidden width.
        rules: the sharding rules (``None``: experts over ``node`` × ``device``).
        activation: the gate's nonlinearity.
        dtype: the compute dtype (parameters stay float32).
        rngs: ``nnx.Rngs``; three keys are drawn, ``w_gate``'s first.

    Examples:
        >>> experts = SwiGLUExperts(num_experts=4, d_model=8, d_ff=16, rngs=nnx.Rngs(0))
        >>> experts.w_gate.shape, experts.w_down.out_sharding
        ((4, 8, 16), P(('node', 'device'), None, None))
    """

    def __init__(
        self,
        *,
        num_experts: int,
        d_model: int,
        d_ff: int,
        rules: ShardingRules | None = None,
        activation: Activation = jax.nn.silu,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        e, d, f = num_experts, d_model, d_ff
        self.w_gate = expert_param(normal(rngs, (e, d, f), d), rules, "embed", "expert_mlp")
        self.w_up = expert_param(normal(rngs, (e, d, f), d), rules, "embed", "expert_mlp")
        self.w_down = expert_param(normal(rngs, (e, f, d), f), rules, "expert_mlp", "embed")
        self.activation, self.dtype = activation, jnp.dtype(dtype)

    def padded(self, rows: jax.Array) -> jax.Array:
        return gated_ffn(rows, self.w_gate[...], self.w_up[...], self.w_down[...],
                         activation=self.activation, dtype=self.dtype)

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return gated_ffn(rows, self.w_gate[...], self.w_up[...], self.w_down[...],
                         group_sizes=group_sizes, activation=self.activation,
                         dtype=self.dtype)


class MLPExperts(Experts):
    """Two-matrix experts ``activation(x W_in) W_out`` (GELU by default).

    Args:
        num_experts: ``E``.
        d_model: ``d``, the model width (FSDP-sharded, logical ``"embed"``).
        d_ff: ``f``, each expert's hidden width.
        rules: the sharding rules (``None``: experts over ``node`` × ``device``).
        activation: the hidden nonlinearity.
        dtype: the compute dtype (parameters stay float32).
        rngs: ``nnx.Rngs``; two keys are drawn, ``w_in``'s first.

    Examples:
        >>> experts = MLPExperts(num_experts=4, d_model=8, d_ff=16, activation=jax.nn.relu,
        ...                      rngs=nnx.Rngs(0))
        >>> experts.w_in.shape, experts.w_out.shape
        ((4, 8, 16), (4, 16, 8))
    """

    def __init__(
        self,
        *,
        num_experts: int,
        d_model: int,
        d_ff: int,
        rules: ShardingRules | None = None,
        activation: Activation = jax.nn.gelu,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        e, d, f = num_experts, d_model, d_ff
        self.w_in = expert_param(normal(rngs, (e, d, f), d), rules, "embed", "expert_mlp")
        self.w_out = expert_param(normal(rngs, (e, f, d), f), rules, "expert_mlp", "embed")
        self.activation, self.dtype = activation, jnp.dtype(dtype)

    def padded(self, rows: jax.Array) -> jax.Array:
        w_in, w_out = self.w_in[...].astype(self.dtype), self.w_out[...].astype(self.dtype)
        h = self.activation(jnp.einsum("esd,edf->esf", rows.astype(self.dtype), w_in))
        return jnp.einsum("esf,efd->esd", h, w_out)

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        w_in, w_out = self.w_in[...].astype(self.dtype), self.w_out[...].astype(self.dtype)
        h = self.activation(jax.lax.ragged_dot(rows.astype(self.dtype), w_in, group_sizes))
        return jax.lax.ragged_dot(h, w_out, group_sizes)


class FunctionExperts(Experts):
    """Experts from a plain function of one expert's weights and its rows.

    ``fn(weights, rows)`` computes one expert: ``weights`` maps each name to that
    expert's slice of the stacked parameter, ``rows`` is ``[S, d]``; it is vmapped over
    the local experts. Padded layout only (the MoE layer then keeps a dropless exchange
    on padded buffers): write an :class:`Experts` subclass with :meth:`Experts.grouped`
    for the ragged one.

    Args:
        fn: ``fn(weights: dict[str, Array], rows [S, d]) -> [S, d]``, one expert.
        weights: name → ``[E, ...]`` stacked weights: an ``nnx.Param`` with expert
            sharding metadata (:func:`expert_param`, which can mark an FSDP-sharded
            ``"embed"`` dimension), or an array (split over the expert axes only).
        rules: the sharding rules for array weights (``None``: experts over ``node`` ×
            ``device``).

    Raises:
        ValueError: no weights.

    Examples:
        >>> def relu_sq(w, rows):  # one expert: relu(x W_1)² W_2
        ...     return jax.nn.relu(rows @ w["w1"]) ** 2 @ w["w2"]
        >>> experts = FunctionExperts(relu_sq, {"w1": jnp.ones((2, 3, 4)),
        ...                                     "w2": jnp.ones((2, 4, 3))})
        >>> experts(ExpertBatch(jnp.ones((2, 5, 3)))).shape
        (2, 5, 3)
    """

    def __init__(
        self,
        fn: Callable[[dict[str, jax.Array], jax.Array], jax.Array],
        weights: Mapping[str, nnx.Param | jax.Array],
        *,
        rules: ShardingRules | None = None,
    ) -> None:
        if not weights:
            raise ValueError("FunctionExperts: weights must name at least one [E, ...] weight")
        self.fn = fn
        self.weights = nnx.data({
            name: w if isinstance(w, nnx.Param)
            else expert_param(jnp.asarray(w), rules, *(None,) * (jnp.ndim(w) - 1))
            for name, w in weights.items()
        })

    def padded(self, rows: jax.Array) -> jax.Array:
        weights = {name: w[...] for name, w in self.weights.items()}
        return jax.vmap(self.fn)(weights, rows)
