"""The pluggable MoE: experts and routers of one's own, any input shape, and meshkit's
dispatchers run by hand in one's own shard_map, each against a dense one-device reference
(tests/_moe_reference.py), outputs and gradients.

Nothing drops (dropless layers, or capacities that hold every token), so every path must
give the dense result up to float32 rounding. Compiles are few and unoptimised (``FAST``):
one per layer or dispatcher, forward and backward together.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _moe_reference import D, E, F, K, _dense_moe, _softmax_top_k
from _ragged_emulation import emulated_ragged_all_to_all, ragged_op
from flax import nnx
from jax.sharding import AxisType

from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange.dedup import DedupDispatcher
from meshkit.exchange.dispatch import ExpertBatch, FlatDispatcher, Routing, TwoStageDispatcher
from meshkit.exchange.ragged import RaggedDispatcher
from meshkit.model.dispatchers import make_dispatcher
from meshkit.model.experts import (
    Experts,
    FunctionExperts,
    MLPExperts,
    SwiGLUExperts,
    expert_param,
)
from meshkit.model.moe import MoE
from meshkit.sharding.place import shard_model
from meshkit.sharding.rules import ShardingRules

AXES = ("node", "device")
RULES = ShardingRules(node="node", device="device")
N = 48  # tokens: 6 per device on 8
DROPLESS = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=0.0)
NO_DROP = E / K  # capacity = every local token
# Tests check values, not XLA's optimisations: unoptimised CPU code compiles faster.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _close(actual, desired, name=""):
    """Equal to float32 rounding: relative 1e-5, and absolute 1e-5 of the array's scale
    (a gradient sums many terms, so its small entries carry the large ones' rounding)."""
    desired = np.asarray(desired)
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * np.abs(desired).max(),
                               err_msg=name)


@pytest.fixture(scope="module")
def mesh24():
    return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.normal(jax.random.key(7), (N, D), jnp.float32)


def _build(make, mesh, seed=0):
    """``make()``'s module with numpy weights (scaled by fan-in), placed on ``mesh``: only
    shapes are traced, nothing is compiled to initialise it."""
    with jax.set_mesh(mesh):
        module = nnx.eval_shape(make)
    rng = np.random.default_rng(seed)
    nnx.update(module, jax.tree.map(
        lambda a: (rng.normal(size=a.shape) / np.sqrt(a.shape[-2])).astype(a.dtype),
        nnx.state(module)))
    return shard_model(module, mesh)



def _run(model, x, mesh):
    """``y`` and the gradients of ``sum(y · probe)`` for the layer's state and ``x``."""
    graphdef, state = nnx.split(model)
    probe = jax.random.normal(jax.random.key(3), x.shape)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * probe), y

    with jax.set_mesh(mesh):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
        (g_state, g_x), y = grad.lower(state, x).compile(compiler_options=FAST)(state, x)
    return y, g_state, g_x, probe


def _reference(routing, expert_fn, params, x, probe):
    """The dense reference's ``y`` and gradients for ``params`` (a dict) and ``x``."""

    def loss(params, x):
        tokens = x.reshape(-1, D)
        y = _dense_moe(tokens, routing(params), lambda i, t: expert_fn(params, i, t))
        y = y.reshape(x.shape)
        return jnp.sum(y * probe), y

    host = jax.tree.map(np.asarray, (params, x))  # one device, no mesh
    (g_params, g_x), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(*host)
    return y, g_params, g_x


def _weights(model, *names):
    """The named parameters of a layer as host arrays (``"experts/w_in"`` for nested)."""
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}
    return {name: np.asarray(flat[name][...]) for name in names}


def _grads(g_state, *names):
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(g_state)}
    return {name: np.asarray(flat[name][...]) for name in names}


def _assert_match(run, reference, names):
    y, g_state, g_x, _ = run
    y_ref, g_ref, g_x_ref = reference
    _close(y, y_ref)
    _close(g_x, g_x_ref)
    for name, got in _grads(g_state, *names).items():
        _close(got, g_ref[name], name)


def _mlp(params, index, tokens):
    """GELU MLP experts ``gelu(x W_in) W_out``, per (token, choice)."""
    h = jax.nn.gelu(jnp.einsum("nd,nkdf->nkf", tokens, params["experts/w_in"][index]))
    return jnp.einsum("nkf,nkfd->nkd", h, params["experts/w_out"][index])


def _router(params):
    return _softmax_top_k(params["router"], K)


# ------------------------------------------------------------------ experts of one's own
def _gelu_experts(rules=RULES):
    return MLPExperts(num_experts=E, d_model=D, d_ff=F, rules=rules, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def gelu_moe(mesh24):
    return _build(lambda: MoE(DROPLESS, RULES, experts=_gelu_experts(),
                              exchange=ExchangeConfig(method="hierarchical"), rngs=nnx.Rngs(0)),
                  mesh24)


def test_gelu_experts_match_the_dense_reference(gelu_moe, tokens, mesh24):
    x = tokens.reshape(8, 6, D)  # [B, T, d]
    names = ("router", "experts/w_in", "experts/w_out")
    assert not hasattr(gelu_moe, "w_gate")  # the experts replace the default SwiGLUs
    # Each device holds its two experts, the router on every device.
    assert {s.data.shape for s in gelu_moe.experts.w_in[...].addressable_shards} == {(2, D, F)}
    run = _run(gelu_moe, x, mesh24)
    reference = _reference(_router, _mlp, _weights(gelu_moe, *names), x, run[3])
    _assert_match(run, reference, names)


class ReluSquaredExperts(Experts):
    """A user's own experts: ``relu(x U + b)² V``, own parameter names, padded rows only."""

    def __init__(self, rules, rngs):
        key = iter(jax.random.split(rngs.params(), 3))
        self.u = expert_param(jax.random.normal(next(key), (E, D, F)) / D**0.5, rules,
                              "embed", None)
        self.b = expert_param(0.5 * jax.random.normal(next(key), (E, F)), rules, None)
        self.v = expert_param(jax.random.normal(next(key), (E, F, D)) / F**0.5, rules,
                              None, "embed")

    def padded(self, rows):
        h = jnp.einsum("esd,edf->esf", rows, self.u[...]) + self.b[...][:, None, :]
        return jnp.einsum("esf,efd->esd", jax.nn.relu(h) ** 2, self.v[...])


def _relu_squared(params, index, tokens):
    h = jnp.einsum("nd,nkdf->nkf", tokens, params["experts/u"][index])
    h = jax.nn.relu(h + params["experts/b"][index])
    return jnp.einsum("nkf,nkfd->nkd", h**2, params["experts/v"][index])


def test_user_expert_module_matches_the_dense_reference(tokens, mesh24):
    # [tokens, d] in, through the node-deduplicated exchange with room for every row.
    config = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=NO_DROP)
    moe = _build(lambda: MoE(config, RULES, experts=ReluSquaredExperts(RULES, nnx.Rngs(2)),
                             exchange=ExchangeConfig(dedup=True), rngs=nnx.Rngs(0)), mesh24)
    names = ("router", "experts/u", "experts/b", "experts/v")
    run = _run(moe, tokens, mesh24)
    assert run[0].shape == (N, D)
    reference = _reference(_router, _relu_squared, _weights(moe, *names), tokens, run[3])
    _assert_match(run, reference, names)


def test_function_experts_vmap_one_expert_over_the_stack():
    rng = np.random.default_rng(0)
    u, b, v, rows = (rng.normal(size=s).astype(np.float32)
                     for s in ((E, D, F), (E, F), (E, F, D), (E, 3, D)))

    def one_expert(w, rows):  # ReluSquaredExperts as a plain function of one expert
        return jax.nn.relu(rows @ w["u"] + w["b"]) ** 2 @ w["v"]

    experts = FunctionExperts(one_expert, {"u": u, "b": b, "v": v})
    assert experts.weights["u"].out_sharding == jax.P(AXES, None, None)
    assert not experts.supports_grouped()
    # Outside any shard_map the module holds every expert, as a dense reference would.
    want = np.einsum("esf,efd->esd",
                     np.maximum(np.einsum("esd,edf->esf", rows, u) + b[:, None], 0) ** 2, v)
    np.testing.assert_allclose(experts(ExpertBatch(jnp.asarray(rows))), want, rtol=1e-5,
                               atol=1e-5)


class TopKRouter(nnx.Module):
    """A user's own router: softmax of ``tokens W`` over an FSDP-sharded ``W``, top-k."""

    def __init__(self, rules, rngs):
        w = jax.random.normal(rngs.params(), (D, E)) / D**0.5
        self.w = nnx.Param(w, out_sharding=rules.spec("embed", None))

    def __call__(self, tokens):
        probs = jax.nn.softmax(tokens @ self.w[...], axis=-1)
        gate, index = jax.lax.top_k(probs, K)
        return index, gate / gate.sum(-1, keepdims=True), probs


def test_fsdp_and_a_user_router(tokens):
    # fsdp × node × device = 2 × 2 × 2: expert weights split over 4 expert devices and on
    # the model width over fsdp, gathered per call; the router is the user's, also FSDP.
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", *AXES), axis_types=(AxisType.Auto,) * 3)
    rules = ShardingRules(fsdp="fsdp", node="node", device="device")

    def make():
        experts = SwiGLUExperts(num_experts=E, d_model=D, d_ff=F, rules=rules,
                                activation=jax.nn.gelu, rngs=nnx.Rngs(1))  # GeGLU
        return MoE(DROPLESS, rules, experts=experts, router=TopKRouter(rules, nnx.Rngs(3)),
                   exchange=ExchangeConfig(method="flat"), rngs=nnx.Rngs(0))

    moe = _build(make, mesh)
    assert {s.data.shape for s in moe.experts.w_up[...].addressable_shards} == {(4, D // 2, F)}
    assert {s.data.shape for s in moe.router.w[...].addressable_shards} == {(D // 2, E)}
    names = ("router/w", "experts/w_gate", "experts/w_up", "experts/w_down")
    x = tokens.reshape(4, 3, 4, D)  # [B, T, S, d]

    def geglu(p, index, t):
        g = jnp.einsum("nd,nkdf->nkf", t, p["experts/w_gate"][index])
        u = jnp.einsum("nd,nkdf->nkf", t, p["experts/w_up"][index])
        return jnp.einsum("nkf,nkfd->nkd", jax.nn.gelu(g) * u, p["experts/w_down"][index])

    run = _run(moe, x, mesh)
    routing = lambda p: _softmax_top_k(p["router/w"], K)  # noqa: E731  # the same top-k
    reference = _reference(routing, geglu, _weights(moe, *names), x, run[3])
    _assert_match(run, reference, names)


# ------------------------------------------------------------------ any leading shape
def test_any_leading_shape_splits_the_tokens_over_the_batch_devices(gelu_moe, tokens, mesh24):
    # One program, four shapes of the same 48 tokens: row-major flattening gives every
    # device the same 6 tokens, so the outputs agree exactly. [4, 12, d] is 4 sequences
    # on 8 devices: each device gets half a sequence.
    shapes = [(N, D), (8, 6, D), (8, 3, 2, D), (4, 12, D)]

    def outputs(model, x):
        return [model(x.reshape(s))[0].reshape(N, D) for s in shapes]

    with jax.set_mesh(mesh24):
        ys = nnx.jit(outputs)(gelu_moe, tokens)
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


# ------------------------------------------------------------------ dispatchers by hand
DISPATCH = {  # make_dispatcher settings for each exchange
    "flat": ({"capacity_factor": NO_DROP, "method": "flat"}, FlatDispatcher),
    "two-stage": ({"capacity_factor": NO_DROP, "method": "hierarchical"}, TwoStageDispatcher),
    "dedup": ({"capacity_factor": NO_DROP, "dedup": True}, DedupDispatcher),
    # Dropless with ragged_all_to_all, emulated: XLA:CPU cannot run the op.
    "ragged": ({"capacity_factor": 0.0, "method": "flat"}, RaggedDispatcher),
}


@pytest.fixture(scope="module")
def gelu_experts(mesh24):
    return _build(_gelu_experts, mesh24)


@pytest.mark.parametrize("kind", list(DISPATCH))
def test_dispatch_and_combine_in_a_user_shard_map(kind, gelu_experts, tokens, mesh24):
    """A user's own model: own router weight and top-k, meshkit's GELU experts module,
    make_dispatcher's dispatch and combine, all in the user's jax.shard_map."""
    settings, expected = DISPATCH[kind]
    experts = gelu_experts
    graphdef, state = nnx.split(experts)
    w_router = jax.random.normal(jax.random.key(4), (D, E)) / D**0.5
    spec = jax.P(AXES)

    def body(x, w_router, state):
        probs = jax.nn.softmax(x @ w_router, axis=-1)  # the user's routing
        gate, index = jax.lax.top_k(probs, K)
        gate = gate / gate.sum(-1, keepdims=True)
        dispatcher = make_dispatcher(rules=RULES, num_experts=E, top_k=K, **settings)
        assert type(dispatcher) is expected
        batch, context = dispatcher.dispatch(x, Routing(index, gate))
        assert (batch.group_sizes is not None) == (kind == "ragged")
        y = dispatcher.combine(nnx.merge(graphdef, state)(batch), context)
        return y, jax.lax.psum(context.dropped, AXES)

    moe = jax.shard_map(body, in_specs=(spec, jax.P(), nnx.get_partition_spec(state)),
                        out_specs=(spec, jax.P()))
    probe = jax.random.normal(jax.random.key(3), tokens.shape)

    def loss(x, w_router, state):
        y, dropped = moe(x, w_router, state)
        return jnp.sum(y * probe), (y, dropped)

    emulated = kind == "ragged"
    with jax.set_mesh(mesh24), (ragged_op(emulated_ragged_all_to_all) if emulated
                                else contextlib.nullcontext()):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        args = (tokens, w_router, state)
        (g_x, g_router, g_state), (y, dropped) = grad.lower(*args).compile(
            compiler_options=FAST)(*args)
    assert int(dropped) == 0

    params = {"router": w_router, "experts/w_in": experts.w_in[...],
              "experts/w_out": experts.w_out[...]}
    y_ref, g_ref, g_x_ref = _reference(_router, _mlp, params, tokens, probe)
    _close(y, y_ref)
    _close(g_x, g_x_ref)
    _close(g_router, g_ref["router"])
    _close(g_state["w_in"][...], g_ref["experts/w_in"])
    _close(g_state["w_out"][...], g_ref["experts/w_out"])


# ------------------------------------------------------------------ errors and choices
def test_padded_only_experts_keep_a_dropless_layer_off_the_ragged_exchange(tokens, mesh24):
    # Where ragged_all_to_all exists (here: a stand-in that records its use), a dropless
    # layer runs it only for experts that take grouped rows.
    used = []

    def recording(operand, output, *args, **kwargs):
        used.append(True)
        return emulated_ragged_all_to_all(operand, output, *args, **kwargs)

    own = _build(lambda: MoE(DROPLESS, RULES, experts=ReluSquaredExperts(RULES, nnx.Rngs(2)),
                             rngs=nnx.Rngs(0)), mesh24)
    gelu = _build(lambda: MoE(DROPLESS, RULES, experts=_gelu_experts(), rngs=nnx.Rngs(0)),
                  mesh24)
    with jax.set_mesh(mesh24), ragged_op(recording):  # tracing only: nothing compiles
        jax.eval_shape(lambda x: own(x), tokens)
        assert not used
        jax.eval_shape(lambda x: gelu(x), tokens)
        assert used


def test_grouped_rows_for_padded_only_experts_name_what_is_missing():
    batch = ExpertBatch(jnp.zeros((6, D)), jnp.zeros((E,), jnp.int32))
    with pytest.raises(NotImplementedError, match=r"ReluSquaredExperts runs padded rows only: "
                       r"it does not implement grouped\(rows, group_sizes\)"):
        nnx.eval_shape(lambda: ReluSquaredExperts(RULES, nnx.Rngs(0)))(batch)


class _NoParams(Experts):
    def padded(self, rows):
        return rows


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: MoE(DROPLESS, RULES, experts=lambda rows: rows, rngs=nnx.Rngs(0)),
         TypeError, r"experts must be a meshkit.model.experts.Experts module .*got function"),
        (lambda: MoE(DROPLESS, RULES, experts=MLPExperts(num_experts=8, d_model=D, d_ff=F,
                                                         rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)),
         ValueError, r"expert parameter 'w_in' of shape \(8, 8, 16\) is not stacked on a "
         r"leading expert dimension of num_experts=16"),
        (lambda: MoE(DROPLESS, RULES, experts=MLPExperts(
            num_experts=E, d_model=D, d_ff=F, rules=ShardingRules(node="node"),
            rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)),
         ValueError, r"expert parameter 'w_in' has out_sharding P\('node', None, None\); its "
         r"first entry must be the expert axes \('node', 'device'\)"),
        (lambda: MoE(DROPLESS, RULES, experts=_NoParams(), rngs=nnx.Rngs(0)),
         ValueError, "experts _NoParams holds no nnx.Param"),
        (lambda: MoE(DROPLESS, RULES, router="top2", rngs=nnx.Rngs(0)),
         TypeError, r"router must be callable \(a Router\), got str"),
        (lambda: expert_param(jnp.zeros((E, D, F)), RULES, "embed"),
         ValueError, r"a value of shape \(16, 8, 16\) needs 2 dims after the expert "
         r"dimension, got 1"),
        (lambda: FunctionExperts(lambda w, rows: rows, {}),
         ValueError, "FunctionExperts: weights must name at least one"),
        (lambda: make_dispatcher(rules=RULES, num_experts=E, top_k=K, capacity_factor=1.0),
         ValueError, r"method='auto' weighs the deduplicated exchange by its size: pass "
         r"bytes_per_row and num_tokens \(got None and None\)"),
    ],
)
def test_construction_errors_name_the_culprit(make, error, match):
    with pytest.raises(error, match=match):
        nnx.eval_shape(make)  # shapes only: the checks need no values


def test_call_errors_name_the_shape_or_the_router(tokens, mesh24):
    moe = _build(lambda: MoE(DROPLESS, RULES, rngs=nnx.Rngs(0)), mesh24)
    bad = _build(lambda: MoE(DROPLESS, RULES, rngs=nnx.Rngs(0),
                             router=lambda t: (jnp.zeros((t.shape[0], 1), jnp.int32),) * 3),
                 mesh24)
    with jax.set_mesh(mesh24):  # every error fires while tracing: nothing compiles
        with pytest.raises(ValueError, match=r"x of shape \(1, 3, 3, 8\) holds 9 tokens, which "
                           r"do not split evenly over the 8 batch devices \(axes \('node', "
                           r"'device'\)\)"):
            jax.eval_shape(moe, tokens[:9].reshape(1, 3, 3, D))
        with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\], got shape \(48, 4\)"):
            jax.eval_shape(moe, tokens[:, :4])
        with pytest.raises(ValueError, match=r"router: expert_index must be \[6, 2\] \(tokens, "
                           r"top_k\), got shape \(6, 1\)"):
            jax.eval_shape(bad, tokens)
