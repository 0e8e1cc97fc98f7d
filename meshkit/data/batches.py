"""Batches on the mesh, each process loading only the rows its own devices hold.

A global batch ``[B, T+1]`` is split over the batch axes on its first dimension. A
process asks the dataset for the rows of its addressable devices only
(``Dataset.batch(..., rows=(start, stop))``) and hands them to
``jax.make_array_from_process_local_data``, which places each device's slice. With one
process every row is its own, and the result equals placing the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np

from meshkit.data.sources import Dataset

__all__ = ["load_batch", "process_rows"]


def _merge(blocks: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated ``(start, stop)`` blocks, touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(set(blocks)):
        if out and start < out[-1][1]:
            raise ValueError(
                f"batch rows {start}:{stop} overlap rows {out[-1][0]}:{out[-1][1]} held by "
                "another device of this process; the batch sharding is not a split of rows"
            )
        if out and start == out[-1][1]:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def process_rows(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[int, int]]:
    """The rows of a ``shape`` array that this process's devices hold under ``sharding``.

    Devices that hold the same rows (the batch is replicated over the tensor and pipeline
    axes) count once; touching blocks are joined.

    Args:
        sharding: the batch's sharding (split on the first dimension at most).
        shape: the global shape, rows first.

    Returns:
        Sorted ``(start, stop)`` row ranges, in the order
        ``jax.make_array_from_process_local_data`` expects the process's rows.

    Raises:
        ValueError: two devices of this process hold different but overlapping rows.

    Examples:
        >>> mesh = jax.make_mesh((8,), ("batch",))
        >>> sharding = jax.sharding.NamedSharding(mesh, jax.P("batch"))
        >>> process_rows(sharding, (16, 5))  # one process: every row
        [(0, 16)]
    """
    blocks = []
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        blocks.append((start, stop))
    return _merge(blocks)


def load_batch(
    dataset: Dataset,
    step: int,
    *,
    sharding: jax.sharding.Sharding,
    shape: tuple[int, int],
    seed: int,
    split: str,
) -> jax.Array:
    """Load this process's rows of batch ``step`` and place the global batch on the mesh.

    Args:
        dataset: the data source.
        step: the batch's step (part of its key).
        sharding: the batch's sharding.
        shape: the global batch shape ``[batch_size, seq_len + 1]``.
        seed: the run's data seed.
        split: ``"train"`` or ``"eval"``.

    Returns:
        The global ``[batch_size, seq_len + 1]`` int32 batch, equal on every strategy and
        process count to ``dataset.batch(step, ...)`` placed whole.

    Raises:
        ValueError: from the dataset (a bad argument), or see :func:`process_rows`.

    Examples:
        >>> from meshkit.data.sources import MarkovSource
        >>> src = MarkovSource(8, 1, seed=0, concentration=0.5)
        >>> mesh = jax.make_mesh((8,), ("batch",))
        >>> sharding = jax.sharding.NamedSharding(mesh, jax.P("batch"))
        >>> batch = load_batch(src, 3, sharding=sharding, shape=(16, 9), seed=0, split="train")
        >>> bool((np.asarray(batch) == src.batch(3, 16, 8, seed=0)).all())
        True
    """
    batch_size, length = shape
    parts = [
        dataset.batch(step, batch_size, length - 1, seed=seed, split=split, rows=rows)
        for rows in process_rows(sharding, shape)
    ]
    local = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return jax.make_array_from_process_local_data(sharding, local, shape)
