"""Every dispatcher through one parity check against a dense reference, and its HLO.

Routing is given (random, distinct experts per token), not learned, and capacities are
large enough that nothing drops, so every dispatcher must give the dense result: each
token's gate-weighted sum of its experts' SwiGLU outputs, and the same gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_emulation import emulated_ragged_all_to_all
from jax.sharding import AxisType

from meshkit.exchange.dedup import DedupDispatcher
from meshkit.exchange.dispatch import (
    ExpertBatch,
    FlatDispatcher,
    Routing,
    TwoStageDispatcher,
)
from meshkit.exchange.ragged import RaggedDispatcher
from meshkit.strategy.axes import AxisNameError
from meshkit.strategy.hlo import collectives

AXES = ("node", "device")
N, M = 2, 4
E, K = 8, 2  # one expert per device, two choices per token
NT, D, F = 4, 4, 8  # tokens per device, model width, expert width
NO_DROP = E / K  # capacity = every local token: nothing drops
COMMON = {"num_experts": E}
DISPATCHERS = {
    "flat": lambda: FlatDispatcher(**COMMON, capacity_factor=NO_DROP, axes=AXES),
    "flat-einsum": lambda: FlatDispatcher(**COMMON, capacity_factor=NO_DROP, axes=AXES,
                                          mode="einsum"),
    "padded-dropless": lambda: FlatDispatcher(**COMMON, capacity_factor=0, axes=AXES),
    "two-stage-node-first": lambda: TwoStageDispatcher(
        **COMMON, capacity_factor=NO_DROP, node_axes="node", device_axes="device"),
    "two-stage-device-first": lambda: TwoStageDispatcher(
        **COMMON, capacity_factor=NO_DROP, node_axes="node", device_axes="device",
        order="device_first"),
    "dedup": lambda: DedupDispatcher(**COMMON, capacity_factor=NO_DROP, node_axes="node",
                                     device_axes="device"),
    # XLA:CPU cannot run ragged_all_to_all: the exact emulation stands in for it.
    "ragged": lambda: RaggedDispatcher(**COMMON, axes=AXES,
                                       all_to_all=emulated_ragged_all_to_all),
}
ALL = ((0, 1, 2, 3, 4, 5, 6, 7),)
NODE = ((0, 4), (1, 5), (2, 6), (3, 7))  # same local index, across nodes
DEVICE = ((0, 1, 2, 3), (4, 5, 6, 7))  # inside each node
GROUPS = {  # the all-to-all groups each dispatcher's compiled program uses
    "flat": {ALL}, "flat-einsum": {ALL}, "padded-dropless": {ALL},
    "two-stage-node-first": {NODE, DEVICE}, "two-stage-device-first": {NODE, DEVICE},
    "dedup": {NODE, DEVICE}, "ragged": {ALL},
}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N, M), AXES, axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N * M * NT, D)).astype(np.float32)
    index = np.stack([rng.permutation(E)[:K] for _ in range(N * M * NT)]).astype(np.int32)
    gate = rng.uniform(0.1, 1.0, size=index.shape).astype(np.float32)
    weights = tuple(rng.normal(size=s).astype(np.float32) / np.sqrt(s[1])
                    for s in ((E, D, F), (E, D, F), (E, F, D)))
    return x, index, gate, weights


def _swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _experts(batch: ExpertBatch, wg, wu, wd):
    """The local experts on either layout of the batch."""
    if batch.group_sizes is None:
        g = jnp.einsum("esd,edf->esf", batch.rows, wg)
        u = jnp.einsum("esd,edf->esf", batch.rows, wu)
        return jnp.einsum("esf,efd->esd", jax.nn.silu(g) * u, wd)
    sizes = batch.group_sizes
    g = jax.lax.ragged_dot(batch.rows, wg, sizes)
    u = jax.lax.ragged_dot(batch.rows, wu, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, sizes)


def _dense(x, index, gate, weights):
    """Every token through each of its experts, gate-weighted: no exchange at all."""
    wg, wu, wd = (w[index] for w in weights)  # [n, k, ...]
    h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x, wg)) * jnp.einsum("nd,nkdf->nkf", x, wu)
    return jnp.einsum("nk,nkd->nd", gate, jnp.einsum("nkf,nkfd->nkd", h, wd))


def _program(make):
    spec = jax.P(AXES)

    def body(x, index, gate, wg, wu, wd):
        dispatcher = make()
        batch, context = dispatcher.dispatch(x, Routing(index, gate))
        y = dispatcher.combine(_experts(batch, wg, wu, wd), context)
        return y, jax.lax.psum(context.dropped, AXES)

    return jax.shard_map(body, in_specs=(spec,) * 6, out_specs=(spec, jax.P()))


def _loss_and_grads(fn, x, index, gate, weights):
    probe = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

    def loss(x, weights):
        y, dropped = fn(x, index, gate, *weights)
        return jnp.sum(y * probe), (y, dropped)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, weights)


@pytest.fixture(scope="module")
def reference(inputs):
    x, index, gate, weights = inputs
    dense = lambda x, i, g, *w: (_dense(x, i, g, w), jnp.int32(0))  # noqa: E731
    return _loss_and_grads(dense, x, index, gate, weights)


@pytest.mark.parametrize("name", DISPATCHERS)
def test_dispatcher_matches_dense_reference_with_grads(name, mesh, inputs, reference):
    x, index, gate, weights = inputs
    (gx_ref, gw_ref), (y_ref, _) = reference
    with jax.set_mesh(mesh):
        (gx, gw), (y, dropped) = _loss_and_grads(_program(DISPATCHERS[name]), x, index,
                                                 gate, weights)
    assert int(dropped) == 0
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(gw, gw_ref, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DISPATCHERS)
def test_dispatcher_exchanges_over_its_groups(name, mesh, inputs):
    x, index, gate, weights = inputs
    with jax.set_mesh(mesh):
        compiled = jax.jit(_program(DISPATCHERS[name])).lower(x, index, gate, *weights).compile()
    groups = {c.groups for c in collectives(compiled) if c.op == "all-to-all"}
    assert groups == GROUPS[name]


def test_capacity_drops_are_counted(mesh, inputs):
    # Every token to expert 0 first: with one slot per expert, all but one per device drop.
    x, index, gate, weights = inputs
    index = np.stack([np.zeros(len(index)), np.ones(len(index))], 1).astype(np.int32)
    tight = {
        "flat": lambda: FlatDispatcher(**COMMON, capacity_factor=1.0, axes=AXES),
        "dedup": lambda: DedupDispatcher(**COMMON, capacity_factor=1.0, node_axes="node",
                                         device_axes="device"),
    }
    with jax.set_mesh(mesh):
        for name, make in tight.items():
            _, dropped = jax.jit(_program(make))(x, index, gate, *weights)
            # n·k/E = 1 slot per expert per device: 3 of 4 tokens drop both choices.
            assert int(dropped) == N * M * (NT - 1) * K, name


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: FlatDispatcher(**COMMON, capacity_factor=1.0, mode="onehot"), ValueError,
         "dispatch mode must be one of"),
        (lambda: TwoStageDispatcher(**COMMON, capacity_factor=1.0, node_axes="node",
                                    device_axes="device", method="ring"), ValueError,
         "method must be one of"),
        (lambda: TwoStageDispatcher(**COMMON, capacity_factor=1.0, node_axes="node",
                                    device_axes="device", order="inner_first"), ValueError,
         "order must be one of"),
        (lambda: TwoStageDispatcher(**COMMON, capacity_factor=1.0, node_axes=(),
                                    device_axes="device"), AxisNameError,
         "node_axes must name at least one mesh axis"),
        (lambda: DedupDispatcher(**COMMON, capacity_factor=1.0, node_axes="node",
                                 device_axes=()), ValueError,
         "DedupDispatcher needs node and device axes"),
    ],
)
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "shapes", "match"),
    [
        (lambda: FlatDispatcher(num_experts=E, capacity_factor=1.0, axes=AXES),
         ((NT, D), (NT, 1), (NT, K)),
         r"FlatDispatcher: expert_index and gate must both be \[4, k\]"),
        (lambda: DedupDispatcher(num_experts=12, capacity_factor=1.0, node_axes="node",
                                 device_axes="device"),
         ((NT, D), (NT, K), (NT, K)), r"num_experts=12 is not divisible by the 2×4 devices"),
    ],
)
def test_dispatch_errors(make, shapes, match, mesh):
    spec = jax.P(AXES)
    body = jax.shard_map(lambda x, i, g: make().dispatch(x, Routing(i, g))[0].rows,
                         in_specs=(spec,) * 3, out_specs=spec)
    args = [jax.ShapeDtypeStruct((N * M * s[0], *s[1:]), dt)
            for s, dt in zip(shapes, (jnp.float32, jnp.int32, jnp.float32), strict=True)]
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.eval_shape(body, *args)
