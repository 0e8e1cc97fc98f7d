"""Worker for test_multiprocess: run under `meshkit launch -n 2 --devices-per-process 4`."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import Strategy
from meshkit.exchange.two_stage import hierarchical_all_to_all
from meshkit.runtime.distributed import initialize


def main() -> None:
    """Check the exchange and the mesh's process layout; print EXCHANGE OK."""
    assert initialize() == 2
    strategy = Strategy.from_axes({"node": 2, "device": 4})
    mesh = strategy.mesh()
    rows = [{d.process_index for d in row} for row in mesh.devices]
    assert rows == [{0}, {1}], f"node rows are not processes: {rows}"
    try:
        Strategy([[0, 1, 2, 4], [3, 5, 6, 7]], ("node", "device")).mesh()
    except ValueError as e:
        assert "spans processes [0, 0, 0, 1]" in str(e), e
    else:
        raise AssertionError("a device axis straddling processes was accepted")

    try:
        Strategy.from_axes({"a": 4}).mesh()
    except ValueError as e:
        assert "leave processes [1] without a device in the mesh" in str(e), e
    else:
        raise AssertionError("a mesh on process 0's devices alone was accepted")

    spec = P(("node", "device"))
    rank = jax.process_index()
    # Process-local data: each process contributes only its own rows, different per process.
    local = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3) + 1000 * rank
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
    everything = np.concatenate(
        [np.arange(96, dtype=np.float32).reshape(32, 3) + 1000 * p for p in (0, 1)]
    )


    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(x)


    flat = run(lambda v: jax.lax.all_to_all(v, ("node", "device"), 0, 0, tiled=True))
    for order in ("node_first", "device_first"):
        hier = run(lambda v, o=order: hierarchical_all_to_all(v, 0, 0, order=o))
        for a, b in zip(flat.addressable_shards, hier.addressable_shards, strict=True):
            assert a.index == b.index and np.array_equal(a.data, b.data), order
    # Check against numpy: device p receives piece p of every device, in device order.
    pieces = everything.reshape(8, 8, 1, 3)  # [source device, destination piece, rows, cols]
    for shard in flat.addressable_shards:
        p = shard.index[0].start // 8
        assert np.array_equal(np.asarray(shard.data), pieces[:, p].reshape(8, 3)), p
    print(f"EXCHANGE OK {rank}", flush=True)


if __name__ == "__main__":
    main()
