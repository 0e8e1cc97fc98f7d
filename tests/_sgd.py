"""Shared by the layout-parity tests: plain SGD steps of meshkit's transformer from given
initial parameters, with each step's loss and gradients brought to the host."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshkit.config import Config
from meshkit.model.transformer import Transformer
from meshkit.sharding.place import shard_model
from meshkit.sharding.rules import ShardingRules

Run = tuple[list[float], list[dict[str, np.ndarray]]]


def sgd_run(config: Config, initial: dict[str, Any], steps: int) -> Run:
    """Losses and gradients of ``steps`` SGD steps (learning rate 0.5) on one random
    batch, from ``initial`` (``nnx.to_pure_dict`` of a one-device model), one compile."""
    t = config.train
    batch = jnp.asarray(np.random.default_rng(0).integers(
        0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32))

    @nnx.jit
    def step(model: Transformer) -> tuple[jax.Array, nnx.State]:
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch)[0])(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))
        return loss, grads

    mesh = config.strategy().mesh()
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer.from_config(config)))
    nnx.replace_by_pure_dict(state, initial)
    model = shard_model(nnx.merge(graphdef, state), mesh, ShardingRules.from_config(config))
    losses, grads = [], []
    with jax.set_mesh(mesh):
        for _ in range(steps):
            loss, g = step(model)
            losses.append(float(loss))
            grads.append({jax.tree_util.keystr(p): np.asarray(v)
                          for p, v in jax.tree_util.tree_leaves_with_path(g)})
    return losses, grads


def assert_same_run(got: Run, want: Run) -> None:
    """Two runs' losses and every gradient equal to rtol 1e-5 (each gradient's absolute
    tolerance 1e-6 of its largest value, for its near-zero entries)."""
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for got_grads, want_grads in zip(got[1], want[1], strict=True):
        assert got_grads.keys() == want_grads.keys()
        for key, value in want_grads.items():
            np.testing.assert_allclose(got_grads[key], value, rtol=1e-5,
                                       atol=1e-6 * np.abs(value).max(), err_msg=key)
