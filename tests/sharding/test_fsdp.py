"""FSDP for plain Flax layers (``meshkit.FSDP``): a bonsai-style Qwen3 of ``nnx.Linear``,
``nnx.Einsum`` and ``nnx.Embed`` gathers each weight just before use and reduce-scatters
its gradient, in one's own loop (``shard_model``) and in the trainer, with one device's
loss."""

from __future__ import annotations

from collections import Counter

import _user_qwen3 as qwen3
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit.config import load_config
from meshkit.training import train

EVERYTHING = ((0, 1, 2, 3, 4, 5, 6, 7),)


def _value_and_grad(model, batch):
    (value, _), grads = nnx.value_and_grad(qwen3.loss, has_aux=True)(model, batch)
    return value, grads


@pytest.fixture(scope="module")
def fsdp8():
    """One device's loss and gradients, and the same step compiled under fsdp8."""
    batch = qwen3.batch()
    want = nnx.jit(_value_and_grad)(qwen3.make(nnx.Rngs(0)), batch)
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp").extend(**qwen3.LOGICAL)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        model = meshkit.shard_model(qwen3.make(nnx.Rngs(0)), mesh, rules)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda s, b: _value_and_grad(nnx.merge(graphdef, s), b))
        placed = jax.device_put(batch, NamedSharding(mesh, rules.spec("batch", None)))
        compiled = step.lower(state, placed).compile()
        got = compiled(state, placed)
    return want, got, compiled, state


def test_fsdp8_matches_one_device(fsdp8):
    want, got, _, _ = fsdp8
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_every_sharded_weight_is_gathered_and_its_gradient_reduce_scattered(fsdp8):
    _, _, compiled, state = fsdp8
    ops = meshkit.collectives(compiled)
    kinds = Counter(c.op for c in ops)
    assert kinds["all-to-all"] == 0, kinds
    assert {c.groups for c in ops} == {EVERYTHING}
    # One reduce-scatter per fsdp-sharded weight, shaped like its local shard.
    sharded = sorted(tuple(leaf.addressable_shards[0].data.shape)
                     for leaf in jax.tree.leaves(nnx.state(state, nnx.Param))
                     if leaf.sharding.spec and any(leaf.sharding.spec))
    scattered = sorted(c.shape for c in ops if c.op == "reduce-scatter")
    assert scattered == sharded and len(sharded) == 2 * 7 + 2
    assert kinds["all-gather"] == len(sharded)


@pytest.mark.parametrize(
    ("axes", "roles", "fsdp_groups"),
    [
        ({"dp": 2, "fsdp": 4}, {"data": "dp", "fsdp": "fsdp"}, ((0, 1, 2, 3), (4, 5, 6, 7))),
        # Tensor axes stay automatic inside the wrapped call (XLA's own tensor collectives).
        ({"fsdp": 4, "tp": 2}, {"fsdp": "fsdp", "tensor": "tp"}, ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_with_data_or_tensor_axes_the_gradients_reduce_scatter_over_the_fsdp_groups(
        fsdp8, axes, roles, fsdp_groups):
    want = fsdp8[0]
    mesh = meshkit.Strategy.from_axes(axes).mesh()
    rules = meshkit.ShardingRules(**roles).extend(**qwen3.LOGICAL)
    batch = qwen3.batch()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        graphdef, state = nnx.split(meshkit.shard_model(qwen3.make(nnx.Rngs(0)), mesh, rules))
        step = jax.jit(lambda s, b: _value_and_grad(nnx.merge(graphdef, s), b))
        placed = jax.device_put(batch, NamedSharding(mesh, rules.spec("batch", None)))
        compiled = step.lower(state, placed).compile()
        value, _ = compiled(state, placed)
    np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
    scattered = Counter(c.groups for c in meshkit.collectives(compiled)
                        if c.op == "reduce-scatter")
    assert scattered == {fsdp_groups: 2 * 7 + 2}


def test_stacked_blocks_under_scan_gather_inside_the_loop_body():
    batch = qwen3.batch()
    want = nnx.jit(_value_and_grad)(qwen3.make(nnx.Rngs(0), stacked=True), batch)
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp").extend(**qwen3.LOGICAL)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        model = meshkit.shard_model(qwen3.make(nnx.Rngs(0), stacked=True), mesh, rules)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda s, b: _value_and_grad(nnx.merge(graphdef, s), b))
        placed = jax.device_put(batch, NamedSharding(mesh, rules.spec("batch", None)))
        compiled = step.lower(state, placed).compile()
        value, _ = compiled(state, placed)
    np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
    kinds = Counter(c.op for c in meshkit.collectives(compiled))
    # One block's 7 weights in the scanned body (run once per layer), the embedding, the head.
    assert kinds["reduce-scatter"] == kinds["all-gather"] == 7 + 2, kinds
    assert kinds["all-to-all"] == 0, kinds


RUN = ["train.batch_size=8", f"train.seq_len={qwen3.SEQ}", "train.steps=2",
       "train.warmup_steps=0", "train.log_every=1", "train.eval_every=1000",
       "train.eval_batches=1", f"model.vocab_size={qwen3.VOCAB}",
       "exchange.node_axis=[]", "exchange.device_axis=[]",
       "parallel.logical_axes={" + ", ".join(f"{k}: {v}" for k, v in qwen3.LOGICAL.items()) + "}"]


def _losses(tmp_path, layout: list[str]) -> list[float]:
    config = load_config(None, [*RUN, *layout, f"train.workdir={tmp_path}"])
    result = train(config, model=qwen3.make, loss=qwen3.loss, verbose=False, progress=False)
    return [value for _, value in result.losses]


def test_the_trainer_trains_it_under_fsdp8_with_one_devices_losses(tmp_path):
    one = _losses(tmp_path / "one", ["mesh.axes={dp: 1}"])
    fsdp = _losses(tmp_path / "fsdp", ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp"])
    assert len(one) == 2
    np.testing.assert_allclose(fsdp, one, rtol=1e-5)


def test_an_unknown_logical_name_is_named_with_its_parameter():
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp")  # q_heads, kv_heads, hid not extended
    with nnx.use_eager_sharding(False):
        layer = meshkit.FSDP(nnx.Linear(4, 8, kernel_metadata={"out_sharding": ("embed", "hid")},
                                        rngs=nnx.Rngs(0)))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()), pytest.raises(
            ValueError, match=r"meshkit.FSDP: parameter 'kernel': logical axis 'hid' .*"
                              r"rules.extend\(hid=...\)"):
        layer(np.ones((8, 4), np.float32))


def test_gather_fsdp_takes_logical_names():
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp")
    w = np.arange(32, dtype=np.float32).reshape(16, 2)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        whole = jax.shard_map(lambda w: meshkit.gather_fsdp(w, ("embed", None)),
                              in_specs=P("fsdp"), out_specs=P("fsdp"))(w)
    np.testing.assert_array_equal(np.asarray(whole), np.tile(w, (8, 1)))


def test_gather_fsdp_without_axes_or_rules_says_what_to_pass():
    with pytest.raises(ValueError, match=r"gather_fsdp: no fsdp_axes given and no logical "
                                         r"rule for 'batch' in effect; pass fsdp_axes"):
        meshkit.gather_fsdp(np.ones((2, 2), np.float32), ("embed", None))
