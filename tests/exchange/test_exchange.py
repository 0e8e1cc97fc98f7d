"""The two-stage all-to-all equals the flat one, bit for bit, values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshkit.exchange import cost
from meshkit.exchange.two_stage import all_to_all, hierarchical_all_to_all

# name -> (mesh shape, mesh axis names, node_axis, device_axis)
MESHES = {
    "2x4": ((2, 4), ("node", "device"), "node", "device"),
    "4x2": ((4, 2), ("node", "device"), "node", "device"),
    "1x8": ((1, 8), ("node", "device"), "node", "device"),
    "8x1": ((8, 1), ("node", "device"), "node", "device"),
    "2x2x2-device-tuple": ((2, 2, 2), ("node", "d0", "d1"), "node", ("d0", "d1")),
    "2x2x2-node-tuple": ((2, 2, 2), ("n0", "n1", "device"), ("n0", "n1"), "device"),
    # The "node" role on the inner mesh axis: exchange order follows the arguments.
    "2x4-swapped": ((2, 4), ("node", "device"), "device", "node"),
}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def _names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else axis


# (rank, how split_axis compares with concat_axis, dtype): every relation with a float
# (for gradients) and with an integer dtype, ranks 1 to 4; sizes, the axes themselves
# and their signs are drawn at random.
CASES = (
    (1, "eq", jnp.float32),
    (2, "gt", jnp.bfloat16),
    (3, "lt", jnp.float32),
    (3, "eq", jnp.int32),
    (4, "gt", jnp.uint8),
    (4, "lt", jnp.int32),
)


def _random_case(case: int, p: int) -> tuple[tuple[int, ...], int, int, jnp.dtype]:
    """A local block shape, split/concat axes (maybe negative) and a dtype."""
    rank, relation, dtype = CASES[case]
    rng = np.random.default_rng(case)
    shape = [int(d) for d in rng.integers(1, 5, size=rank)]
    if relation == "eq":
        split = concat = int(rng.integers(0, rank))
    else:
        low, high = sorted(int(a) for a in rng.choice(rank, size=2, replace=False))
        split, concat = (high, low) if relation == "gt" else (low, high)
    shape[split] = p * int(rng.integers(1, 3))
    if rng.random() < 0.5:
        split -= rank
    if rng.random() < 0.5:
        concat -= rank
    return tuple(shape), split, concat, dtype


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jax.Array:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return jnp.asarray(rng.integers(0, 100, size=shape), dtype)


def _assert_bitwise_equal(actual: jax.Array, expected: jax.Array) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes()


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_flat_values_and_gradients(mesh_name: str, case: int) -> None:
    mesh_shape, names, node_axis, device_axis = MESHES[mesh_name]
    mesh = _mesh(mesh_shape, names)
    axes = (*_names(node_axis), *_names(device_axis))
    p = mesh.size
    local, split, concat, dtype = _random_case(case, p)
    rank = len(local)
    rng = np.random.default_rng(1000 + case)
    x = _random_array(rng, (p * local[0], *local[1:]), dtype)
    spec = P(names)

    def reference(b: jax.Array) -> jax.Array:
        # jax.lax.all_to_all mishandles negative split axes, so the reference gets them
        # normalised; meshkit's functions get them as drawn.
        return jax.lax.all_to_all(b, axes, split % rank, concat % rank, tiled=True)

    kw = {"node_axis": node_axis, "device_axis": device_axis}
    candidates = {
        "node_first": lambda b: hierarchical_all_to_all(b, split, concat, **kw),
        "device_first": lambda b: hierarchical_all_to_all(
            b, split, concat, order="device_first", **kw
        ),
        "method=flat": lambda b: all_to_all(b, split, concat, method="flat", **kw),
        "method=hierarchical": lambda b: all_to_all(b, split, concat, method="hierarchical", **kw),
        "method=auto": lambda b: all_to_all(b, split, concat, **kw),
    }
    fns = {"reference": reference, **candidates}
    mapped = {k: jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec) for k, f in fns.items()}
    is_float = jnp.issubdtype(dtype, jnp.floating)
    out_shape = jax.eval_shape(mapped["reference"], x).shape
    w = _random_array(rng, out_shape, dtype)

    @jax.jit
    def run(x: jax.Array, w: jax.Array) -> tuple[dict, dict]:
        values = {k: f(x) for k, f in mapped.items()}
        grads = {}
        if is_float:
            grads = {
                k: jax.grad(lambda x, f=f: jnp.sum(f(x).astype(jnp.float32) * w))(x)
                for k, f in mapped.items()
            }
        return values, grads

    values, grads = run(x, w)
    for name in candidates:
        _assert_bitwise_equal(values[name], values["reference"])
        if is_float:
            _assert_bitwise_equal(grads[name], grads["reference"])
    if is_float:
        # The gradient of sum(y * w) is w routed back: a permutation of w's entries.
        assert sorted(np.asarray(grads["reference"], np.float32).ravel()) == sorted(
            np.asarray(w, np.float32).ravel()
        )


@pytest.mark.parametrize("order", ["node_first", "device_first"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_matches_numpy_loop(mesh_shape: tuple[int, int], order: str) -> None:
    """Device q ends with piece q of every device's block, in device order (numpy)."""
    mesh = _mesh(mesh_shape, ("node", "device"))
    p, rows, cols = 8, 16, 3
    x = np.arange(p * rows * cols, dtype=np.int32).reshape(p * rows, cols)
    spec = P(("node", "device"))
    f = jax.jit(
        jax.shard_map(
            lambda b: hierarchical_all_to_all(b, 0, 1, order=order),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    blocks = np.split(x, p)
    piece = rows // p
    expected = np.concatenate(
        [
            np.concatenate([blocks[src][dst * piece : (dst + 1) * piece] for src in range(p)], 1)
            for dst in range(p)
        ]
    )
    np.testing.assert_array_equal(np.asarray(f(x)), expected)


def _count_all_to_all(mesh: Mesh, fn, x: jax.Array) -> int:
    spec = P(mesh.axis_names)
    jaxpr = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(x)
    return str(jaxpr).count("all_to_all[")


@pytest.mark.parametrize(
    ("mesh_shape", "expected"), [((2, 4), 2), ((4, 2), 2), ((1, 8), 1), ((8, 1), 1)]
)
def test_one_collective_when_a_level_is_trivial(mesh_shape: tuple[int, int], expected: int) -> None:
    mesh = _mesh(mesh_shape, ("node", "device"))
    n = _count_all_to_all(mesh, lambda b: hierarchical_all_to_all(b, 0, 0), jnp.ones(64))
    assert n == expected


def test_auto_follows_the_cost_model() -> None:
    mesh = _mesh((2, 4), ("node", "device"))
    x = jnp.ones((64, 4), jnp.float32)
    bytes_per_device = 8 * 4 * 4
    # Free messages and slow memory: only the extra pass and copies count -> flat.
    slow_copies = cost.Topology(2, 4, cost.Link(0.0, 1e9), cost.Link(0.0, 1e9), 1e6)
    assert cost.choose(bytes_per_device, slow_copies) == "flat"
    a100 = cost.preset("a100-8x200g", nodes=2, devices_per_node=4)
    assert cost.choose(bytes_per_device, a100) == "hierarchical"
    assert cost.choose(bytes_per_device, cost.default_topology(2, 4)) == "hierarchical"
    for topology, want in [(slow_copies, 1), (a100, 2), (None, 2)]:
        n = _count_all_to_all(mesh, lambda b, t=topology: all_to_all(b, 0, 1, topology=t), x)
        assert n == want, topology


# --- errors ------------------------------------------------------------------------


def _trace(fn, mesh_shape=(2, 4), names=("node", "device"), x=None, axis_names=None) -> None:
    mesh = _mesh(mesh_shape, names)
    x = jnp.ones((64, 4)) if x is None else x
    spec = P(names if axis_names is None else tuple(axis_names))
    kwargs = {} if axis_names is None else {"axis_names": set(axis_names)}
    jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, **kwargs)).trace(x)


@pytest.mark.parametrize("fn", [hierarchical_all_to_all, all_to_all])
def test_split_dimension_not_divisible(fn) -> None:
    with pytest.raises(ValueError, match=r"split dimension 1 .*size 4.*not divisible.*P = 8"):
        _trace(lambda b: fn(b, 1, 0))


@pytest.mark.parametrize("fn", [hierarchical_all_to_all, all_to_all])
def test_unknown_axis_name(fn) -> None:
    with pytest.raises(NameError, match=r"'nodes' is not an axis"):
        _trace(lambda b: fn(b, 0, 0, node_axis="nodes"))
    with pytest.raises(NameError, match=r"'gpu' is not an axis"):
        _trace(lambda b: fn(b, 0, 0, device_axis=("device", "gpu")), names=("node", "device"))


def test_axis_not_manual_in_partial_shard_map() -> None:
    with pytest.raises(NameError, match=r"'device' is not a manual axis"):
        _trace(lambda b: hierarchical_all_to_all(b, 0, 0), axis_names=("node",))


@pytest.mark.parametrize(
    ("node_axis", "device_axis"),
    [("node", ("node", "device")), (("node", "node"), "device"), ("device", "device")],
)
def test_axis_listed_twice(node_axis, device_axis) -> None:
    with pytest.raises(ValueError, match=r"listed twice"):
        _trace(lambda b: all_to_all(b, 0, 0, node_axis=node_axis, device_axis=device_axis))


@pytest.mark.parametrize("fn", [hierarchical_all_to_all, all_to_all])
def test_outside_shard_map(fn) -> None:
    name = fn.__name__
    with pytest.raises(NameError, match=rf"meshkit.{name} must be called inside jax.shard_map"):
        fn(jnp.ones(8), 0, 0)
    with pytest.raises(NameError, match=r"inside jax.shard_map"):
        jax.jit(lambda b: fn(b, 0, 0)).trace(jnp.ones(8))


def test_bad_order_and_method() -> None:
    with pytest.raises(ValueError, match=r"order must be one of .*'sideways'"):
        _trace(lambda b: hierarchical_all_to_all(b, 0, 0, order="sideways"))
    with pytest.raises(ValueError, match=r"method must be one of .*'ring'"):
        _trace(lambda b: all_to_all(b, 0, 0, method="ring"))


def test_bad_axis_arguments() -> None:
    with pytest.raises(ValueError, match=r"node_axis must name at least one"):
        _trace(lambda b: hierarchical_all_to_all(b, 0, 0, node_axis=()))
    with pytest.raises(TypeError, match=r"device_axis axis names must be non-empty strings"):
        _trace(lambda b: hierarchical_all_to_all(b, 0, 0, device_axis=("device", 3)))
    with pytest.raises(ValueError, match=r"split_axis=2 is out of range .* rank 2"):
        _trace(lambda b: hierarchical_all_to_all(b, 2, 0))
    with pytest.raises(ValueError, match=r"concat_axis=-3 is out of range"):
        _trace(lambda b: hierarchical_all_to_all(b, 0, -3))
    with pytest.raises(TypeError, match=r"split_axis must be an int"):
        _trace(lambda b: hierarchical_all_to_all(b, 0.0, 0))
    with pytest.raises(ValueError, match=r"rank >= 1"):
        _trace(lambda b: hierarchical_all_to_all(b.sum(), 0, 0) * b)


def test_topology_must_match_mesh() -> None:
    wrong = cost.preset("h100-8x400g", nodes=4)
    with pytest.raises(ValueError, match=r"topology has 4 nodes × 8 devices .* N = 2, M = 4"):
        _trace(lambda b: all_to_all(b, 0, 0, topology=wrong))
