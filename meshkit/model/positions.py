"""Where each token of a batch sits: global indices, rotary positions and documents.

A row of a batch is one sequence, or (``data.eos_id``) several documents packed end to
end, each ending with the end-of-sequence id. :func:`layout` prepares a global batch for
the model: the inputs and targets, each token's document (``segments``) and its position
inside its document, with the sequence in :func:`meshkit.model.context.zigzag_order` when
it is split over context devices. Inside ``jax.shard_map`` the model reads a
:class:`Positions` of its local tokens.

A document's last token (the end-of-sequence id) predicts the next document's first: that
target is dropped (``-1``), so a packed row's loss is the token mean of its documents run
one by one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshkit.model.context import local_index, to_zigzag

__all__ = ["Batch", "Positions", "layout"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Positions:
    """The local tokens' places (inside ``jax.shard_map``).

    Attributes:
        index: ``[T]`` global token indices in the row (the causal order).
        positions: ``[T]`` or ``[b, T]`` rotary positions (restarting at each document).
        segments: ``[b, T]`` document ids, or ``None`` (one document a row).
    """

    index: jax.Array
    positions: jax.Array
    segments: jax.Array | None = None

    @classmethod
    def local(cls, length: int, context: tuple[str, ...], *,
              positions: jax.Array | None = None,
              segments: jax.Array | None = None) -> Positions:
        """This device's places: ``length`` tokens of the zigzag layout over ``context``.

        Examples:
            >>> Positions.local(4, ()).index.tolist()
            [0, 1, 2, 3]
        """
        index = local_index(length, context)
        return cls(index=index, positions=index if positions is None else positions,
                   segments=segments)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """A global batch laid out for the model: all ``[B, T]``, sequence in zigzag order.

    Attributes:
        inputs: token ids.
        targets: the next token of each input, ``-1`` where none counts.
        positions: rotary positions, or ``None`` (the global index).
        segments: document ids, or ``None`` (one document a row).
    """

    inputs: jax.Array
    targets: jax.Array
    positions: jax.Array | None = None
    segments: jax.Array | None = None


def layout(batch: jax.Array, *, context_devices: int = 1, eos_id: int | None = None
           ) -> Batch:
    """Inputs, targets and documents of ``[B, T+1]`` token rows, ready to split.

    Args:
        batch: ``[B, T+1]`` integer tokens; position ``t+1`` is the target of ``t``.
        context_devices: ``c``, the devices each sequence is split over (``2c`` divides
            ``T``); the sequence comes back in zigzag order.
        eos_id: the id that ends each packed document, or ``None``.

    Returns:
        The :class:`Batch`.

    Examples:
        >>> b = layout(jnp.array([[5, 6, 0, 7, 8]]), eos_id=0)
        >>> b.targets.tolist(), b.segments.tolist(), b.positions.tolist()
        ([[6, 0, -1, 8]], [[0, 0, 0, 1]], [[0, 1, 2, 0]])
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    positions = segments = None
    if eos_id is not None:
        ends = inputs == eos_id
        # A token's document: the ends strictly before it (an end is its document's last).
        segments = (jnp.cumsum(ends, axis=1) - ends).astype(jnp.int32)
        t = jnp.arange(inputs.shape[1], dtype=jnp.int32)
        starts = jnp.where(jnp.roll(ends, 1, axis=1).at[:, 0].set(True), t, 0)
        positions = t - jax.lax.cummax(starts, axis=1)
        targets = jnp.where(ends, -1, targets)
    def order(a: jax.Array | None) -> jax.Array | None:
        return None if a is None else to_zigzag(a, context_devices)

    return Batch(inputs=to_zigzag(inputs, context_devices),
                 targets=to_zigzag(targets, context_devices),
                 positions=order(positions), segments=order(segments))
