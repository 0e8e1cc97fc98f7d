"""The node-deduplicated exchange equals the non-deduplicated two-stage one and a
per-token numpy reference (outputs and gradients), and counts nodes per token."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _moe_reference import _np_route, _reference, _variant
from flax import nnx
from jax.sharding import AxisType

from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange import cost
from meshkit.exchange.capacity import capacity, dedup_nodes_per_token
from meshkit.exchange.dedup import distinct_nodes
from meshkit.model.moe import MoE
from meshkit.sharding.rules import ShardingRules

AXES = ("node", "device")
RULES = ShardingRules(node="node", device="device")
D, F, E = 8, 16, 16
B, T = 8, 6
TOP_K = (1, 2, 4, 8)
MAX_NODES = (1, 2, None)


def _combos(nodes):
    # max_nodes=1 with 4 nodes leaves 4 experts: top_k=8 cannot be routed (a config error).
    return [(k, mn) for k, mn in itertools.product(TOP_K, MAX_NODES)
            if mn is None or mn * (E // nodes) >= k]


def _base(mesh):
    with jax.set_mesh(mesh):
        config = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, capacity_factor=0.0)
        return nnx.jit(lambda: MoE(config, RULES, exchange=ExchangeConfig(method="hierarchical"),
                                   rngs=nnx.Rngs(11)))()


def _all_grads(models, x, mesh):
    """Outputs, stats and gradients of every model, compiled as one program."""
    weights = jax.random.normal(jax.random.key(4), x.shape)

    def loss(m, x):
        y, s = m(x)
        return jnp.sum(y * weights) + s.aux_loss + s.z_loss, (y, s)

    grad = nnx.grad(loss, argnums=(0, 1), has_aux=True)

    def run(models, x):
        return [grad(m, x) for m in models]

    with jax.set_mesh(mesh):
        out = nnx.jit(run)(models, x)
    return [(nnx.state(gm), gx, y, s) for (gm, gx), (y, s) in out]


@pytest.fixture
def quick_compile():
    """XLA's cheap pipeline: 46 small programs compile ~30% faster (results differ by
    float reassociation at most, well inside the tolerances)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(8), (B, T, D), jnp.float32)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_dedup_equals_two_stage_and_reference(shape, x, quick_compile):
    mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2)
    nodes = shape[0]
    base = _base(mesh)
    combos = _combos(nodes)
    models = []
    for k, mn in combos:
        models.append(_variant(base, top_k=k, max_nodes=mn, exchange_dedup=True))
        models.append(_variant(base, top_k=k, max_nodes=mn, exchange_dedup=False))
    results = _all_grads(models, x, mesh)
    for i, (k, mn) in enumerate(combos):
        (gm_d, gx_d, y_d, s_d), (gm_r, gx_r, y_r, s_r) = results[2 * i], results[2 * i + 1]
        what = f"top_k={k} max_nodes={mn}"
        assert int(s_d.dropped) == int(s_r.dropped) == 0, what
        ref, dropped, _ = _reference(models[2 * i], x, 8, num_nodes=nodes)
        assert dropped == 0
        np.testing.assert_allclose(y_d, ref, rtol=1e-5, atol=1e-6, err_msg=what)
        np.testing.assert_allclose(y_d, y_r, rtol=1e-5, atol=1e-6, err_msg=what)
        np.testing.assert_allclose(gx_d, gx_r, rtol=1e-5, atol=1e-6, err_msg=what)
        for a, b in zip(jax.tree.leaves(gm_d), jax.tree.leaves(gm_r), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)
        # nodes_per_token: distinct nodes of each token's experts, in numpy.
        router = np.asarray(base.router[...], np.float64)
        logits = np.asarray(x, np.float64).reshape(-1, D) @ router
        p = np.exp(logits - logits.max(-1, keepdims=True))
        top, _ = _np_route(p / p.sum(-1, keepdims=True), k, nodes, mn)
        expect = np.mean([len(set(row // (E // nodes))) for row in top])
        assert float(s_d.nodes_per_token) == pytest.approx(expect, rel=1e-6), what
        assert float(s_r.nodes_per_token) == pytest.approx(expect, rel=1e-6), what
        assert expect <= min(k, mn or nodes)


def test_distinct_nodes_hand_made():
    first = distinct_nodes(jnp.array([[0, 1, 5, 4], [7, 6, 0, 2]]), 4)
    assert first.tolist() == [[True, False, True, False], [True, False, True, False]]


def test_dropless_drops_nothing_under_adversarial_routing(x):
    # Every token ranks the experts in the same order (logit_e = c_e · Σx, Σx > 0), so
    # all pick experts 0..3, all on device 0 of node 0: the worst case for capacity.
    mesh = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
    base = _base(mesh)
    xs = jnp.abs(x)
    router = np.repeat(np.linspace(1.0, 0.0, E)[None, :], D, axis=0).astype(np.float32)
    router = jax.device_put(router, jax.sharding.NamedSharding(mesh, jax.P()))
    models = []
    for cf in (0.0, 1.0):
        for dedup in (True, False):
            m = _variant(base, top_k=4, max_nodes=None, capacity_factor=cf, exchange_dedup=dedup)
            m.router[...] = router
            models.append(m)
    # exchange_method="auto": top-4 on 2 nodes reaches at most 2, so on a link where
    # bytes are all that counts the cost model (meshkit.exchange.cost.choose) picks
    # dedup and the layer runs it. On the default topology these few bytes' time is all
    # latency, which dedup does not cut: under the choice margin the two-stage stays.
    slow = cost.Topology(2, 4, inter=cost.Link(0.0, 1e3), intra=cost.Link(0.0, 1e9),
                         memory_bandwidth_Bps=1e12)
    auto = _variant(models[2], exchange_dedup=False, exchange_method="auto", topology=slow)
    auto_default = _variant(auto, topology=None)
    with jax.set_mesh(mesh):
        out = nnx.jit(lambda ms, x: [m(x) for m in ms])([*models, auto, auto_default], xs)
    (y_d, s_d), (y_r, s_r), (_, lossy_d), (_, lossy_r), (_, lossy_auto), (_, lossy_default) = out
    ref, dropped, _ = _reference(models[0], xs, 8, num_nodes=2)
    assert dropped == 0
    assert int(s_d.dropped) == int(s_r.dropped) == 0
    np.testing.assert_allclose(y_d, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_r, ref, rtol=1e-5, atol=1e-6)
    assert float(s_d.expert_load[0]) == pytest.approx(0.25)  # every token on expert 0
    # With capacity_factor 1 the same routing drops most assignments. Two-stage: each
    # device keeps ceil(6·4/16) = 2 of its 6 tokens per expert: 8 × 4 × 4 = 128 dropped.
    # Dedup: every row fits node 0 (Cn = 6), then device (0, m) gets 12 rows and keeps
    # ceil(12·4/16) = 3 per expert: 4 devices × 4 experts × 9 = 144 dropped.
    assert int(lossy_r.dropped) == 128
    assert int(lossy_d.dropped) == 144
    assert int(lossy_auto.dropped) == 144
    assert int(lossy_default.dropped) == 128


def _cross_node_all_to_all_bytes(config) -> float:
    """Bytes one device sends to other nodes through the train step's all-to-alls."""
    from meshkit.strategy.hlo import collectives
    from meshkit.training import compile_step

    m = config.strategy().shape["device"]  # mesh position d is on node d // m
    sent = 0.0
    for op in collectives(compile_step(config)):
        if op.op != "all-to-all":
            continue
        for group in op.groups:
            remote = [d for d in group if d // m != group[0] // m]
            if 0 in group and remote:
                # Device 0's view: a tiled all-to-all sends each member an equal share.
                sent += op.bytes / len(group) * len([d for d in group if d // m != 0])
    return sent


def test_dedup_halves_the_bytes_that_cross_nodes(quick_compile):
    from meshkit.config import load_config

    common = ["model.top_k=4", "model.num_experts=16", "model.capacity_factor=1.25",
              "model.num_layers=1", "exchange.method=hierarchical"]
    base = load_config(None, common)
    plain = _cross_node_all_to_all_bytes(base)
    dedup = _cross_node_all_to_all_bytes(base.replace(exchange={"dedup": True}))
    limited = _cross_node_all_to_all_bytes(
        base.replace(exchange={"dedup": True}, model={"max_nodes": 1}))
    # Routing metadata: N·Cn rows of 2·top_k float32 (expert ids and gates), forward
    # and backward, of which the half for the other node crosses (N = 2).
    n = base.train.batch_size // 8 * base.train.seq_len

    def node_rows(max_nodes):
        return capacity(n, num_experts=2, top_k=min(4, max_nodes or 2), capacity_factor=1.25)

    def meta(max_nodes):
        return 2 * node_rows(max_nodes) * (2 * 4) * 4 * 2 / 2

    def share(max_nodes):  # of the two-stage bytes, as the cost model is told
        return dedup_nodes_per_token(n, num_experts=16, nodes=2, top_k=4,
                                     max_nodes=max_nodes, capacity_factor=1.25) / 4

    print(f"cross-node all-to-all bytes per device: two-stage {plain:.0f}, dedup {dedup:.0f} "
          f"({dedup / plain:.3f}), dedup max_nodes=1 {limited:.0f} ({limited / plain:.3f})")
    assert plain > 0
    # At top-4 a node's rows reach the tokens (256, not 1.25 · 256): 0.4 of the bytes,
    # not the bound's 2/4.
    assert node_rows(None) == n and share(None) == pytest.approx(0.4)
    assert dedup == pytest.approx(plain * share(None) + meta(None))
    assert limited == pytest.approx(plain * share(1) + meta(1))
    assert dedup > plain / 4  # the bound is not met by sending nothing
