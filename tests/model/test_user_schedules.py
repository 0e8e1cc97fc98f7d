"""A user's own stacked layers under every pipeline schedule: one device's loss and gradients.

``meshkit.pipeline_loss`` (1F1B, GPipe, interleaved) on stacked tensor-parallel blocks
and a head of the user's, against the layers applied in order with no mesh; the
pipeline's collective-permutes stay on the pipeline axis; ``meshkit.pipeline`` under
``interleaved`` keeps the user's layer order; every bad argument is a one-line error.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import meshkit
from meshkit import collectives

D, F, V, L, M, B = 8, 16, 8, 4, 4, 16  # width, hidden, vocab, layers, microbatches, rows


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        # The hidden units split like attention heads over the tensor axis (Megatron).
        self.up = meshkit.ColumnParallelLinear(D, F, out_axes="heads", rngs=rngs)
        self.down = meshkit.RowParallelLinear(F, D, in_axes="heads", rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jnp.tanh(self.up(h)))


class Toy(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(rngs=rngs)

        self.blocks = stack(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)


def _xent(head: nnx.Linear, h: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(head(h), y).mean()


def _make() -> Toy:
    with nnx.use_eager_sharding(False):
        return Toy(rngs=nnx.Rngs(0))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(B, D)).astype(np.float32),
            rng.integers(0, V, B).astype(np.int32))


def _in_order(model: Toy, x: jax.Array, y: jax.Array) -> jax.Array:
    graphdef, state = nnx.split(model.blocks)
    for i in range(L):
        x = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(x)
    return _xent(model.head, x, y)


@pytest.fixture(scope="module")
def reference() -> tuple[jax.Array, list[np.ndarray]]:
    """Loss and gradients (layers, head, x) of the layers in order on one device."""
    x, y = _data()
    value, grads = nnx.jit(nnx.value_and_grad(_in_order, argnums=(0, 1)))(_make(), x, y)
    return value, [np.asarray(g) for g in jax.tree.leaves(grads)]


LAYOUTS: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "pp2-dp4": ({"pp": 2, "dp": 4}, {"pipeline": "pp", "data": "dp"}),
    "pp2-dp2-tp2": ({"pp": 2, "dp": 2, "tp": 2}, {"pipeline": "pp", "data": "dp", "tensor": "tp"}),
}


@pytest.mark.parametrize(("layout", "schedule"), [
    ("pp2-dp4", "1f1b"), ("pp2-dp4", "gpipe"), ("pp2-dp4", "interleaved"),
    ("pp2-dp2-tp2", "1f1b")])
def test_pipeline_loss_matches_layers_in_order(reference: tuple[jax.Array, list[np.ndarray]],
                                               layout: str, schedule: str) -> None:
    axes, roles = LAYOUTS[layout]
    v = 2 if schedule == "interleaved" else 1
    mesh = meshkit.Strategy.from_axes(axes).mesh()
    rules = meshkit.ShardingRules(**roles)
    x, y = _data()

    def objective(model: Toy, x: jax.Array, y: jax.Array) -> jax.Array:
        return meshkit.pipeline_loss(model.blocks, x, y, loss=_xent, head=model.head,
                                     microbatches=M, schedule=schedule, virtual_stages=v)

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        model = meshkit.shard_model(_make(), mesh, rules)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda s, x, y: nnx.value_and_grad(objective, argnums=(0, 1))(
            nnx.merge(graphdef, s), x, y))
        rows = NamedSharding(mesh, rules.spec("batch"))
        x, y = jax.device_put(x, rows), jax.device_put(y, rows)
        compiled = step.lower(state, x, y).compile()
        value, grads = compiled(state, x, y)
    want_value, want_grads = reference
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
    # pp is the mesh's first axis in both layouts: device i of stage 0 is device i + 4 of
    # stage 1. Every source-target pair joins the two stages' same-index devices (the
    # interleaved ring sends both ways in one permute).
    pairs = Counter(pair for c in collectives(compiled) if c.op == "collective-permute"
                    for pair in c.groups)
    assert pairs and all(abs(a - b) == 4 for a, b in pairs), pairs
    # Interleaved: each stage's chunks arrive by those permutes, no stage gathers all layers.
    ops = Counter(c.op for c in collectives(compiled))
    assert ops["all-gather"] == ops["all-to-all"] == 0, ops


def test_interleaved_pipeline_keeps_the_users_layer_order() -> None:
    """Stacked arrays and ``apply``, 8 layers in 2 chunks per stage of 4 (stages send
    different numbers of chunks to each other): ``pipeline`` and its gradient equal the
    layers in order's, the weights in the user's order."""
    stages = 4
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(8, D, D)) / np.sqrt(D), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)

    def in_order(w: jax.Array, x: jax.Array) -> jax.Array:
        for i in range(8):
            x = _layer(w[i], x)
        return jnp.sum(x**2)

    def pipelined(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(meshkit.pipeline(w, x, microbatches=4, apply=_layer,
                                        schedule="interleaved", virtual_stages=2,
                                        axis="pp") ** 2)

    want = jax.value_and_grad(in_order)(w, x)
    mesh = meshkit.Strategy.from_axes({"pp": stages, "dp": 8 // stages}).mesh()
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(pipelined))(w, x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _layer(w: jax.Array, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ w)


@pytest.mark.parametrize(("call", "kwargs", "message"), [
    ("pipeline", {"schedule": "zigzag"}, r"pipeline: unknown schedule 'zigzag'; valid: gpipe, "),
    ("pipeline_loss", {"schedule": "zigzag"}, r"pipeline_loss: unknown schedule 'zigzag'"),
    ("pipeline", {"schedule": "interleaved", "virtual_stages": 3},
     r"virtual_stages=3 does not divide the 4 layers per stage"),
    ("pipeline_loss", {"schedule": "interleaved", "virtual_stages": 0},
     r"virtual_stages must be an integer >= 1, got 0"),
    ("pipeline_loss", {"virtual_stages": 2},
     r"virtual_stages=2 needs schedule 'interleaved', got '1f1b'"),
    ("pipeline", {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 1},
     r"microbatches=1 is fewer than the 2 stages the interleaved schedule needs"),
    ("pipeline_loss", {"microbatches": 3}, r"microbatches=3 does not divide the batch 16"),
    ("pipeline_loss", {"targets": np.zeros(8, np.int32)},
     r"pipeline_loss: targets have 8 rows, x has 16"),
])
def test_bad_arguments_are_one_line_errors(call: str, kwargs: dict[str, Any], message: str) -> None:
    w, x = jnp.zeros((8, D, D)), jnp.zeros((B, D))
    args = {"microbatches": 2, "apply": _layer, "axis": "pp", **kwargs}
    targets = args.pop("targets", np.zeros(B, np.int32))
    mesh = meshkit.Strategy.from_axes({"pp": 2, "dp": 4}).mesh()
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message) as caught:
        if call == "pipeline":
            meshkit.pipeline(w, x, **args)
        else:
            meshkit.pipeline_loss(w, x, targets, loss=lambda h, y: jnp.sum(h), **args)
    assert "\n" not in str(caught.value)


def test_pipeline_sends_1f1b_to_pipeline_loss() -> None:
    with pytest.raises(NotImplementedError, match=r"meshkit\.pipeline_loss"):
        meshkit.pipeline(jnp.zeros((2, D, D)), jnp.zeros((B, D)), microbatches=2,
                         apply=_layer, schedule="1f1b")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_loss_without_a_mesh_is_the_layers_in_order(schedule: str) -> None:
    """No pipeline axis: one stage runs every layer (stacked arrays, no ``head``;
    interleaved: 2 chunks of 2 layers)."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(size=(4, D, D)) / np.sqrt(D), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)

    def mse(h: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((h - y) ** 2)

    def in_order(w: jax.Array, x: jax.Array) -> jax.Array:
        for i in range(4):
            x = _layer(w[i], x)
        return mse(x, y)

    v = 2 if schedule == "interleaved" else 1
    got = jax.jit(jax.value_and_grad(lambda w, x: meshkit.pipeline_loss(
        w, x, y, loss=mse, microbatches=2, apply=_layer, schedule=schedule,
        virtual_stages=v), argnums=(0, 1)))(w, x)
    want = jax.value_and_grad(in_order, argnums=(0, 1))(w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_loss_has_aux_means_metrics_and_sums_counts(schedule: str) -> None:
    """``has_aux``: a float metric is the mean over microbatches (here the batch's mean),
    an integer one the sum; the loss and its gradient are as without it."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(2, D, D)) / np.sqrt(D), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)

    def mse(h: jax.Array, y: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return jnp.mean((h - y) ** 2), {"h_ms": jnp.mean(h * h), "rows": jnp.int32(h.shape[0])}

    def run(w: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return meshkit.pipeline_loss(w, x, y, loss=mse, microbatches=4, apply=_layer,
                                     schedule=schedule, has_aux=True)

    (value, metrics), grad = jax.jit(jax.value_and_grad(run, has_aux=True))(w)
    h = _layer(w[1], _layer(w[0], x))
    np.testing.assert_allclose(float(value), float(mse(h, y)[0]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["h_ms"]), float(jnp.mean(h * h)), rtol=1e-5)
    assert int(metrics["rows"]) == B and metrics["rows"].dtype == jnp.int32
    want = jax.grad(lambda w: mse(_layer(w[1], _layer(w[0], x)), y)[0])(w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-6)
