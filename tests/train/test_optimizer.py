"""The fused clip + AdamW update equals optax's chain, state and updates, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshkit.config import Config
from meshkit.training import make_lr, make_optimizer
from meshkit.training.optimizer import clipped_adamw


def reference(config: Config) -> optax.GradientTransformation:
    """The optimizer as it was before the fusion: optax's chain."""
    t = config.train
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(make_lr(config), b1=0.9, b2=0.95, weight_decay=t.weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)),
    )


def assert_trees_close(actual, expected) -> None:
    # Clipping multiplies by clip / norm where optax computes (g / norm) * clip: an ulp
    # apart, which a moment's cancellation (0.1 g + 0.9 mu, opposite signs) can lift just
    # above 1e-6 relative on a near-zero element. Hence atol: 1e-7 of the leaf's largest.
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        e = np.asarray(e)
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-6, atol=1e-7 * np.abs(e).max())


@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_fused_update_equals_the_chain(weight_decay: float) -> None:
    # Warmup 2 of 5 steps: step 0 (lr 0), warmup, then the cosine. A 1-d leaf (no decay).
    config = Config.from_dict({"train": {"steps": 5, "warmup_steps": 2, "lr": 0.1,
                                         "weight_decay": weight_decay, "grad_clip": 1.0}})
    fused, chain = make_optimizer(config), reference(config)
    keys = iter(jax.random.split(jax.random.key(0), 32))
    params = {"w": jax.random.normal(next(keys), (3, 4)),
              "block": [{"kernel": jax.random.normal(next(keys), (2, 4, 2))},
                        {"scale": jax.random.normal(next(keys), (4,))}]}
    state, expected_state = fused.init(params), chain.init(params)
    assert_trees_close(state, expected_state)
    fused_params, chain_params = params, params
    # Global norms of about 10 (clipped) and 0.05 (not), alternating.
    for step, size in enumerate([3.0, 0.01, 3.0, 0.01, 3.0]):
        grads = jax.tree.map(lambda p, s=size: s * jax.random.normal(next(keys), p.shape),
                             params)
        norm = float(optax.tree.norm(grads))
        assert (norm > config.train.grad_clip) == (size > 1), norm
        updates, state = jax.jit(fused.update)(grads, state, fused_params)
        expected, expected_state = jax.jit(chain.update)(grads, expected_state, chain_params)
        assert_trees_close(updates, expected)
        assert_trees_close(state, expected_state)
        if step > 0:  # step 0's learning rate is 0
            assert float(optax.tree.norm(updates)) > 0
        fused_params = optax.apply_updates(fused_params, updates)
        chain_params = optax.apply_updates(chain_params, expected)
    assert int(state[1][2].count) == 5 and float(make_lr(config)(4)) < config.train.lr


def test_update_needs_params() -> None:
    tx = clipped_adamw(optax.constant_schedule(1e-3), grad_clip=1.0, b1=0.9, b2=0.95,
                       weight_decay=0.1, decay=lambda p: p.ndim >= 2)
    params = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="clipped_adamw: update needs params"):
        tx.update(params, tx.init(params))
