"""Dropless expert exchange that sends only the real rows (``jax.lax.ragged_all_to_all``).

The padded dropless exchange (``capacity_factor = 0`` in :class:`meshkit.model.moe.MoE`) sizes
every expert's buffer for the worst case, ``C = n`` slots, and all-to-alls the whole
``[E, n, d]`` buffer: ``E·n`` rows per device on the wire, of which only ``n·k`` hold a
token. This module sends just those ``n·k`` rows. Per device, inside ``jax.shard_map``
over the expert axes (``P`` devices, ``L = E/P`` local experts each, ``n`` tokens here,
``k`` experts per token):

1. **Sort** the ``n·k`` assignments by expert with the same stable, choice-major sort as
   :func:`meshkit.exchange.slots.dispatch_plan`. Device ``p`` holds experts ``[p·L, (p+1)·L)``, so
   the sorted rows for one device are contiguous, and inside them each expert's rows.
2. **Sizes.** A small all-to-all of the per-expert counts ``[E]`` tells each device how
   many rows every source sends to each of its experts.
3. **Placement.** The receiver lays its rows out expert-major: local expert ``j``'s
   group, inside it source ``q``'s rows. It returns each slice's offset to its sender (a
   second small all-to-all): that is the ``output_offsets`` argument, which names where
   the *sent* slice lands on its receiver.
4. **Dispatch**: one ``ragged_all_to_all`` of ``E`` slices, one per (destination device,
   local expert), each ``counts[e]`` rows long.
5. **Experts**: the received rows are already grouped by expert, so the experts run on
   them directly with the group sizes (``jax.lax.ragged_dot`` in :mod:`meshkit.model.experts`)
   — no scatter into a padded ``[L, P·n, d]`` buffer, no FLOPs on padding where the
   backend's ragged dot skips it.
6. **Return**: the reverse ``ragged_all_to_all`` (each slice back to the sorted position
   it left from; a third small all-to-all tells the receiver those positions), then
   unsort and **combine** with the gates.

Gradients come from autodiff: in this JAX ``ragged_all_to_all`` has a JVP and a transpose
rule (the transpose is again a ragged all-to-all with the offsets swapped).

What it saves and what it does not: the dispatch and the return each carry ``n·k`` rows
per device instead of ``E·n`` (a factor ``E/k``), plus ``3E`` int32 of sizes and offsets.
The receive buffer is still sized for the worst case, ``P·n·min(k, L)`` rows (every
source may send all its tokens to this device), so the memory cost of dropless stays.

**Where it runs.** XLA:CPU does not implement the op: the program lowers, but compiling
it fails with ``UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by
XLA:CPU ThunkEmitter``. :func:`ragged_op` therefore picks it only on the platforms in
:data:`RAGGED_PLATFORMS`; on CPU the padded path runs. This path has been verified only
on CPU, against an exact emulation of the op's documented semantics (built from
``jax.lax.all_to_all`` in the tests and injected through the test hook below); it has
not been run on GPU or TPU hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from meshkit.exchange.dispatch import (
    DispatchContext,
    Dispatcher,
    ExpertBatch,
    Routing,
    check_routing,
)
from meshkit.strategy.axes import axis_names

__all__ = [
    "RAGGED_PLATFORMS",
    "RaggedAllToAll",
    "RaggedDispatcher",
    "ragged_exchange",
    "ragged_op",
    "receive_rows",
]

#: Platforms (``Device.platform``) whose XLA backend implements ``ragged-all-to-all``.
#: JAX reports NVIDIA and AMD GPUs as ``"gpu"``; the vendor names are accepted too.
RAGGED_PLATFORMS: tuple[str, ...] = ("gpu", "cuda", "rocm", "tpu")


class RaggedAllToAll(Protocol):
    """The signature of ``jax.lax.ragged_all_to_all`` (or a stand-in for it)."""

    def __call__(
        self, operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
        send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
        axis_name: Any,
    ) -> jax.Array: ...


# Test hook, for tests only: when set, every eligible dropless MoE layer takes the ragged
# path with this function in place of jax.lax.ragged_all_to_all, whatever the platform.
# CPU tests set it to an emulation (to run) or to the real op (to lower without compiling).
_test_ragged_all_to_all: RaggedAllToAll | None = None


def ragged_op(mesh: jax.sharding.AbstractMesh) -> RaggedAllToAll | None:
    """The ragged all-to-all to run the dropless exchange with on ``mesh``, if any.

    Args:
        mesh: the (abstract) mesh the layer runs on; its ``abstract_device.platform``
            decides (``jax.default_backend()`` when the mesh names no device).

    Returns:
        ``jax.lax.ragged_all_to_all`` on a platform in :data:`RAGGED_PLATFORMS`, ``None``
        elsewhere (run the padded path) — unless the test hook is set, which wins.

    Examples:
        >>> cpu = jax.sharding.AbstractDevice(device_kind="cpu", num_cores=None,
        ...                                   platform="cpu")
        >>> tpu = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=1,
        ...                                   platform="tpu")
        >>> mesh = jax.sharding.AbstractMesh((8,), ("e",), abstract_device=cpu)
        >>> ragged_op(mesh) is None
        True
        >>> ragged_op(mesh.update(abstract_device=tpu)) is jax.lax.ragged_all_to_all
        True
    """
    if _test_ragged_all_to_all is not None:
        return _test_ragged_all_to_all
    device = mesh.abstract_device
    platform = jax.default_backend() if device is None else device.platform
    return jax.lax.ragged_all_to_all if platform in RAGGED_PLATFORMS else None


def receive_rows(num_tokens: int, top_k: int, num_devices: int, num_experts: int) -> int:
    """Rows of the ragged receive buffer: the worst case ``P · n · min(k, E/P)``.

    A source sends one device at most ``n`` rows per local expert (a token's ``k``
    experts are distinct) and at most ``n·k`` rows in all.

    Args:
        num_tokens: ``n``, tokens per device.
        top_k: ``k``.
        num_devices: ``P``, devices over the expert axes.
        num_experts: ``E``, divisible by ``P``.

    Returns:
        The row count (the padded path's receive buffer holds ``P · n · E/P``).

    Raises:
        ValueError: a non-positive size, or ``E`` not divisible by ``P``.

    Examples:
        >>> receive_rows(6, 2, 8, 16), receive_rows(6, 4, 8, 16)  # vs 8·6·2 = 96 padded
        (96, 96)
        >>> receive_rows(6, 1, 8, 16)
        48
    """
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k),
                        ("num_devices", num_devices), ("num_experts", num_experts)):
        if value < 1:
            raise ValueError(f"receive_rows: {name} must be positive, got {value}")
    if num_experts % num_devices:
        raise ValueError(
            f"receive_rows: num_experts={num_experts} is not divisible by the "
            f"{num_devices} expert devices"
        )
    return num_devices * num_tokens * min(top_k, num_experts // num_devices)


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


@dataclasses.dataclass(frozen=True)
class _RaggedContext(DispatchContext):
    gate: jax.Array  # [n, k]
    order: jax.Array  # [n·k] the sort of the choice-major assignments by expert
    counts: jax.Array  # [E] rows I sent each expert
    recv_counts: jax.Array  # [P·L] rows each source sent each of my experts
    placed: jax.Array  # [P·L] where those rows sit in my receive buffer
    came_from: jax.Array  # [P·L] where they sat in their sender's sorted rows


class RaggedDispatcher(Dispatcher[_RaggedContext]):
    """The dropless ragged exchange (module docstring) as a :class:`Dispatcher`.

    Nothing is dropped (``context.dropped`` is 0). The experts get
    :class:`~meshkit.exchange.dispatch.ExpertBatch` rows ``[R, d]`` grouped by local
    expert with ``group_sizes [E/P]``; ``R`` is :func:`receive_rows`.

    Args:
        num_experts: ``E``, divisible by the devices of ``axes``.
        axes: the expert mesh axes (row-major: device ``p`` holds experts
            ``[p·L, (p+1)·L)``), all manual at dispatch.
        all_to_all: the ragged all-to-all: ``jax.lax.ragged_all_to_all`` (GPU/TPU; see
            :func:`ragged_op`), or a stand-in (the CPU tests' emulation).

    Raises:
        ValueError: no axes (here); at dispatch, mismatched shapes or ``E`` not
            divisible by the ``P`` devices.

    Example::

        # inside jax.shard_map over ("node", "device"), on GPU or TPU
        ragged = RaggedDispatcher(num_experts=16, axes=("node", "device"))
        batch, context = ragged.dispatch(tokens, Routing(expert_index, gate))
        y = ragged.combine(run_local_experts(batch.rows, batch.group_sizes), context)
    """

    def __init__(
        self, *, num_experts: int, axes: Sequence[str] | str,
        all_to_all: RaggedAllToAll = jax.lax.ragged_all_to_all,
    ) -> None:
        self.axes = axis_names(axes, "axes")
        if not self.axes:
            raise ValueError("ragged_exchange: axes must name at least one expert mesh axis")
        self.num_experts, self.all_to_all = num_experts, all_to_all

    def dispatch(self, x: jax.Array, routing: Routing) -> tuple[ExpertBatch, _RaggedContext]:
        check_routing(x, routing, "ragged_exchange")
        tokens, expert_index, axes = x, routing.expert_index, self.axes
        n, d = tokens.shape
        k = routing.top_k
        p = jax.lax.axis_size(axes)
        num_experts = self.num_experts
        if num_experts % p:
            raise ValueError(
                f"ragged_exchange: num_experts={num_experts} is not divisible by the {p} "
                f"devices of axes {axes}"
            )
        local = num_experts // p
        i32 = jnp.int32

        # 1. Sort the assignments by expert (stable, choice-major: row j·n + t is choice j
        #    of token t), so each destination's and each expert's rows are contiguous.
        flat = expert_index.T.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        send = jnp.tile(tokens, (k, 1))[order]  # [n·k, d]
        counts = jnp.bincount(flat, length=num_experts).astype(i32)  # slice e: counts[e] rows
        in_offsets = _exclusive_cumsum(counts)

        # 2. Sizes: entry q·L + j of the result is what source q sends my local expert j.
        recv_counts = jax.lax.all_to_all(counts, axes, 0, 0, tiled=True)
        # 3. Placement, expert-major so the groups come out contiguous for the experts:
        #    expert j's group starts after the groups of experts < j; within it, sources
        #    in order. Sent back, each sender learns where its slices land (output_offsets).
        by_source = recv_counts.reshape(p, local)
        group_sizes = jnp.sum(by_source, axis=0)
        placed = _exclusive_cumsum(group_sizes)[None, :] + _exclusive_cumsum(by_source, axis=0)
        placed = placed.reshape(-1)
        out_offsets = jax.lax.all_to_all(placed, axes, 0, 0, tiled=True)
        # For the return trip: where each slice came from in its sender's sorted rows.
        came_from = jax.lax.all_to_all(in_offsets, axes, 0, 0, tiled=True)

        # 4. Dispatch only the real rows into the worst-case receive buffer.
        rows = receive_rows(n, k, p, num_experts)
        received = self.all_to_all(
            send, jnp.zeros((rows, d), send.dtype), in_offsets, counts, out_offsets,
            recv_counts, axis_name=axes,
        )
        context = _RaggedContext(
            dropped=jnp.zeros((), i32), gate=routing.gate, order=order, counts=counts,
            recv_counts=recv_counts, placed=placed, came_from=came_from,
        )
        return ExpertBatch(received, group_sizes), context

    def combine(self, expert_outputs: jax.Array, context: _RaggedContext) -> jax.Array:
        gate = context.gate
        n, k = gate.shape
        d = expert_outputs.shape[-1]
        # 6. Return each slice to where it left from: the same exchange, roles swapped.
        back = self.all_to_all(
            expert_outputs, jnp.zeros((n * k, d), expert_outputs.dtype), context.placed,
            context.recv_counts, context.came_from, context.counts, axis_name=self.axes,
        )
        # Unsort (every sorted row came back: no mask needed) and combine with the gates.
        unsorted = jnp.zeros_like(back).at[context.order].set(back, unique_indices=True)
        per_choice = unsorted.reshape(k, n, d).astype(jnp.float32)
        return jnp.einsum("nk,knd->nd", gate.astype(jnp.float32), per_choice)


def ragged_exchange(
    tokens: jax.Array,
    expert_index: jax.Array,
    gate: jax.Array,
    experts: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    num_experts: int,
    axes: Sequence[str],
    all_to_all: RaggedAllToAll = jax.lax.ragged_all_to_all,
) -> jax.Array:
    """:class:`RaggedDispatcher`'s dispatch, ``experts`` and combine in one call.

    Call inside ``jax.shard_map`` with ``axes`` manual. Nothing is dropped.

    Args:
        tokens: ``[n, d]`` this device's tokens.
        expert_index: ``[n, k]`` int expert ids in ``[0, E)``, distinct per token.
        gate: ``[n, k]`` gates.
        experts: ``experts(rows [R, d], group_sizes [L] int32) -> [R, d]`` runs this
            device's ``L = E/P`` experts on rows grouped by expert (group ``j`` first
            ``group_sizes[j]`` rows after group ``j-1``); rows past the groups are
            padding, and whatever it returns for them is never sent back.
        num_experts: ``E``.
        axes: the expert mesh axes (row-major: device ``p`` holds experts
            ``[p·L, (p+1)·L)``), all manual here.
        all_to_all: the ragged all-to-all (tests pass an emulation).

    Returns:
        ``y [n, d]`` float32: each token's gate-weighted sum of its experts' outputs.

    Raises:
        ValueError: no axes, mismatched shapes, or ``E`` not divisible by ``P``.

    Example::

        # inside jax.shard_map over ("node", "device"), on GPU or TPU
        y = ragged_exchange(tokens, expert_index, gate, run_local_experts,
                            num_experts=16, axes=("node", "device"))
    """
    dispatcher = RaggedDispatcher(num_experts=num_experts, axes=axes, all_to_all=all_to_all)
    batch, context = dispatcher.dispatch(tokens, Routing(expert_index, gate))
    assert batch.group_sizes is not None  # the ragged layout, always
    return dispatcher.combine(experts(batch.rows, batch.group_sizes), context)
