"""Pipeline schedules (GPipe, 1F1B, interleaved) over a pipeline mesh axis, in shard_map.

Stage ``s`` of ``S`` holds consecutive layers; the local batch is cut into ``M``
microbatches. At tick ``i`` (``0 ≤ i < M + S − 1``) stage ``s`` works on microbatch
``i − s``: stage 0 takes it from the input, every other stage from what its predecessor
sent at the previous tick through ``jax.lax.ppermute`` along the pipeline axis (the pairs
``(s, s + 1)``, a subset of :meth:`meshkit.strategy.ranks.Strategy.neighbors`). In SPMD every
stage computes at every tick; the ``S − 1`` ticks outside ``[s, s + M)`` are the bubble,
and whatever a stage computes there is masked out. The backward pass is autodiff: the
transposed permutes carry gradients back from stage ``s + 1`` to ``s``.

:func:`one_f_one_b` is the 1F1B schedule of a training loss: each tick runs one forward
and one backward microbatch per stage, so a stage keeps ``O(S)`` microbatches' inputs
instead of ``O(M)`` activations.

The loop is a ``jax.lax.scan`` over ticks (one copy of a stage in the program), so
compile time and program size do not grow with ``M``. Tick 0 runs before the loop: it
fixes the shapes of the values carried from tick to tick, and the mesh axes each one
varies over.

:func:`pipeline` runs these schedules for a user's own model written in ``jax.jit``
style: it takes stacked layers (an NNX module over a leading ``layers`` dimension, or a
function and a pytree of stacked arrays) in their natural order and a batch of
activations, and makes only the pipeline axis manual, so the layers' own data, fsdp and
tensor parallelism (e.g. :class:`meshkit.sharding.linear.ColumnParallelLinear`) work
unchanged inside a stage (``gpipe``, ``interleaved``). :func:`pipeline_loss` adds the
user's loss, the mean over microbatches, which 1F1B needs inside the schedule (every
schedule).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshkit.choices import PIPELINE_SCHEDULES
from meshkit.sharding.linear import logical_spec

__all__ = ["bubble_fraction", "check_counts", "gpipe", "interleaved", "layer_slots", "one_f_one_b",
           "pipeline", "pipeline_loss"]


def bubble_fraction(stages: int, microbatches: int, *, virtual_stages: int = 1) -> float:
    """The bubble: the share of ticks a stage idles, ``(S − 1)/(v·M + S − 1)``.

    GPipe's with ``v = 1``; :func:`interleaved`'s ticks each run ``1/v`` of a stage.

    Args:
        stages: pipeline stages ``S`` (>= 1).
        microbatches: microbatches per step ``M`` (>= 1).
        virtual_stages: chunks per stage ``v`` (>= 1).

    Returns:
        The fraction, 0 for one stage.

    Raises:
        ValueError: ``stages``, ``microbatches`` or ``virtual_stages`` below 1.

    Examples:
        >>> bubble_fraction(2, 4), bubble_fraction(2, 8, virtual_stages=2)
        (0.2, 0.058823529411764705)
    """
    if stages < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"stages, microbatches and virtual_stages must be >= 1, got {stages}, "
                         f"{microbatches}, {virtual_stages}")
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


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


def interleaved(
    stage: Callable[[jax.Array, jax.Array], tuple[jax.Array, Any]],
    microbatches: jax.Array,
    axis: str | None,
    *,
    virtual_stages: int,
) -> tuple[jax.Array, Any]:
    """Run ``stage`` over microbatches in a circular interleaved schedule (in shard_map).

    Each of the ``S`` stages holds ``v = virtual_stages`` chunks of layers; virtual
    stage ``c·S + s`` (chunk ``c`` of stage ``s``) comes ``c·S + s``-th in the model. At
    tick ``t`` of ``v·M + S − 1``, stage ``s`` runs chunk ``c = (t − s) // M`` on
    microbatch ``(t − s) mod M``: a microbatch passes stages ``0..S−1`` for chunk 0,
    wraps from the last stage back to stage 0 (a ``ppermute`` ring) for chunk 1, and so
    on (MaxText's circular pipeline). Stage 0 keeps what comes round the ring in a
    buffer of ``M`` microbatches until its turn, which needs ``M ≥ S``. A tick runs
    ``1/v`` of a stage's layers, so the bubble is ``(S − 1)/(v·M + S − 1)``. The
    backward pass is autodiff, as in :func:`gpipe`.

    Args:
        stage: ``(chunk, activations) -> (activations, stats)``: this device's chunk
            ``chunk`` (a traced int32 in ``[0, v)``), the same shape in and out;
            ``stats`` a pytree of arrays summed over microbatches and chunks.
        microbatches: ``[M, ...]`` inputs of the first stage (other stages ignore them).
        axis: the pipeline mesh axis, or ``None`` for one stage.
        virtual_stages: ``v``, chunks per stage (>= 1).

    Returns:
        ``(outputs [M, ...], stats)`` as in :func:`gpipe`: the last stage's outputs of
        the last chunk per microbatch, and this stage's ``stats`` summed over the
        (chunk, microbatch) pairs it really processed.

    Raises:
        ValueError: ``virtual_stages`` below 1, or fewer microbatches than stages.

    Example::

        # inside jax.shard_map over a mesh with a "pp" axis of 2, w: [2 chunks, d, d]:
        out, _ = interleaved(lambda c, h: (jnp.tanh(h @ w[c]), {}), xs, "pp",
                             virtual_stages=2)
    """
    m = microbatches.shape[0]
    index, stages = _stage_index(axis)
    if virtual_stages < 1:
        raise ValueError(f"interleaved: virtual_stages must be >= 1, got {virtual_stages}")
    if m < stages:
        raise ValueError(f"parallel.microbatches: the interleaved schedule needs at least as "
                         f"many microbatches as stages, got {m} for {stages} stages")
    ring = [(s, (s + 1) % stages) for s in range(stages)]
    ticks = virtual_stages * m + stages - 1

    def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array
             ) -> tuple[tuple[jax.Array, jax.Array], jax.Array, Any]:
        received, buffer = carry
        # What stage 0 receives now left the last stage last tick: microbatch (t − S) mod M
        # of some chunk; it waits in the buffer until that microbatch's next chunk.
        back = t - stages
        keep = (index == 0) & (back >= 0)
        slot = jnp.mod(back, m)
        buffer = jax.lax.dynamic_update_index_in_dim(
            buffer, jnp.where(keep, received, _take(buffer, slot)), slot, 0)
        u = t - index
        chunk, mb = jnp.clip(u // m, 0, virtual_stages - 1), jnp.mod(u, m)
        first = jnp.where(chunk == 0, _take(microbatches, mb), _take(buffer, mb))
        out, stats = stage(chunk.astype(jnp.int32), jnp.where(index == 0, first, received))
        stats = _masked(stats, (u >= 0) & (u < virtual_stages * m))
        sent = jax.lax.ppermute(out, axis, ring) if stages > 1 else out
        return (sent, buffer), out, stats

    # Tick 0 outside the loop, as in gpipe: it fixes the carry's shapes and axes.
    zero = jnp.zeros_like(microbatches[0])
    carry, first_out, total = tick((zero, jnp.zeros_like(microbatches)), jnp.int32(0))

    def body(c: tuple[Any, Any], t: jax.Array) -> tuple[tuple[Any, Any], jax.Array]:
        carry, total = c
        carry, out, stats = tick(carry, t)
        return (carry, jax.tree.map(jnp.add, total, stats)), out

    (_, total), outs = jax.lax.scan(body, (carry, total), jnp.arange(1, ticks, dtype=jnp.int32))
    outs = jnp.concatenate([first_out[None], outs])
    return outs[ticks - m:], total


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


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A user's stacked layers, checked, with the microbatches of one call.

    ``state`` is the user's: each leaf ``[L, ...]`` in the layers' natural order, split
    over the pipeline axis into consecutive blocks (as the placement holds it).
    """

    state: Any
    one: Callable[[Any, jax.Array], jax.Array]  # (one layer's params, h) -> h
    axis: str | None
    stages: int
    virtual_stages: int
    microbatches: jax.Array  # [M, B/M, ...], strided

    def run(self, state: Any, chunks: jax.Array) -> jax.Array:
        """This stage's layers over the microbatches under GPipe or the interleaved
        schedule, inside the shard_map (or with no pipeline axis): the last stage's
        outputs ``[M, ...]``, on every stage."""
        v = self.virtual_stages
        local = state if v == 1 or self.axis is None else _schedule_order(
            state, self.axis, stages=self.stages, virtual_stages=v)
        k = jax.tree.leaves(local)[0].shape[0] // v
        if v == 1:
            out, _ = gpipe(lambda h: (self.layers(local, h), {}), chunks, self.axis)
        else:
            # A chunk's weights are sliced at each tick (the chunk index is the tick's),
            # so autodiff would keep them once per tick (memory growing with v·M + S − 1);
            # checkpointed, only the matmul outputs are kept and the slice is redone in
            # the backward pass (as meshkit's Transformer does).
            @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
            def chunk(state: Any, c: jax.Array, h: jax.Array) -> tuple[jax.Array, Any]:
                mine = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * k, k), state)
                return self.layers(mine, h), {}

            out, _ = interleaved(lambda c, h: chunk(local, c, h), chunks, self.axis,
                                 virtual_stages=v)
        if self.axis is None:
            return out
        # Only the last stage holds real outputs; the sum over stages hands them to all.
        last = jax.lax.axis_index(self.axis) == self.stages - 1
        return jax.lax.psum(jnp.where(last, out, jnp.zeros_like(out)), self.axis)

    def layers(self, state: Any, h: jax.Array) -> jax.Array:
        """``h`` through the stacked layers of ``state`` (``[n, ...]`` leaves), in order."""
        for i in range(jax.tree.leaves(state)[0].shape[0]):
            h = self.one(jax.tree.map(lambda a, i=i: a[i], state), h)
        return h

    def shard_map(self, body: Callable[..., jax.Array], *replicated: Any) -> jax.Array:
        """``body(state, *replicated)`` per stage: the layers split over the pipeline
        axis, the ``replicated`` pytrees whole on every stage, the result the same on all
        (called directly with no pipeline axis)."""
        if self.axis is None:
            return body(self.state, *replicated)
        specs = jax.tree.map(lambda a: P(self.axis), self.state)
        rest = tuple(jax.tree.map(lambda a: P(), r) for r in replicated)
        # check_vma off: a stage's own shard_maps (the tensor/fsdp blocks of
        # meshkit.sharding.linear) nest inside this one, and JAX 0.10 cannot transpose a
        # nested shard_map whose residuals vary over this axis. Off, the sums over stages
        # are written out here; the parity tests against one device
        # (tests/test_your_model.py, tests/model/test_user_schedules.py) hold the
        # gradients to account.
        return jax.shard_map(body, in_specs=(specs, *rest), out_specs=P(),
                             axis_names={self.axis}, check_vma=False)(self.state, *replicated)


def check_counts(what: str, schedule: str, **counts: int) -> None:
    """Check a schedule's counts: each an integer >= 1 (in the order given), and
    ``virtual_stages`` other than 1 only with the interleaved schedule.

    Args:
        what: the caller, named in the error.
        schedule: the schedule's name.
        **counts: name -> value (``microbatches``, ``virtual_stages``, ``stages``, ...).

    Raises:
        ValueError: the first bad count, named.

    Examples:
        >>> check_counts("pipeline", "gpipe", microbatches=4, virtual_stages=1)
    """
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}: {name} must be an integer >= 1, got {value!r}")
    virtual_stages = counts.get("virtual_stages", 1)
    if virtual_stages != 1 and schedule != "interleaved":
        raise ValueError(f"{what}: virtual_stages={virtual_stages} needs schedule "
                         f"'interleaved', got {schedule!r}")


def layer_slots(
    num_layers: int,
    *,
    schedule: str = "gpipe",
    stages: int = 1,
    virtual_stages: int = 1,
    stage_layers: tuple[int, ...] | list[int] | None = None,
) -> tuple[list[int], int]:
    """Where meshkit's transformer stores each layer on its stacked ``layers`` dimension.

    ``interleaved``: layer ``l`` is layer ``j`` of virtual stage ``c·S + s`` (chunks of
    ``k = L/(S·v)`` layers), stored at slot ``s·v·k + c·k + j``, stage ``s``'s chunk
    ``c``. ``stage_layers``: stage ``s``'s layers in the first ``stage_layers[s]`` of
    its ``max(stage_layers)`` slots. Otherwise layer ``l`` at slot ``l``.

    Args:
        num_layers: ``L``.
        schedule: ``parallel.schedule``.
        stages: ``S``, the pipeline axis's size.
        virtual_stages: ``v`` (``parallel.virtual_stages``).
        stage_layers: ``parallel.stage_layers``, or ``None`` for an even split.

    Returns:
        ``(slots, size)``: the slot of each layer in layer order, and the size of the
        stacked dimension (larger than ``L`` with uneven stages: the unused slots).

    Examples:
        >>> layer_slots(4, schedule="interleaved", stages=2, virtual_stages=2)
        ([0, 2, 1, 3], 4)
        >>> layer_slots(3, stage_layers=[2, 1])
        ([0, 1, 2], 4)
    """
    if schedule == "interleaved":
        s, v = stages, virtual_stages
        k = num_layers // (s * v)
        return [((i // k) % s) * v * k + ((i // k) // s) * k + i % k
                for i in range(num_layers)], num_layers
    if stage_layers is None:
        return list(range(num_layers)), num_layers
    width = max(stage_layers)
    return ([s * width + j for s, n in enumerate(stage_layers) for j in range(n)],
            len(stage_layers) * width)


def _stacked(what: str, layers: Any, x: jax.Array, *, microbatches: int,
             apply: Callable[[Any, jax.Array], jax.Array] | None, schedule: str,
             virtual_stages: int, axis: str | None) -> _Stacked:
    """Check the arguments of :func:`pipeline` or :func:`pipeline_loss` (``what``) and
    lay the layers and the microbatches out for the schedule."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"{what}: unknown schedule {schedule!r}; valid: "
                         f"{', '.join(PIPELINE_SCHEDULES)}")
    check_counts(what, schedule, microbatches=microbatches, virtual_stages=virtual_stages)
    if x.shape[0] % microbatches:
        raise ValueError(f"{what}: microbatches={microbatches} does not divide the batch "
                         f"{x.shape[0]}")
    one: Callable[[Any, jax.Array], jax.Array]
    if isinstance(layers, nnx.Module):
        graphdef, state = nnx.split(layers)
        run = apply or (lambda layer, h: layer(h))

        def one(params: Any, h: jax.Array) -> jax.Array:
            return run(nnx.merge(graphdef, params), h)
    elif apply is None:
        raise ValueError(f"{what}: stacked arrays need apply=(layer_params, h) -> h")
    else:
        state, one = layers, apply
    leaves = jax.tree.leaves(state)
    if not leaves:
        raise ValueError(f"{what}: the layers hold no arrays")
    num_layers = leaves[0].shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    axis = None if mesh.empty else _pipeline_axis(axis)
    stages = 1 if axis is None else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]
    if num_layers % stages:
        raise ValueError(f"{what}: {num_layers} layers do not split over {stages} stages "
                         f"(mesh axis {axis!r})")
    if (num_layers // stages) % virtual_stages:
        raise ValueError(f"{what}: virtual_stages={virtual_stages} does not divide the "
                         f"{num_layers // stages} layers per stage ({num_layers} layers, "
                         f"{stages} stages)")
    if schedule == "interleaved" and microbatches < stages:
        raise ValueError(f"{what}: microbatches={microbatches} is fewer than the {stages} "
                         f"stages the interleaved schedule needs")
    # Strided microbatches: row i of microbatch j is row i·M + j, so a batch split over
    # data axes splits each microbatch the same way, with no data movement.
    return _Stacked(state=state, one=one, axis=axis, stages=stages, virtual_stages=virtual_stages,
                    microbatches=_strided(x, microbatches))


def _schedule_order(local: Any, axis: str, *, stages: int, virtual_stages: int) -> Any:
    """This stage's chunks of the interleaved schedule, from its block of the user's
    layers (inside shard_map over ``axis``).

    Why here: the user keeps the layers in their natural order, so the placement gives
    stage ``s`` virtual stages ``s·v ... s·v + v − 1`` (``k`` layers each), while the
    circular schedule runs virtual stage ``x`` on stage ``x mod S`` as its chunk
    ``x // S``. Each chunk that changes stage moves once by ``jax.lax.ppermute`` (a
    round per chunk a stage sends at one shift ``δ``, to stage ``s + δ``), so a stage
    holds its own layers at most twice and the traffic is the moved chunks; letting
    XLA redistribute the stacked arrays all-gathers every stage's layers on each device.
    Autodiff sends the gradients back the same way.

    Returns:
        ``local``'s leaves ``[v·k, ...]`` with chunk ``c`` (rows ``c·k ...``) the layers
        of virtual stage ``c·S + s``.
    """
    s_, v = stages, virtual_stages
    index = jax.lax.axis_index(axis)
    chunks = jax.tree.map(lambda a: a.reshape(v, -1, *a.shape[1:]), local)
    out = jax.tree.map(jnp.zeros_like, chunks)
    # moves[shift][source stage]: (its chunk, the receiver's chunk) of each virtual stage.
    moves: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for x in range(s_ * v):
        source, dest = x // v, x % s_
        moves.setdefault((dest - source) % s_, {}).setdefault(source, []).append(
            (x % v, x // s_))
    for shift, by_source in sorted(moves.items()):
        for r in range(max(len(m) for m in by_source.values())):
            send, receive = np.zeros(s_, np.int32), np.full(s_, -1, np.int32)
            pairs = []
            for source, m in by_source.items():
                if r < len(m):
                    send[source], receive[(source + shift) % s_] = m[r]
                    pairs.append((source, (source + shift) % s_))
            payload = jax.tree.map(lambda a, send=send: _take(a, jnp.asarray(send)[index]),
                                   chunks)
            if shift:
                payload = jax.lax.ppermute(payload, axis, pairs)
            slot = jnp.asarray(receive)[index]
            at = jnp.maximum(slot, 0)
            out = jax.tree.map(lambda o, p, at=at, slot=slot: jax.lax.dynamic_update_index_in_dim(
                o, jnp.where(slot >= 0, p, _take(o, at)), at, 0), out, payload)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)


def _strided(x: jax.Array, m: int) -> jax.Array:
    """``[B, ...]`` as ``[M, B/M, ...]``, microbatch ``j`` the rows ``j, j + M, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def pipeline(
    layers: Any,
    x: jax.Array,
    *,
    microbatches: int,
    apply: Callable[[Any, jax.Array], jax.Array] | None = None,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    axis: str | None = None,
) -> jax.Array:
    """Run stacked layers over ``x`` as a pipeline over the mesh's pipeline axis.

    The result equals applying all ``L`` layers in order. Under ``gpipe`` stage ``s`` of
    ``S`` holds layers ``[s·L/S, (s+1)·L/S)`` (the stacked dimension is split over the
    pipeline axis by the logical name ``layers``). Under ``interleaved`` (MaxText's
    circular schedule, :func:`interleaved`) stage ``s`` runs the ``v = virtual_stages``
    chunks ``c·S + s`` of ``k = L/(S·v)`` consecutive layers, layers ``(c·S + s)·k ...``.
    The user keeps the layers in their natural order (a checkpoint and every other
    layout are unchanged); since the placement splits the ``layers`` dimension into
    consecutive blocks, each call first moves every chunk that belongs to another stage
    there by ``jax.lax.ppermute`` over the pipeline axis (about ``(S − 1)/S`` of a
    stage's weights, and their gradients back; a stage holds its own weights at most
    twice, never the other stages'). meshkit's Transformer stores its layers in the
    schedule's order instead and moves none. For ``1f1b`` the loss must run inside the
    schedule: see :func:`pipeline_loss`.

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
        schedule: ``gpipe`` or ``interleaved`` (of :data:`meshkit.choices.PIPELINE_SCHEDULES`).
        virtual_stages: ``v``, chunks per stage under ``interleaved``; divides ``L/S``.
        axis: the pipeline mesh axis (default: the axis of the logical name ``layers``
            in the rules in effect; none: the layers run in order on one stage).

    Returns:
        ``[B, ...]``: the last layer's outputs, on every stage.

    Raises:
        ValueError: an unknown schedule, ``microbatches`` below 1 or not dividing ``B``,
            layers that do not split over the stages, ``virtual_stages`` below 1, not
            dividing ``L/S`` or without ``interleaved``, fewer microbatches than stages
            under ``interleaved``, or a pytree without ``apply``.
        NotImplementedError: ``schedule="1f1b"`` (use :func:`pipeline_loss`).

    Example::

        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
            h = pipeline(model.blocks, model.embed(tokens), microbatches=4)
            h = pipeline(model.blocks, model.embed(tokens), microbatches=4,
                         schedule="interleaved", virtual_stages=2)
    """
    stacked = _stacked("pipeline", layers, x, microbatches=microbatches, apply=apply,
                       schedule=schedule, virtual_stages=virtual_stages, axis=axis)
    if schedule == "1f1b":
        raise NotImplementedError(
            "pipeline: schedule '1f1b' needs the loss inside the schedule, and pipeline() "
            "returns activations; call meshkit.pipeline_loss with your loss")
    out = stacked.shard_map(stacked.run, stacked.microbatches)
    return jnp.swapaxes(out, 0, 1).reshape(x.shape)


def pipeline_loss(
    layers: Any,
    x: jax.Array,
    targets: Any,
    *,
    loss: Callable[..., Any],
    microbatches: int,
    head: Any = None,
    apply: Callable[[Any, jax.Array], jax.Array] | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    axis: str | None = None,
    has_aux: bool = False,
) -> Any:
    """The mean over microbatches of a loss of stacked layers' outputs, pipelined.

    ``mean_m loss(head, layers(x_m), y_m)`` over the ``M`` microbatches (``x_m`` the rows
    ``m, m + M, ...``; with equal microbatches and a loss that is a mean over rows, the
    loss of the whole batch). Differentiate it (``jax.grad``, ``nnx.grad``) with respect
    to the layers, ``head`` and ``x``. Under ``1f1b`` the loss runs inside the schedule
    on the last stage (:func:`one_f_one_b`: each stage's backward pass by ``jax.vjp``,
    the gradients sent back a stage per tick by ``jax.lax.ppermute``), so a stage keeps
    ``O(S)`` microbatches' inputs rather than ``O(M)`` activations; the gradients are
    computed in the forward pass. Under ``gpipe`` and ``interleaved`` it is
    :func:`pipeline`'s outputs, then the loss, and autodiff gives the backward pass.
    The layers are in their natural order under every schedule (as in :func:`pipeline`).

    Args:
        layers: stacked layers, as for :func:`pipeline`.
        x: ``[B, ...]`` inputs of the first layer.
        targets: a pytree of ``[B, ...]`` arrays, cut into microbatches like ``x``; not
            differentiated.
        loss: ``(h, y) -> scalar`` for one microbatch's last-layer outputs ``h`` and
            targets ``y``, or ``(head, h, y) -> scalar`` when ``head`` is given.
        microbatches: ``M``, microbatches per call (>= the stages under ``interleaved``).
        head: what ``loss`` uses besides the activations (e.g. a final norm and an output
            projection): an NNX module or a pytree of arrays, replicated over the
            pipeline axis; its gradient flows. ``loss`` gets it as its first argument.
        apply: ``(one_layer, h) -> h``, as for :func:`pipeline`.
        schedule: one of :data:`meshkit.choices.PIPELINE_SCHEDULES`.
        virtual_stages: ``v``, chunks per stage under ``interleaved``; divides ``L/S``.
        axis: the pipeline mesh axis, as for :func:`pipeline`.
        has_aux: ``loss`` returns ``(scalar, metrics)``, ``metrics`` a pytree of arrays
            not differentiated (as ``jax.value_and_grad``'s ``has_aux``).

    Returns:
        The scalar mean loss, the same on every device; with ``has_aux``, ``(loss,
        metrics)``: each floating-point metric the mean over microbatches, each integer
        one (a count) the sum.

    Raises:
        ValueError: an unknown schedule, or any bad argument :func:`pipeline` refuses
            (``microbatches``, ``virtual_stages``, layers that do not split), or
            ``targets`` whose rows differ from ``x``'s.

    Example::

        def xent(head, h, y):
            logits = head(h)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
            grads = nnx.grad(lambda blocks, head: meshkit.pipeline_loss(
                blocks, x, labels, loss=xent, head=head, microbatches=8))(blocks, head)
    """
    stacked = _stacked("pipeline_loss", layers, x, microbatches=microbatches, apply=apply,
                       schedule=schedule, virtual_stages=virtual_stages, axis=axis)
    for y in jax.tree.leaves(targets):
        if y.shape[:1] != x.shape[:1]:
            raise ValueError(f"pipeline_loss: targets have {y.shape[0] if y.ndim else 0} "
                             f"rows, x has {x.shape[0]}")
    m, ys = microbatches, jax.tree.map(lambda y: _strided(y, microbatches), targets)
    call: Callable[[Any, jax.Array, Any], Any]
    if head is None:
        head_state: Any = ()

        def call(_: Any, h: jax.Array, y: Any) -> Any:
            return loss(h, y)
    elif isinstance(head, nnx.Module):
        head_def, head_state = nnx.split(head)

        def call(params: Any, h: jax.Array, y: Any) -> Any:
            return loss(nnx.merge(head_def, params), h, y)
    else:
        head_state, call = head, loss

    if schedule != "1f1b":
        outs = stacked.shard_map(stacked.run, stacked.microbatches)
        # One microbatch at a time (a loop, not unrolled): each term is the loss the
        # 1F1B schedule takes of that microbatch.
        per = jax.lax.map(lambda hy: call(head_state, *hy), (outs, ys))
        if not has_aux:
            return jnp.mean(per)
        values, metrics = per
        return jnp.mean(values), jax.tree.map(
            lambda v: jnp.sum(v, axis=0) if _counts(v) else jnp.mean(v, axis=0), metrics)

    axis_ = stacked.axis

    def body(state: Any, lp: Any, xs: jax.Array, ys: Any) -> jax.Array:
        last = (jnp.bool_(True) if axis_ is None
                else jax.lax.axis_index(axis_) == stacked.stages - 1)

        def microbatch_loss(lp: Any, h: jax.Array, y: Any) -> Any:
            # On the last stage only: the other stages' outputs are not the model's.
            if not has_aux:
                return jnp.where(last, call(lp, h, y) / m, 0.0)
            value, metrics = call(lp, h, y)
            # Summed over the microbatches by the schedule: a count as it is, the rest
            # over M, for their mean.
            return jnp.where(last, value / m, 0.0), jax.tree.map(
                lambda v: jnp.where(last, v if _counts(v) else v / m, jnp.zeros_like(v)),
                metrics)

        objective, rest = one_f_one_b(lambda p, h: (stacked.layers(p, h), {}), state, xs,
                                      loss=microbatch_loss, loss_params=lp, targets=ys,
                                      axis=axis_, has_aux=has_aux)
        # With check_vma off one_f_one_b cannot see that only the last stage's loss is
        # real: the sum over stages hands it to all.
        total = functools.partial(jax.tree.map, lambda v: v if axis_ is None
                                  else jax.lax.psum(v, axis_))
        return total((objective, rest[2])) if has_aux else total(objective)

    return stacked.shard_map(body, head_state, stacked.microbatches, ys)


def _counts(v: jax.Array) -> bool:
    """Whether a metric is a count (integer), summed over microbatches, not averaged."""
    return not jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact)


def _varying(x: jax.Array) -> frozenset[str]:
    """The mesh axes ``x`` varies over inside shard_map (empty with ``check_vma=False``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _sum_like(tree: Any, like: Any) -> Any:
    """Each cotangent summed over the mesh axes it varies over and its primal does not.

    What autodiff's transpose of an implicit broadcast does: a value the same on every
    device of an axis gets the sum of the devices' contributions.
    """

    def one(ct: jax.Array, primal: jax.Array) -> jax.Array:
        extra = tuple(sorted(_varying(ct) - _varying(primal)))
        return jax.lax.psum(ct, extra) if extra else ct

    return jax.tree.map(one, tree, like)


def _total(x: jax.Array) -> jax.Array:
    """``x`` summed over every mesh axis it varies over: the same on every device."""
    axes = tuple(sorted(_varying(x)))
    return jax.lax.psum(x, axes) if axes else x


def _ones_like_where(keep: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(keep, jnp.ones_like(x), jnp.zeros_like(x))


def _no_cotangent(tree: Any) -> Any:
    """Zero cotangents (float0 for integer arrays): targets are not differentiated."""

    def zero(v: jax.Array) -> Any:
        if jnp.issubdtype(v.dtype, jnp.inexact):
            return jnp.zeros_like(v)
        return np.zeros(v.shape, dtype=jax.dtypes.float0)

    return jax.tree.map(zero, tree)


def one_f_one_b(
    stage: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    params: Any,
    microbatches: jax.Array,
    *,
    loss: Callable[[Any, jax.Array, Any], Any],
    loss_params: Any,
    targets: Any,
    axis: str | None,
    stats_loss: Callable[[Any], jax.Array] | None = None,
    has_aux: bool = False,
) -> tuple[jax.Array, tuple[Any, ...]]:
    """A training loss through a one-forward-one-backward (1F1B) pipeline (in shard_map).

    Stage ``s`` of ``S`` runs the forward pass of microbatch ``t − s`` and the backward
    pass of microbatch ``t − (2S − 2 − s)`` at every tick ``t`` of ``M + 2S − 2``: the last
    stage takes a microbatch's loss and its gradient in the tick of its forward pass, and
    each gradient then travels one stage back per tick (``jax.lax.ppermute``). A stage
    keeps its inputs of the at most ``2S − 1`` microbatches between their forward and
    backward passes, in a ring, and recomputes the rest inside its backward pass
    (``jax.vjp`` of ``stage``), so activation memory is ``O(S)`` whatever ``M``. The
    ticks are a ``jax.lax.scan``: compile time does not grow with ``M``.

    The gradients are computed in the forward pass and handed to autodiff through a
    ``jax.custom_vjp``, so ``jax.grad`` of a function of the returned loss (a multiple
    of it: the cotangent scales them) gives the same gradients as differentiating the
    GPipe schedule (:func:`gpipe`). Without differentiation only the forward ticks run.

    Args:
        stage: ``(params, activations) -> (activations, stats)``: this device's stage,
            the same shape in and out; ``stats`` a pytree summed over microbatches.
        params: this stage's parameters (a pytree of arrays).
        microbatches: ``[M, ...]`` inputs of the first stage (other stages ignore them).
        loss: ``(loss_params, activations, target) -> scalar``: one microbatch's loss,
            called on every stage with that stage's outputs; return 0 on all but the
            last stage (e.g. ``jnp.where(last, value, 0)``), or share the work out.
        loss_params: the parameters ``loss`` uses (a pytree of arrays).
        targets: a pytree of ``[M, ...]`` arrays; ``loss`` gets microbatch ``m``'s. They
            are not differentiated (their cotangent is zero).
        axis: the pipeline mesh axis, or ``None`` for one stage.
        stats_loss: ``stats -> scalar``: a microbatch's loss term from its stage
            statistics (e.g. router losses), added on every stage; none by default.
        has_aux: ``loss`` returns ``(scalar, aux)``, ``aux`` a pytree of arrays (metrics)
            summed over the microbatches like the loss and not differentiated.

    Returns:
        ``(objective, (loss_total, stats))``, with ``has_aux``
        ``(objective, (loss_total, stats, aux_total))``: ``loss_total`` the sum of
        ``loss`` over microbatches, stages and every mesh axis it varies over,
        ``objective`` that plus the ``stats_loss`` terms summed the same way (the one
        differentiable output); ``stats`` this stage's statistics summed over its
        microbatches; ``aux_total`` this stage's ``aux`` summed over the microbatches
        leaving the last stage.

    Example::

        # inside jax.shard_map over a mesh with a "pp" axis of 2 (check_vma on):
        def stage(w, h):
            return jnp.tanh(h @ w[0]), {}

        def loss(_, h, y):
            last = jax.lax.axis_index("pp") == 1
            return jnp.where(last, jnp.sum((h - y) ** 2), 0.0)

        objective, _ = one_f_one_b(stage, w, x.reshape(4, -1, d), loss=loss,
                                   loss_params=(), targets=y.reshape(4, -1, d), axis="pp")
    """
    m = microbatches.shape[0]

    def term(stats: Any) -> jax.Array:
        return jnp.float32(0) if stats_loss is None else stats_loss(stats)

    def stage_objective(p: Any, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, stats = stage(p, h)
        return out, term(stats)

    def forward(p: Any, lp: Any, xs: jax.Array, ys: Any) -> tuple[Any, Any]:
        return _schedule(stage, stage_objective, loss, term, p, lp, xs, ys, axis=axis,
                         m=m, backward=False, has_aux=has_aux)

    @jax.custom_vjp
    def run(p: Any, lp: Any, xs: jax.Array, ys: Any) -> Any:
        return forward(p, lp, xs, ys)[0]

    def run_fwd(p: Any, lp: Any, xs: jax.Array, ys: Any) -> tuple[Any, Any]:
        out, grads = _schedule(stage, stage_objective, loss, term, p, lp, xs, ys, axis=axis,
                               m=m, backward=True, has_aux=has_aux)
        return out, (grads, ys)

    def run_bwd(res: Any, ct: Any) -> tuple[Any, ...]:
        (dp, dlp, dxs), ys = res
        g = ct[0]
        scale = functools.partial(jax.tree.map, lambda v: (v * g).astype(v.dtype))
        return scale(dp), scale(dlp), scale(dxs), _no_cotangent(ys)

    run.defvjp(run_fwd, run_bwd)
    return run(params, loss_params, microbatches, targets)


def _schedule(
    stage: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    stage_objective: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]],
    loss: Callable[[Any, jax.Array, Any], Any],
    term: Callable[[Any], jax.Array],
    params: Any,
    loss_params: Any,
    xs: jax.Array,
    ys: Any,
    *,
    axis: str | None,
    m: int,
    backward: bool,
    has_aux: bool = False,
) -> tuple[Any, Any]:
    """The ticks of :func:`one_f_one_b`; with ``backward`` also the gradients."""
    index, stages = _stage_index(axis)
    forward_pairs = [(s, s + 1) for s in range(stages - 1)]
    backward_pairs = [(s + 1, s) for s in range(stages - 1)]
    ring = 2 * stages - 1  # microbatches between a stage's forward and backward pass
    last = index == stages - 1

    def send(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        return jax.lax.ppermute(x, axis, pairs) if pairs else x

    def tick(carry: dict[str, Any], t: jax.Array) -> dict[str, Any]:
        c = dict(carry)
        f = t - index  # the microbatch of this tick's forward pass
        valid_f = (f >= 0) & (f < m)
        x = jnp.where(index == 0, _take(xs, jnp.clip(t, 0, m - 1)), c["recv_x"])
        out, stats = stage(params, x)
        stats = _masked(stats, valid_f)
        # The statistics' structure is known once a stage has run: tick 0 starts the sum.
        c["stats"] = stats if c["stats"] is None else jax.tree.map(jnp.add, c["stats"], stats)
        c["aux"] = c["aux"] + jnp.where(valid_f, term(stats), 0.0)
        # The loss of the microbatch leaving the last stage this tick, on every stage.
        j = t - (stages - 1)
        valid_j = (j >= 0) & (j < m)
        y = jax.tree.map(lambda a: _take(a, jnp.clip(j, 0, m - 1)), ys)
        def loss_of(lp: Any, h: jax.Array) -> tuple[jax.Array, Any]:
            value = loss(lp, h, y)
            return value if has_aux else (value, None)

        if backward:
            value, pullback, aux = jax.vjp(loss_of, loss_params, out, has_aux=True)
            dlp, dout = pullback(_ones_like_where(valid_j, value))
            c["dlp"] = jax.tree.map(jnp.add, c["dlp"], dlp)
        else:
            value, aux = loss_of(loss_params, out)
        c["loss"] = c["loss"] + jnp.where(valid_j, value, 0.0)
        if has_aux:
            aux = _masked(aux, valid_j)
            c["aux_total"] = aux if c["aux_total"] is None else jax.tree.map(
                jnp.add, c["aux_total"], aux)
        c["recv_x"] = send(out, forward_pairs)
        if not backward:
            return c
        # The backward pass of microbatch b, from the stage input kept in the ring.
        slot = jnp.mod(f, ring)
        c["ring"] = jax.lax.dynamic_update_index_in_dim(c["ring"], x, slot, 0)
        b = t - (2 * stages - 2 - index)
        valid_b = (b >= 0) & (b < m)
        x_b = _take(c["ring"], jnp.mod(b, ring))
        d_out = jnp.where(last, dout, c["recv_dx"])
        (_, aux_b), pullback = jax.vjp(stage_objective, params, x_b)
        dp, dx = pullback((jnp.where(valid_b, d_out, jnp.zeros_like(d_out)),
                           _ones_like_where(valid_b, aux_b)))
        c["dp"] = jax.tree.map(jnp.add, c["dp"], dp)
        keep = valid_b & (index == 0)
        bi = jnp.clip(b, 0, m - 1)
        c["dxs"] = jax.lax.dynamic_update_index_in_dim(
            c["dxs"], jnp.where(keep, dx, _take(c["dxs"], bi)), bi, 0)
        c["recv_dx"] = send(dx, backward_pairs)
        return c

    zero = jnp.zeros_like(xs[0])
    carry: dict[str, Any] = {"recv_x": zero, "loss": jnp.float32(0), "aux": jnp.float32(0),
                             "stats": None, "aux_total": None}
    if backward:
        carry |= {"recv_dx": zero, "ring": jnp.zeros((ring, *xs.shape[1:]), xs.dtype),
                  "dp": jax.tree.map(jnp.zeros_like, params),
                  "dlp": jax.tree.map(jnp.zeros_like, loss_params),
                  "dxs": jnp.zeros_like(xs)}
    # Tick 0 outside the loop (as in gpipe): it fixes the carry's shapes and axes.
    carry = tick(carry, jnp.int32(0))
    ticks = m + stages - 1 + (stages - 1 if backward else 0)
    carry, _ = jax.lax.scan(lambda c, t: (tick(c, t), None), carry,
                            jnp.arange(1, ticks, dtype=jnp.int32))
    loss_total = _total(carry["loss"])
    objective = loss_total + _total(carry["aux"])
    out: tuple[Any, Any] = (objective, (loss_total, carry["stats"]))
    if has_aux:
        out = (objective, (loss_total, carry["stats"], carry["aux_total"]))
    if not backward:
        return out, None
    grads = (_sum_like(carry["dp"], params), _sum_like(carry["dlp"], loss_params),
             _sum_like(carry["dxs"], xs))
    return out, grads
