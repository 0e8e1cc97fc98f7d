"""Transformer LM: shapes, causality, sharded creation, a jitted gradient step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from meshkit.config import ConfigError, ExchangeConfig, ModelConfig
from meshkit.model.transformer import Transformer, rotary
from meshkit.sharding.rules import ShardingRules

AXES = ("node", "device")
V, D, L, H, F, E, K = 32, 16, 2, 2, 32, 8, 2
B, T = 8, 8
# Capacity = every local token: nothing is dropped, so tokens cannot interact through
# the experts' capacity and causality is exact.
NO_DROP = E / K


def _build():
    config = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=H, d_ff=F,
                         num_experts=E, top_k=K, capacity_factor=NO_DROP)
    return Transformer(
        config,
        ShardingRules(node="node", device="device"),
        exchange=ExchangeConfig(method="hierarchical"),
        rngs=nnx.Rngs(0),
    )


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def model(mesh):
    # The trainer's recipe: create inside jit under the mesh, constrain the state to its
    # partition specs (already implied by the parameters' out_sharding metadata).
    @nnx.jit
    def create():
        model = _build()
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        return create()


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, V)


def test_expert_weights_sharded_rest_replicated(model):
    w = model.layers.moe.w_up[...]  # [L, E, D, F]: layers stacked, experts split
    assert {s.data.shape for s in w.addressable_shards} == {(L, E // 8, D, F)}
    assert {s.index[1].start for s in w.addressable_shards} == set(range(E))
    head = model.head[...]
    assert {s.data.shape for s in head.addressable_shards} == {(D, V)}
    assert len(head.addressable_shards) == 8


@pytest.fixture(scope="module")
def step():
    """One jitted program: logits and stats, the LM loss, its grads, an SGD update."""

    @nnx.jit
    def step(m, tokens, lr):
        def loss_fn(m):
            logits, stats = m(tokens)
            logp = jax.nn.log_softmax(logits[:, :-1])
            ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
            return ce + stats.router_loss, (logits, stats)

        (loss, (logits, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m)
        params = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree.map(lambda p, g: p - lr * g, params, grads))
        return logits, stats, loss, grads

    return step


def test_logits_shape_stats_and_causality(model, step, tokens, mesh):
    m = nnx.clone(model)
    t = 4
    changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % V)
    with jax.set_mesh(mesh):
        logits, stats, _, _ = step(m, tokens, 0.0)  # lr 0: the weights stay put
        logits2, _, _, _ = step(m, changed, 0.0)
    assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
    assert stats.expert_load.shape == (L, E)
    np.testing.assert_allclose(stats.expert_load.sum(-1), 1.0, rtol=1e-6)
    assert int(stats.dropped) == 0
    assert int(stats.assignments) == L * B * T * K
    assert float(stats.router_loss) == pytest.approx(
        0.01 * float(stats.aux_loss) + 0.001 * float(stats.z_loss), rel=1e-6
    )
    np.testing.assert_array_equal(logits2[:, : t + 1], logits[:, : t + 1])
    assert not np.allclose(logits2[:, t + 1], logits[:, t + 1])


def test_jitted_grad_step_under_mesh(model, step, tokens, mesh):
    m = nnx.clone(model)
    with jax.set_mesh(mesh):
        losses = []
        for _ in range(3):
            _, _, loss, grads = step(m, tokens, 0.3)
            losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    g = grads["layers"]["moe"]["w_down"].get_value()
    assert {s.data.shape for s in g.addressable_shards} == {(L, E // 8, F, D)}
    w = m.layers.moe.w_down[...]  # the update kept the expert sharding
    assert {s.data.shape for s in w.addressable_shards} == {(L, E // 8, F, D)}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_heads": 3}, "model.d_model: 16 is not divisible by model.num_heads=3"),
        ({"d_model": 12, "num_heads": 4}, "head size d_model / num_heads = 3 must be even"),
        ({"vocab_size": 0}, "model.vocab_size"),
        ({"top_k": 0}, "model.top_k"),
    ],
)
def test_bad_sizes_are_config_errors(kw, match):
    # The model does not re-check its config's fields: the config refuses them.
    args = dict(vocab_size=V, d_model=D, num_layers=L, num_heads=H, d_ff=F, num_experts=E)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**args)


def test_microbatches_error():
    config = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=H, d_ff=F,
                         num_experts=E)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        Transformer(config, microbatches=0, rngs=nnx.Rngs(0))


def test_call_and_rotary_errors(model, mesh):
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"\[B, T\] integer array"):
        model(jnp.zeros((B, T)))
    with pytest.raises(ValueError, match="even head dimension, got 3"):
        rotary(jnp.ones((1, 2, 1, 3)))


def test_rotary_preserves_norm_and_relative_dot():
    q = jax.random.normal(jax.random.key(0), (1, 6, 1, 4))
    rq = rotary(jnp.broadcast_to(q[:, :1], q.shape))  # same vector at every position
    np.testing.assert_allclose(
        jnp.linalg.norm(rq, axis=-1),
        jnp.linalg.norm(q[:, :1], axis=-1) * jnp.ones((1, 6, 1)),
        rtol=1e-5,
    )
    dots = jnp.einsum("bthk,bshk->ts", rq, rq)
    # Equal vectors at offsets (0, 2) and (3, 5) have the same dot product.
    assert float(dots[0, 2]) == pytest.approx(float(dots[3, 5]), rel=1e-5)
