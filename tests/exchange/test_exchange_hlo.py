"""Proof in the compiled program: what the two-stage all-to-all sends across nodes.

Mesh position ``d`` of an ``N × M`` ("node", "device") mesh is device ``d % M`` of node
``d // M``. The compiled flat exchange talks to ``(N−1)·M`` devices on other nodes; the
two-stage one only to ``N−1`` (same local index), with the same bytes crossing nodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshkit.exchange.two_stage import all_to_all, hierarchical_all_to_all
from meshkit.strategy.hlo import Collective, collectives

AXES = ("node", "device")
CAPACITY, MODEL_DIM = 2, 4  # local buffer [P, C, d] float32, as an MoE dispatch


def _compiled_all_to_alls(mesh: Mesh, fn) -> tuple[list[Collective], int]:
    """The all-to-all collectives of fn compiled over mesh, and the local buffer bytes."""
    p = mesh.size
    x = jnp.zeros((p * p, CAPACITY, MODEL_DIM), jnp.float32)
    spec = P(AXES)
    compiled = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    found = collectives(compiled.lower(x).compile())
    return [c for c in found if c.op == "all-to-all"], p * CAPACITY * MODEL_DIM * 4


def _cross_node_traffic(ops: list[Collective], m: int, device: int) -> tuple[set[int], float]:
    """Peers on other nodes, and bytes sent to them, for one device over all ops."""
    peers: set[int] = set()
    sent = 0.0
    for op in ops:
        (group,) = [g for g in op.groups if device in g]
        remote = [d for d in group if d // m != device // m]
        peers.update(remote)
        # A tiled all-to-all sends every member of the group an equal share.
        sent += op.bytes / len(group) * len(remote)
    return peers, sent


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_flat_talks_to_every_remote_device(mesh_shape: tuple[int, int]) -> None:
    n, m = mesh_shape
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), AXES)
    ops, buffer_bytes = _compiled_all_to_alls(mesh, lambda b: all_to_all(b, 0, 1, method="flat"))
    assert len(ops) == 1
    assert ops[0].groups == (tuple(range(n * m)),)
    assert ops[0].bytes == buffer_bytes
    for device in range(n * m):
        peers, sent = _cross_node_traffic(ops, m, device)
        assert len(peers) == (n - 1) * m
        assert sent == pytest.approx(buffer_bytes * (n - 1) / n)


@pytest.mark.parametrize("order", ["node_first", "device_first"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_two_stage_crosses_nodes_only_between_same_local_index(
    mesh_shape: tuple[int, int], order: str
) -> None:
    n, m = mesh_shape
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), AXES)
    ops, buffer_bytes = _compiled_all_to_alls(
        mesh, lambda b: hierarchical_all_to_all(b, 0, 1, order=order)
    )
    assert len(ops) == 2
    node_groups = tuple(tuple(node * m + local for node in range(n)) for local in range(m))
    device_groups = tuple(tuple(node * m + local for local in range(m)) for node in range(n))
    stages = [op.groups for op in ops]
    assert stages == (
        [node_groups, device_groups] if order == "node_first" else [device_groups, node_groups]
    )
    node_stage, device_stage = ops if order == "node_first" else ops[::-1]
    # Node stage: one device per node, all with the same local index.
    for group in node_stage.groups:
        assert len({d % m for d in group}) == 1
        assert sorted(d // m for d in group) == list(range(n))
    # Device stage: never leaves a node.
    for group in device_stage.groups:
        assert len({d // m for d in group}) == 1
    for op in ops:
        assert op.bytes == buffer_bytes  # each stage moves the whole buffer once

    flat_ops, _ = _compiled_all_to_alls(mesh, lambda b: all_to_all(b, 0, 1, method="flat"))
    for device in range(n * m):
        peers, sent = _cross_node_traffic(ops, m, device)
        flat_peers, flat_sent = _cross_node_traffic(flat_ops, m, device)
        assert len(flat_peers) == (n - 1) * m
        assert len(peers) == n - 1
        assert peers == {node * m + device % m for node in range(n) if node != device // m}
        assert sent == pytest.approx(flat_sent)
        assert sent == pytest.approx(buffer_bytes * (n - 1) / n)
