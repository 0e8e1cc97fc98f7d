"""GPipe schedule over a pipeline mesh axis, inside ``jax.shard_map``.

Stage ``s`` of ``S`` holds consecutive layers; the local batch is cut into ``M``
microbatches. At tick ``i`` (``0 ≤ i < M + S − 1``) stage ``s`` works on microbatch
``i − s``: stage 0 takes it from the input, every other stage from what its predecessor
sent at the previous tick through ``jax.lax.ppermute`` along the pipeline axis (the pairs
``(s, s + 1)``, a subset of :meth:`meshkit.strategy.ranks.Strategy.neighbors`). In SPMD every
stage computes at every tick; the ``S − 1`` ticks outside ``[s, s + M)`` are the bubble,
and whatever a stage computes there is masked out. The backward pass is autodiff: the
transposed permutes carry gradients back from stage ``s + 1`` to ``s``.

The loop is a ``jax.lax.scan`` over ticks (one copy of a stage in the program), so
compile time and program size do not grow with ``M``. Tick 0 runs before the loop: it
fixes the shapes of the values carried from tick to tick, and the mesh axes each one
varies over.

:func:`pipeline` is the same schedule for a user's own model written in ``jax.jit``
style: it takes stacked layers (an NNX module over a leading ``layers`` dimension, or a
function and a pytree of stacked arrays) and a batch of activations, and makes only the
pipeline axis manual, so the layers' own data, fsdp and tensor parallelism (e.g.
:class:`meshkit.sharding.linear.ColumnParallelLinear`) work unchanged inside a stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshkit.choices import PIPELINE_SCHEDULES
from meshkit.sharding.linear import logical_spec

__all__ = ["bubble_fraction", "gpipe", "pipeline"]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The GPipe bubble: the share of ticks a stage idles, ``(S − 1)/(M + S − 1)``.

    Args:
        stages: pipeline stages ``S`` (>= 1).
        microbatches: microbatches per step ``M`` (>= 1).

    Returns:
        The fraction, 0 for one stage.

    Raises:
        ValueError: ``stages`` or ``microbatches`` below 1.

    Example:
        >>> bubble_fraction(2, 4)
        0.2
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def gpipe(
    stage: Callable[[jax.Array], tuple[jax.Array, Any]],
    microbatches: jax.Array,
    axis: str | None,
) -> tuple[jax.Array, Any]:
    """Run ``stage`` over microbatches in a GPipe schedule (call inside shard_map).

    Args:
        stage: this device's stage: ``activations -> (activations, stats)``, the same
            shape in and out; ``stats`` is a pytree of arrays to be summed over
            microbatches.
        microbatches: ``[M, ...]`` inputs of the first stage (other stages ignore them).
        axis: the pipeline mesh axis, or ``None`` for one stage.

    Returns:
        ``(outputs [M, ...], stats)``: the last stage's outputs per microbatch (other
        stages hold intermediate values), and this stage's ``stats`` summed over the
        microbatches it really processed (bubble ticks contribute 0).

    Example::

        # inside jax.shard_map over a mesh with a "pp" axis of 2:
        out, stats = gpipe(lambda h: (h * 2, {}), x.reshape(4, -1, d), "pp")
    """
    m = microbatches.shape[0]
    index, stages = _stage_index(axis)
    forward = [(s, s + 1) for s in range(stages - 1)]

    def tick(received: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        first = _take(microbatches, jnp.minimum(t, m - 1))
        out, stats = stage(jnp.where(index == 0, first, received))
        valid = (t - index >= 0) & (t - index < m)
        stats = _masked(stats, valid)
        sent = jax.lax.ppermute(out, axis, forward) if forward else out
        return sent, out, stats

    # Tick 0 outside the loop: its results fix the carry's shapes and the mesh axes each
    # value varies over, which the loop's carry must keep from tick to tick.
    sent, first_out, total = tick(jnp.zeros_like(microbatches[0]), jnp.int32(0))

    def body(carry: tuple[jax.Array, Any], t: jax.Array) -> tuple[tuple[jax.Array, Any], jax.Array]:
        received, total = carry
        sent, out, stats = tick(received, t)
        return (sent, jax.tree.map(jnp.add, total, stats)), out

    ticks = m + stages - 1
    (_, total), outs = jax.lax.scan(body, (sent, total), jnp.arange(1, ticks, dtype=jnp.int32))
    outs = jnp.concatenate([first_out[None], outs])
    return outs[stages - 1:], total


def _stage_index(axis: str | None) -> tuple[jax.Array, int]:
    """This device's stage and the number of stages along ``axis`` (inside shard_map)."""
    if axis is None:
        return jnp.int32(0), 1
    return jax.lax.axis_index(axis), jax.lax.axis_size(axis)


def _take(stacked: jax.Array, i: jax.Array) -> jax.Array:
    """``stacked[i]`` for a traced index ``i``."""
    return jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False)


def _masked(tree: Any, keep: jax.Array) -> Any:
    """``tree`` where ``keep``, zeros elsewhere (what a bubble tick contributes)."""
    return jax.tree.map(lambda v: jnp.where(keep, v, jnp.zeros_like(v)), tree)


def _pipeline_axis(axis: str | None) -> str | None:
    """The pipeline axis: the one given, or the mesh axis of the logical name ``layers``."""
    if axis is not None:
        return axis
    entry = logical_spec(("layers",), what="pipeline")[0]
    if entry is None:
        return None
    if not isinstance(entry, str):
        raise ValueError(f"pipeline: the logical name 'layers' maps to several mesh axes "
                         f"{entry}; a pipeline runs over one")
    return entry


def pipeline(
    layers: Any,
    x: jax.Array,
    *,
    microbatches: int,
    apply: Callable[[Any, jax.Array], jax.Array] | None = None,
    schedule: str = "gpipe",
    axis: str | None = None,
) -> jax.Array:
    """Run stacked layers over ``x`` as a pipeline over the mesh's pipeline axis.

    Stage ``s`` of ``S`` holds layers ``[s·L/S, (s+1)·L/S)`` (the stacked dimension is
    split over the pipeline axis by the logical name ``layers``) and runs them in order
    on each microbatch; the result equals applying all ``L`` layers in order.

    Args:
        layers: an NNX module whose every variable has a leading layer dimension (made
            with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})``),
            or a pytree of arrays stacked the same way.
        x: ``[B, ...]`` activations; ``B`` divisible by ``microbatches`` and the result
            by the batch devices.
        microbatches: ``M``, microbatches per call. Microbatch ``m`` takes rows
            ``m, m + M, ...``, so each device's rows split without moving.
        apply: ``(one_layer, h) -> h``; default ``one_layer(h)`` for a module. Needed
            for a pytree of arrays.
        schedule: one of :data:`meshkit.choices.PIPELINE_SCHEDULES`.
        axis: the pipeline mesh axis (default: the axis of the logical name ``layers``
            in the rules in effect; none: the layers run in order on one stage).

    Returns:
        ``[B, ...]``: the last layer's outputs, on every stage.

    Raises:
        ValueError: an unknown schedule, ``microbatches`` below 1 or not dividing ``B``,
            layers that do not split over the stages, or a pytree without ``apply``.

    Example::

        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
            h = pipeline(model.blocks, model.embed(tokens), microbatches=4)
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; valid: "
                         f"{', '.join(PIPELINE_SCHEDULES)}")
    if schedule != "gpipe":
        raise NotImplementedError(f"pipeline: schedule {schedule!r} is not built yet")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be an integer >= 1, got {microbatches!r}")
    if x.shape[0] % microbatches:
        raise ValueError(f"pipeline: batch {x.shape[0]} is not divisible by "
                         f"{microbatches} microbatches")
    one: Callable[[Any, jax.Array], jax.Array]
    if isinstance(layers, nnx.Module):
        graphdef, state = nnx.split(layers)
        run = apply or (lambda layer, h: layer(h))

        def one(params: Any, h: jax.Array) -> jax.Array:
            return run(nnx.merge(graphdef, params), h)
    elif apply is None:
        raise ValueError("pipeline: stacked arrays need apply=(layer_params, h) -> h")
    else:
        state, one = layers, apply
    leaves = jax.tree.leaves(state)
    if not leaves:
        raise ValueError("pipeline: the layers hold no arrays")
    num_layers = leaves[0].shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    axis = None if mesh.empty else _pipeline_axis(axis)
    stages = 1 if axis is None else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]
    if num_layers % stages:
        raise ValueError(f"pipeline: {num_layers} layers do not split over {stages} stages "
                         f"(mesh axis {axis!r})")
    m = microbatches
    # Strided microbatches: row i of microbatch j is row i·M + j, so a batch split over
    # data axes splits each microbatch the same way, with no data movement.
    chunks = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)

    def body(state: Any, chunks: jax.Array) -> jax.Array:
        local = jax.tree.leaves(state)[0].shape[0]  # this stage's layers

        def run_stage(h: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
            for i in range(local):
                h = one(jax.tree.map(lambda a, i=i: a[i], state), h)
            return h, {}

        out, _ = gpipe(run_stage, chunks, axis)
        if axis is None:
            return out
        # Only the last stage holds real outputs; the sum over stages hands them to all.
        last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
        return jax.lax.psum(jnp.where(last, out, jnp.zeros_like(out)), axis)

    if axis is None:
        out = body(state, chunks)
    else:
        specs = jax.tree.map(lambda a: P(axis), state)
        # check_vma off: a stage's own shard_maps (the tensor/fsdp blocks of
        # meshkit.sharding.linear) nest inside this one, and JAX 0.10 cannot transpose a
        # nested shard_map whose residuals vary over this axis. The parity tests against
        # one device (tests/test_your_model.py) hold the gradients to account.
        out = jax.shard_map(body, in_specs=(specs, P()), out_specs=P(),
                            axis_names={axis}, check_vma=False)(state, chunks)
    return jnp.swapaxes(out, 0, 1).reshape(x.shape)
