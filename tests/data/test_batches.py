"""Batches on the mesh: the rows a process loads, and the batch they make."""

import jax
import numpy as np
import pytest

from meshkit.data.batches import _merge, load_batch, process_rows
from meshkit.data.sources import MarkovSource


def test_merge_joins_touching_blocks_and_drops_repeats():
    # Devices that replicate rows (tensor, pipeline axes) name the same block twice.
    assert _merge([(8, 12), (0, 4), (4, 8), (0, 4), (20, 24)]) == [(0, 12), (20, 24)]


def test_overlapping_blocks_are_refused():
    with pytest.raises(ValueError, match=r"batch rows 2:6 overlap rows 0:4"):
        _merge([(0, 4), (2, 6)])


class _SeenByOneProcess:
    """A batch sharding as one process of several sees it: only its devices' rows."""

    def __init__(self, rows):
        self.rows = rows

    def addressable_devices_indices_map(self, shape):
        return {device: (slice(*r), slice(None)) for device, r in enumerate(self.rows)}


def test_process_rows_are_its_devices_rows_only():
    # Process 1 of {node: 2, device: 4}, batch 16 over all 8 devices: devices 4..7.
    assert process_rows(_SeenByOneProcess([(8, 10), (10, 12), (12, 14), (14, 16)]),
                        (16, 9)) == [(8, 16)]
    # Rows split over an inner axis that spans processes: two blocks, kept apart.
    assert process_rows(_SeenByOneProcess([(0, 4), (8, 12), (0, 4), (8, 12)]),
                        (16, 9)) == [(0, 4), (8, 12)]


@pytest.mark.parametrize(("axes", "spec"), [
    ((2, 4), jax.P(("a", "b"))),  # rows over all 8 devices
    ((2, 4), jax.P("a")),  # rows over 2, replicated over 4 (a tensor axis)
    ((4, 2), jax.P("b")),  # rows over the inner axis: every block repeated
    ((2, 4), jax.P()),  # replicated
])
def test_load_batch_equals_the_whole_batch_placed(axes, spec):
    mesh = jax.make_mesh(axes, ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    assert process_rows(sharding, (16, 9)) == [(0, 16)]  # one process holds every row
    src = MarkovSource(8, 2, seed=0, concentration=0.3)
    batch = load_batch(src, 4, sharding=sharding, shape=(16, 9), seed=1, split="eval")
    whole = src.batch(4, 16, 8, seed=1, split="eval")
    assert batch.sharding == sharding
    for shard in batch.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
