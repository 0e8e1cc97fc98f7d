"""MoE layer: routing, capacity, dispatch plan, losses, exchange, expert sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _moe_reference import B, D, E, F, K, T, _np_route, _reference, _variant
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange.capacity import capacity
from meshkit.exchange.slots import _cumsum_plan, dispatch_plan
from meshkit.model.moe import MoE
from meshkit.model.router import load_balancing_loss, route, router_z_loss
from meshkit.sharding.place import shard_model
from meshkit.sharding.rules import ShardingRules

AXES = ("node", "device")
RULES = ShardingRules(node="node", device="device")


def _mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def mesh24():
    return _mesh((2, 4))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(7), (B, T, D), jnp.float32)


@pytest.fixture(scope="module")
def model(mesh24):
    """Built inside nnx.jit under the mesh: parameters are created sharded."""
    with jax.set_mesh(mesh24):
        return nnx.jit(
            lambda: MoE(
                ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=2.0),
                RULES,
                exchange=ExchangeConfig(method="flat"),
                rngs=nnx.Rngs(0),
            )
        )()


def _grads(model, x, mesh):
    weights = jax.random.normal(jax.random.key(3), x.shape)

    def loss(m, x):
        y, s = m(x)
        return jnp.sum(y * weights) + s.aux_loss + s.z_loss, (y, s)

    with jax.set_mesh(mesh):
        (g_model, g_x), (y, stats) = nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))(model, x)
    return nnx.state(g_model), g_x, y, stats


@pytest.fixture(scope="module")
def sort_run(model, x, mesh24):
    return _grads(model, x, mesh24)


# ------------------------------------------------------------------ pure functions
def test_capacity_formula():
    assert capacity(6, num_experts=2, top_k=1, capacity_factor=1.0) == 3
    assert capacity(8, num_experts=4, top_k=2, capacity_factor=1.25) == 5
    # the exact decimal product: no float round-up
    assert capacity(10, num_experts=11, top_k=1, capacity_factor=1.1) == 1
    assert capacity(7, num_experts=4, top_k=1, capacity_factor=1.0) == 2


def test_dispatch_plan_top1_hand_made():
    idx = jnp.array([[0], [0], [1], [0], [1], [1]])
    slot, keep = dispatch_plan(idx, 2, 2)
    assert slot[:, 0].tolist() == [0, 1, 0, 2, 1, 2]
    assert keep[:, 0].tolist() == [True, True, True, False, True, False]
    assert int((~keep).sum()) == 2


def test_dispatch_plan_top2_first_choices_win():
    # First choices fill expert 0 with tokens 0, 1, 3, 5 and expert 1 with 2, 4; only
    # then do second choices queue up, so all of them overflow capacity 2.
    idx = jnp.array([[0, 1], [0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    slot, keep = dispatch_plan(idx, 2, 2)
    assert slot.tolist() == [[0, 2], [1, 3], [0, 4], [2, 4], [1, 5], [3, 5]]
    assert keep[:, 0].tolist() == [True, True, True, False, True, False]
    assert not keep[:, 1].any()
    assert int((~keep).sum()) == 8
    # The GShard cumulative-count plan (used by dispatch="einsum") agrees.
    np.testing.assert_array_equal(_cumsum_plan(idx, 2), slot)


def test_route_gates():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]))
    idx, gate, probs = route(logits, 2)
    assert idx.tolist() == [[0, 1], [2, 1]]
    np.testing.assert_allclose(gate, [[0.625, 0.375], [7 / 9, 2 / 9]], rtol=1e-6)
    np.testing.assert_allclose(probs, [[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]], rtol=1e-6)
    idx, gate, _ = route(logits, 1)
    assert idx.tolist() == [[0], [2]]
    np.testing.assert_allclose(gate, [[0.5], [0.7]], rtol=1e-6)  # not renormalised


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("max_nodes", [1, 2, None])
def test_route_node_limited(top_k, max_nodes):
    # 4 nodes of 4 experts; 64 random tokens.
    logits = np.asarray(jax.random.normal(jax.random.key(top_k), (64, 16)) * 2, np.float32)
    if max_nodes == 1 and top_k == 8:
        with pytest.raises(ValueError, match="fewer than top_k=8"):
            route(jnp.asarray(logits), top_k, num_nodes=4, max_nodes=max_nodes)
        return
    idx, gate, probs = route(jnp.asarray(logits), top_k, num_nodes=4, max_nodes=max_nodes)
    idx, gate = np.asarray(idx), np.asarray(gate)
    spans = [len(set(row // 4)) for row in idx]
    assert max(spans) <= (max_nodes or 4)
    assert all(len(set(row)) == top_k for row in idx)  # k distinct experts
    ref_idx, ref_gate = _np_route(np.asarray(probs, np.float64), top_k, 4, max_nodes)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(gate, ref_gate, rtol=1e-6)
    if top_k >= 2:
        np.testing.assert_allclose(gate.sum(-1), 1.0, rtol=1e-6)
    if max_nodes == 1 and top_k > 1:
        # The limit binds: unlimited routing would spread some tokens over 2+ nodes.
        free = np.asarray(route(jnp.asarray(logits), top_k)[0])
        assert max(len(set(row // 4)) for row in free) > 1


def test_losses_hand_computed():
    probs = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    idx = jnp.array([[0, 1], [0, 1], [1, 0], [0, 1]])
    # f = (3/4, 1/4) from first choices, P = (0.6, 0.4): 2 * (0.45 + 0.1) = 1.1.
    assert float(load_balancing_loss(probs, idx)) == pytest.approx(1.1, rel=1e-6)
    logits = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: ln 2 and ln 4 = 2 ln 2, so mean of squares = (1 + 4)/2 · (ln 2)².
    assert float(router_z_loss(logits)) == pytest.approx(2.5 * math.log(2) ** 2, rel=1e-6)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: route(jnp.zeros((2, 4)), 0), "top_k must be an integer >= 1, got 0"),
        (lambda: route(jnp.zeros((2, 4)), 2.0), "top_k must be an integer >= 1, got 2.0"),
        (lambda: route(jnp.zeros((2, 8)), 4, num_nodes=4, max_nodes=1),
         "max_nodes=1 node.s. of 2 experts each hold fewer than top_k=4"),
        (lambda: route(jnp.zeros((2, 8)), 2, num_nodes=3, max_nodes=1),
         "num_experts=8 is not divisible by 3 nodes"),
        (lambda: route(jnp.zeros((2, 8)), 2, num_nodes=2, max_nodes=True),
         "max_nodes must be an integer >= 1 or None, got True"),
        (lambda: route(jnp.zeros((2, 1)), 2), "top_k=2 exceeds num_experts=1"),
        (lambda: route(jnp.zeros(4), 1), r"\[tokens, experts\]"),
        (lambda: capacity(8, num_experts=4, top_k=1, capacity_factor=-1.5),
         r"capacity: capacity_factor must be >= 0, got -1\.5"),
        (lambda: capacity(0, num_experts=4, top_k=1, capacity_factor=1.0),
         r"capacity: num_tokens must be positive, got 0"),
        (lambda: capacity(-8, num_experts=4, top_k=1, capacity_factor=1.0),
         r"capacity: num_tokens must be positive, got -8"),
        (lambda: capacity(8, num_experts=0, top_k=1, capacity_factor=1.0),
         r"capacity: num_experts must be positive, got 0"),
        (lambda: capacity(8, num_experts=4, top_k=0, capacity_factor=1.0),
         r"capacity: top_k must be positive, got 0"),
        (lambda: dispatch_plan(jnp.zeros(3, jnp.int32), 2, 1), r"\[tokens, k\]"),
        (lambda: dispatch_plan(jnp.zeros((3, 1), jnp.int32), 2, -1), "capacity must be"),
    ],
)
def test_pure_function_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ the layer
def test_moe_matches_per_token_reference(model, sort_run, x):
    *_, y, stats = sort_run
    ref, dropped, aux = _reference(model, x, 8)
    assert 0 < dropped < B * T * K  # the test exercises both kept and dropped paths
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)
    assert int(stats.dropped) == dropped
    assert int(stats.assignments) == B * T * K
    assert float(stats.aux_loss) == pytest.approx(aux, rel=1e-5)
    np.testing.assert_allclose(float(jnp.sum(stats.expert_load)), 1.0, rtol=1e-6)


@pytest.fixture(scope="module")
def fine(mesh24):
    """Fine-grained: top-4 of 16, one shared expert, one node per token, dropless."""
    with jax.set_mesh(mesh24):
        config = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=4, capacity_factor=0.0,
                             num_shared_experts=1, max_nodes=1)
        return nnx.jit(lambda: MoE(config, RULES, exchange=ExchangeConfig(method="hierarchical"),
                                   rngs=nnx.Rngs(5)))()


def test_fine_grained_moe_matches_reference(fine, x, mesh24):
    assert fine.shared_gate[...].shape == (D, F)
    with jax.set_mesh(mesh24):
        y, stats = nnx.jit(lambda m, x: m(x))(fine, x)
    ref, dropped, aux = _reference(fine, x, 8)
    assert dropped == 0 and int(stats.dropped) == 0
    assert int(stats.assignments) == B * T * 4
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)
    assert float(stats.aux_loss) == pytest.approx(aux, rel=1e-5)


def test_sort_and_einsum_dispatch_agree_with_grads(model, sort_run, x, mesh24):
    gm_s, gx_s, y_s, s_s = sort_run
    gm_e, gx_e, y_e, s_e = _grads(_variant(model, dispatch="einsum"), x, mesh24)
    assert int(s_s.dropped) == int(s_e.dropped) > 0
    np.testing.assert_allclose(y_s, y_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx_s, gx_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(gm_s), jax.tree.leaves(gm_e), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hierarchical_exchange_equals_flat(model, sort_run, x, mesh24):
    y_flat = sort_run[2]
    node_first = _variant(model, exchange_method="hierarchical", exchange_order="node_first")
    device_first = _variant(model, exchange_method="hierarchical", exchange_order="device_first")
    with jax.set_mesh(mesh24):
        y1, y2 = nnx.jit(lambda a, b, x: (a(x)[0], b(x)[0]))(node_first, device_first, x)
    np.testing.assert_array_equal(y1, y_flat)  # an all-to-all only moves data
    np.testing.assert_array_equal(y2, y_flat)


def test_extra_data_axis_replicates_experts_and_sums_their_grads(model, sort_run, x):
    # data × node × device = 2 × 2 × 2: experts split over node × device (4 devices),
    # replicated over data. Device i still gets batch row i, as on the 2 × 4 mesh, so
    # routing and drops are identical and so must be outputs and (data-summed) grads.
    mesh = jax.make_mesh((2, 2, 2), ("data", *AXES), axis_types=(AxisType.Auto,) * 3)
    dp = shard_model(_variant(model, rules=ShardingRules(data="data", node="node",
                                                         device="device")), mesh)
    assert {s.data.shape for s in dp.w_up[...].addressable_shards} == {(E // 4, D, F)}
    _assert_same_run(_grads(dp, x, mesh), sort_run)


def _assert_same_run(run, reference):
    """Outputs, input and weight gradients, and drops of two runs of one layer agree."""
    gm, gx, y, stats = run
    gm_ref, gx_ref, y_ref, stats_ref = reference
    assert int(stats.dropped) == int(stats_ref.dropped)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(gm), jax.tree.leaves(gm_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tensor_ranks_split_the_tokens_instead_of_repeating_them(model, sort_run, x):
    # node × device × tp = 2 × 2 × 2: the batch is split 4 ways, then each tensor rank
    # routes and runs half of its device's tokens. That is the same 6-token chunks, in
    # the same order, as 8 batch devices, so outputs, drops and grads must match; and no
    # token is counted twice.
    mesh = jax.make_mesh((2, 2, 2), (*AXES, "tp"), axis_types=(AxisType.Auto,) * 3)
    rules = ShardingRules(tensor="tp", node="node", device="device")
    tp = shard_model(_variant(model, rules=rules), mesh)
    run = _grads(tp, x, mesh)
    assert int(run[3].assignments) == B * T * K
    _assert_same_run(run, sort_run)


def test_no_expert_axes_keeps_every_expert_everywhere(model, sort_run, x):
    # Experts replicated, the batch split over one data axis of 8: nothing is exchanged,
    # and each device's 6 tokens meet the same capacity as before.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    # A new layer (its weights' metadata follows the new rules) holding the same values.
    dp = MoE(ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=2.0),
             ShardingRules(data="data"), rngs=nnx.Rngs(1))
    for name in ("router", "w_gate", "w_up", "w_down"):
        getattr(dp, name)[...] = np.asarray(getattr(model, name)[...])
    dp = shard_model(dp, mesh)
    assert {s.data.shape for s in dp.w_up[...].addressable_shards} == {(E, D, F)}
    _, _, y, stats = _grads(dp, x, mesh)
    assert int(stats.dropped) == int(sort_run[3].dropped)
    np.testing.assert_allclose(y, sort_run[2], rtol=1e-6, atol=1e-6)


def _check_expert_shards(model, mesh):
    devices = list(mesh.devices.flat)  # row-major over (node, device) = expert order
    p = len(devices)
    for w in (model.w_gate, model.w_up, model.w_down):
        full = np.asarray(w[...])
        shards = w[...].addressable_shards
        assert len(shards) == p
        owned = []
        for shard in shards:
            assert shard.data.shape == (E // p, *full.shape[1:])
            start = shard.index[0].start or 0
            assert start == devices.index(shard.device) * (E // p)
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            owned += list(range(start, start + E // p))
        assert sorted(owned) == list(range(E))  # every expert on exactly one device
    for w in (model.router,):
        assert all(s.data.shape == w[...].shape for s in w[...].addressable_shards)


def test_jit_init_under_mesh_creates_each_share(model, mesh24):
    _check_expert_shards(model, mesh24)


def test_shard_model_places_a_single_device_model(model):
    mesh = _mesh((4, 2))
    one = nnx.clone(model)
    device = jax.devices()[0]
    nnx.update(one, jax.tree.map(lambda a: jax.device_put(np.asarray(a), device), nnx.state(one)))
    assert len(one.w_up[...].addressable_shards) == 1
    shard_model(one, mesh)
    _check_expert_shards(one, mesh)


def test_call_errors(model, mesh24, x):
    with pytest.raises(ValueError, match=r"jax.set_mesh"):
        model(x)
    with jax.set_mesh(mesh24):
        # Tokens, not sequences, are split over the batch devices: 5 of them do not split.
        with pytest.raises(ValueError, match=r"x of shape \(1, 5, 8\) holds 5 tokens, which do "
                           r"not split evenly over the 8 batch devices"):
            model(x[:1, :5])
        with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\], got shape \(8, 6, 4\)"):
            model(x[..., :4])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_experts": 12}, "num_experts=12 is not divisible by the 8 expert devices"),
        ({"top_k": 9, "max_nodes": 1}, r"MoE: max_nodes=1 node\(s\) of 8 experts each hold "
         r"fewer than top_k=9 .*node axes \('node',\)"),
        ({"dedup": True, "rules": ShardingRules(node=("node", "device"))},
         r"exchange.dedup needs both node and device axes, got node=\('node', 'device'\), "
         r"device=\(\)"),
        ({"dedup": True, "dispatch": "einsum"}, "exchange.dedup needs dispatch='sort'"),
        (
            {"rules": ShardingRules(node="pod", device="device")},
            r"MoE: expert axis 'pod' is not an axis of the mesh \['node', 'device'\]",
        ),
        (
            {"rules": ShardingRules(tensor="tp", node="node", device="device")},
            r"MoE: tensor axis 'tp' is not an axis of the mesh",
        ),
    ],
)
def test_constructor_errors(mesh24, kw, match):
    # Only what depends on the rules or the mesh: the config sections check their fields.
    rules = kw.pop("rules", RULES)
    exchange = ExchangeConfig(dedup=kw.pop("dedup", False))
    config = ModelConfig(**{"d_model": D, "d_ff": F, "num_experts": E, "top_k": K,
                            "capacity_factor": 1.0, **kw})
    with jax.set_mesh(mesh24), pytest.raises(ValueError, match=match):
        MoE(config, rules, exchange=exchange, rngs=nnx.Rngs(0))


def test_weights_carry_partition_specs(model):
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["w_up"].get_value() == jax.P(AXES, None, None)
    assert specs["router"].get_value() == jax.P(None, None)
    assert isinstance(model.w_up[...].sharding, NamedSharding)


def test_shared_expert_weights_are_fsdp_sharded_on_the_width_only():
    rules = ShardingRules(fsdp="f", node="node", device="device")
    # Shapes and metadata only: nothing is drawn.
    config = ModelConfig(d_model=D, d_ff=F, num_experts=E, num_shared_experts=2)
    moe = nnx.eval_shape(lambda: MoE(config, rules, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(moe))
    assert moe.shared_gate.get_value().shape == (D, 2 * F)
    assert specs["shared_gate"].get_value() == jax.P("f", None)
    assert specs["shared_up"].get_value() == jax.P("f", None)
    assert specs["shared_down"].get_value() == jax.P(None, "f")
    config = ModelConfig(d_model=D, d_ff=F, num_experts=E)
    plain = nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0)))
    assert not hasattr(plain, "shared_gate")
