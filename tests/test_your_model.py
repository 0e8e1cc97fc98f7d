"""A user's own model on meshkit: every layout matches one device, with the groups stated.

The model (``tests/_user_gpt.py``) is one meshkit never saw: its own parameter and
logical names, a GELU MLP, a fused QKV projection. It uses only meshkit's public API:
``ShardingRules.extend``, ``shard_model``, the parallel projections, ``pipeline`` and
``meshkit.collectives``.
"""

from __future__ import annotations

from collections import Counter

import _user_gpt
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import meshkit
from meshkit import collectives


def _value_and_grad(model: nnx.Module, batch: jax.Array) -> tuple[jax.Array, nnx.State]:
    (value, _), grads = nnx.value_and_grad(_user_gpt.loss, has_aux=True)(model, batch)
    return value, grads


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients on one device, no mesh: the answer every layout must give."""
    batch = _user_gpt.batch()
    one_device = nnx.jit(_value_and_grad)
    flat = one_device(_user_gpt.make(nnx.Rngs(0)), batch)
    stacked = one_device(_user_gpt.make(nnx.Rngs(0), layers=2, microbatches=2), batch)
    return batch, {"flat": flat, "stacked": stacked}


def _run(axes: dict[str, int], roles: dict[str, str], batch: np.ndarray, **kwargs: int):
    """Loss, gradients and the compiled step of the user model on a layout."""
    strategy = meshkit.Strategy.from_axes(axes)
    mesh = strategy.mesh()
    rules = meshkit.ShardingRules(**roles).extend(**_user_gpt.LOGICAL)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        model = meshkit.shard_model(_user_gpt.make(nnx.Rngs(0), **kwargs), mesh, rules)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda state, b: _value_and_grad(nnx.merge(graphdef, state), b))
        placed = jax.device_put(batch, NamedSharding(mesh, rules.spec("batch", None)))
        compiled = step.lower(state, placed).compile()
        value, grads = compiled(state, placed)
    return value, grads, compiled


def _assert_matches(got, want) -> None:
    value, grads = got
    np.testing.assert_allclose(float(value), float(want[0]), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-7)


def _groups(compiled, op: str) -> Counter:
    return Counter(c.groups for c in collectives(compiled) if c.op == op)


TP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DP_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


def test_dp_tp_matches_one_device_with_megatrons_all_reduces(reference):
    batch, want = reference
    value, grads, compiled = _run({"dp": 2, "tp": 4}, {"data": "dp", "tensor": "tp"}, batch)
    _assert_matches((value, grads), want["flat"])
    ops = Counter(c.op for c in collectives(compiled))
    # The fused QKV splits on its heads: no resharding anywhere in the step.
    assert ops["all-to-all"] == 0 and ops["collective-permute"] == 0, ops
    all_reduces = _groups(compiled, "all-reduce")
    assert set(all_reduces) <= {TP_GROUPS, DP_GROUPS}, all_reduces
    # Forward: one per attention and MLP block and one for the embedding; the
    # cross-entropy over vocab-split logits: its max and its sum; backward: one per
    # column-parallel input (QKV, fc_in, lm_head).
    blocks = 2 * _user_gpt.LAYERS + 1
    assert all_reduces[TP_GROUPS] == blocks + 2 + blocks, all_reduces
    # Gradients of weights replicated over dp are summed over the dp groups.
    assert all_reduces[DP_GROUPS] >= 1, all_reduces


def test_dp_tp_forward_has_one_all_reduce_per_block():
    strategy = meshkit.Strategy.from_axes({"dp": 2, "tp": 4})
    mesh = strategy.mesh()
    rules = meshkit.ShardingRules(data="dp", tensor="tp").extend(**_user_gpt.LOGICAL)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        model = meshkit.shard_model(_user_gpt.make(nnx.Rngs(0)), mesh, rules)
        graphdef, state = nnx.split(model)
        tokens = jax.ShapeDtypeStruct((8, _user_gpt.SEQ), np.int32,
                                      sharding=NamedSharding(mesh, rules.spec("batch", None)))
        compiled = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).compile()
    # Attention out + MLP out per block, and the vocab-parallel embedding.
    assert _groups(compiled, "all-reduce") == {TP_GROUPS: 2 * _user_gpt.LAYERS + 1}


def test_fsdp_gathers_weights_and_reduce_scatters_gradients(reference):
    batch, want = reference
    value, grads, compiled = _run({"fsdp": 8}, {"fsdp": "fsdp"}, batch)
    _assert_matches((value, grads), want["flat"])
    ops = collectives(compiled)
    everything = ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert {c.groups for c in ops} == {everything}
    kinds = Counter(c.op for c in ops)
    assert kinds["all-gather"] >= 1 and kinds["reduce-scatter"] >= 1, kinds
    # No parameter-sized all-reduce: the smallest matrix is WIDTH x WIDTH float32 / 8.
    smallest = _user_gpt.WIDTH * _user_gpt.WIDTH * 4
    assert [c.bytes for c in ops if c.op == "all-reduce" and c.bytes >= smallest] == []


def test_pipeline_over_data_parallel_matches_one_device(reference):
    batch, want = reference
    value, grads, compiled = _run({"pp": 2, "dp": 4}, {"data": "dp", "pipeline": "pp"}, batch,
                                  layers=2, microbatches=2)
    _assert_matches((value, grads), want["stacked"])
    permutes = [c.groups for c in collectives(compiled) if c.op == "collective-permute"]
    # Stage 0 → stage 1 (forward) and back (backward), between same-index dp devices.
    assert permutes and {frozenset(g) for g in permutes} <= {
        frozenset((s, s + 4) for s in range(4)), frozenset((s + 4, s) for s in range(4))}


def test_pipeline_with_tensor_parallel_stages_matches_one_device(reference):
    batch, want = reference
    value, grads, _ = _run({"pp": 2, "dp": 2, "tp": 2},
                           {"data": "dp", "pipeline": "pp", "tensor": "tp"}, batch,
                           layers=2, microbatches=2)
    _assert_matches((value, grads), want["stacked"])


def test_node_device_with_the_users_moe_matches_one_device():
    batch = _user_gpt.batch()
    one = {"node": 1, "device": 1}
    want = _run(one, {"node": "node", "device": "device"}, batch, experts=8)
    value, grads, compiled = _run({"node": 2, "device": 4}, {"node": "node", "device": "device"},
                                  batch, experts=8)
    _assert_matches((value, grads), want[:2])
    exchanges = _groups(compiled, "all-to-all")
    # The two-stage exchange: across nodes between same-index devices, then in a node.
    assert set(exchanges) == {DP_GROUPS, TP_GROUPS}, exchanges


def test_unknown_logical_name_is_named_with_its_parameter():
    mesh = meshkit.Strategy.from_axes({"dp": 8}).mesh()
    culprit = r"parameter 'blocks/0/mlp/fc_in/bias': unknown logical axis 'ffn'"
    with pytest.raises(ValueError, match=culprit):
        meshkit.shard_model(_user_gpt.make(nnx.Rngs(0)), mesh,
                            meshkit.ShardingRules(data="dp").extend(width=None, nheads=None,
                                                                   vocab_rows=None))


def test_cp4_with_context_attention_matches_one_device(reference):
    """The user's attention through meshkit.context_attention (the ring), its tokens in
    zigzag order: dp2 × cp4 gives one device's loss and gradients, and the K/V blocks
    travel round the context groups only."""
    batch, want = reference
    roles = {"data": "dp", "context": "cp"}
    context = meshkit.ShardingRules(**roles).extend(**_user_gpt.LOGICAL)
    value, grads, compiled = _run({"dp": 2, "cp": 4}, roles, batch, context=context)
    _assert_matches((value, grads), want["flat"])
    cp = {(r, (r + 1) % 4 + 4 * (r // 4)) for r in range(8)}  # ring successors in a cp group
    permutes = {pair for c in collectives(compiled) if c.op == "collective-permute"
                for pair in c.groups}
    assert permutes and permutes <= cp | {(b, a) for a, b in cp}
