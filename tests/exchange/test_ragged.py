"""The ragged dropless exchange (meshkit.exchange.ragged) equals the padded dropless path.

XLA:CPU cannot run ``ragged_all_to_all``, so the equivalence tests run the ragged path
with an exact emulation of the op (tests/_ragged_emulation.py), which is itself checked
against a numpy transcription of the op's docstring pseudocode and the docstring's own
worked example. The real op is only lowered here (HLO checks), never run.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _moe_reference import _reference, _variant
from _ragged_emulation import emulated_ragged_all_to_all, ragged_op
from flax import nnx
from jax.sharding import AxisType

from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange import ragged
from meshkit.model.moe import MoE
from meshkit.sharding.place import shard_model
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy import hlo

AXES = ("node", "device")
D, F, E = 8, 16, 16  # as in tests/_moe_reference.py, whose reference reads them
B, T = 8, 6  # 6 tokens per device
TOP_K = (1, 2, 4)
# Tests check values, not XLA's optimisations: unoptimised CPU code compiles about
# twice as fast, and every program here is tiny.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}



@pytest.fixture(scope="module")
def mesh24():
    return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)


# ------------------------------------------------------------------ the emulator itself
def _numpy_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes):
    """The docstring's SEND/RECEIVE pseudocode, transcribed loop for loop over devices.

    Every argument is a list over the P devices of one group, in axis-index order.
    """
    p = len(operand)
    num = len(input_offsets[0])
    per = num // p
    # SEND: device q's slice i goes to device i // per; messages arrive in send order.
    inbox = [[] for _ in range(p)]
    for q in range(p):
        for i in range(num):
            data = operand[q][input_offsets[q][i]:input_offsets[q][i] + send_sizes[q][i]]
            inbox[i // per].append((q, data))
    results = []
    for me in range(p):
        result = output[me].copy()
        # output_offsets_ = all_to_all(output_offsets): entry i comes from device
        # i // per, its entry me·per + i % per.
        offsets_ = [output_offsets[i // per][me * per + i % per] for i in range(num)]
        for i in range(num):
            src, data = inbox[me][i]
            assert src == i // per  # RECEIVE(from_axis_index=i // per), in order
            result[offsets_[i]:offsets_[i] + recv_sizes[me][i]] = data
        results.append(result)
    return results


def _random_ragged_case(rng, p, per, rows, size):
    """Consistent ragged arguments for P devices: slices placed with gaps on both ends."""
    num = p * per
    sizes = rng.integers(0, 3, size=(p, num))  # sizes[q, i]: q's slice i, to i // per
    operand = rng.normal(size=(p, rows, 3)).astype(np.float32)
    output = rng.normal(size=(p, size, 3)).astype(np.float32)  # untouched rows must stay
    input_offsets = np.zeros((p, num), np.int32)
    output_offsets = np.zeros((p, num), np.int32)
    recv_sizes = np.zeros((p, num), np.int32)
    for q in range(p):  # each sender packs its slices in a random order with gaps
        at = 0
        for i in rng.permutation(num):
            at += rng.integers(0, 2)
            input_offsets[q, i], at = at, at + sizes[q, i]
        assert at <= rows
    for me in range(p):  # each receiver places its incoming slices likewise
        at = 0
        for i in rng.permutation(num):
            src, j = divmod(i, per)
            recv_sizes[me, i] = sizes[src, me * per + j]
            at += rng.integers(0, 2)
            output_offsets[src, me * per + j], at = at, at + recv_sizes[me, i]
        assert at <= size
    return operand, output, input_offsets, sizes.astype(np.int32), output_offsets, recv_sizes


def _run_emulator(mesh, args, axis_name):
    spec = jax.P(AXES)
    body = jax.shard_map(
        lambda *a: emulated_ragged_all_to_all(*(x[0] for x in a), axis_name=axis_name)[None],
        in_specs=(spec,) * 6, out_specs=spec,
    )
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(body).lower(*args).compile(compiler_options=FAST)(*args))


def test_emulator_follows_the_docstring(mesh24):
    # 1. The docstring's worked example, over the axis of size 2 ("node"): the same
    #    example in each of the 4 groups {(0, m), (1, m)}.
    example = [
        ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),  # axis index 0
        ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1]),  # axis index 1
    ]
    per_device = [example[r // 4] for r in range(8)]  # rank r = node · 4 + device
    args = [np.array([dev[a] for dev in per_device],
                     np.float32 if a < 2 else np.int32) for a in range(6)]
    got = _run_emulator(mesh24, args, "node")
    np.testing.assert_array_equal(got[:4], [[1, 3, 0, 0]] * 4)  # the docstring's results
    np.testing.assert_array_equal(got[4:], [[2, 2, 4, 0]] * 4)
    model = _numpy_ragged_all_to_all(*zip(*example))
    np.testing.assert_array_equal(model, [[1, 3, 0, 0], [2, 2, 4, 0]])

    # 2. Random ragged slices over both axes (8 devices, 2 slices per destination),
    #    out of order and with gaps, into a non-zero output.
    args = _random_ragged_case(np.random.default_rng(0), p=8, per=2, rows=40, size=48)
    got = _run_emulator(mesh24, args, AXES)
    want = _numpy_ragged_all_to_all(*(list(a) for a in args))
    assert sum(int(s) for s in args[3].flat) > 0
    np.testing.assert_array_equal(got, np.stack(want))


# ------------------------------------------------------------------ ragged == padded
@pytest.fixture(scope="module")
def dropless(mesh24):
    # Shapes only, then numpy weights (scaled by fan-in) placed on the mesh: nothing is
    # compiled to initialise the layer.
    config = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=1, capacity_factor=0.0)
    base = nnx.eval_shape(lambda: MoE(config, ShardingRules(node="node", device="device"),
                                      exchange=ExchangeConfig(method="flat"),
                                      rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(3)
    nnx.update(base, jax.tree.map(
        lambda a: (rng.normal(size=a.shape) / np.sqrt(a.shape[-2])).astype(a.dtype),
        nnx.state(base)))
    base = shard_model(base, mesh24)
    return [_variant(base, top_k=k) for k in TOP_K]


def _adversarial(models, mesh):
    """Every token ranks the experts in the same order (logit_e = c_e · Σx with Σx > 0),
    so all pick experts 0..k-1, on devices 0 and 1: each receive buffer there is filled
    to its worst-case size."""
    router = np.repeat(np.linspace(1.0, 0.0, E)[None, :], D, axis=0).astype(np.float32)
    router = jax.device_put(router, jax.sharding.NamedSharding(mesh, jax.P()))
    out = [nnx.clone(m) for m in models]
    for m in out:
        m.router[...] = router
    return out


def test_ragged_equals_padded_dropless_with_grads(dropless, mesh24):
    sent = []  # (operand rows, output rows) of each call of the ragged all-to-all

    def counted(operand, output, *args, **kwargs):
        sent.append((operand.shape[0], output.shape[0]))
        return emulated_ragged_all_to_all(operand, output, *args, **kwargs)

    graphdefs = [nnx.split(m)[0] for m in dropless]
    weights = jax.random.normal(jax.random.key(1), (B, T, D))

    def grads(model, x):
        def loss(m, x):
            y, stats = m(x)
            return jnp.sum(y * weights), (y, stats.dropped)
        (g_model, g_x), (y, dropped) = nnx.grad(loss, argnums=(0, 1), has_aux=True)(model, x)
        return nnx.state(g_model), g_x, y, dropped

    def both_paths(states, x):
        runs = []
        for graphdef, state in zip(graphdefs, states, strict=True):
            model = nnx.merge(graphdef, state)
            padded = grads(model, x)
            with ragged_op(counted):  # read while tracing: only this call goes ragged
                runs.append((padded, grads(model, x)))
        return runs

    batch = jax.sharding.NamedSharding(mesh24, jax.P(AXES))
    x = jax.device_put(jax.random.normal(jax.random.key(7), (B, T, D)), batch)
    with jax.set_mesh(mesh24):
        states = [nnx.state(m) for m in dropless]
        program = jax.jit(both_paths).lower(states, x).compile(compiler_options=FAST)
        adversarial = _adversarial(dropless, mesh24)
        # One program, two routings: only the weights and inputs differ.
        cases = {"random": (dropless, x),
                 "adversarial": (adversarial, jax.device_put(jnp.abs(x), batch))}
        results = {name: program([nnx.state(m) for m in ms], xs)
                   for name, (ms, xs) in cases.items()}

    # The adversarial routing sends every token to experts 0..k-1.
    logits = np.asarray(jnp.abs(x).reshape(-1, D) @ adversarial[0].router[...])
    assert (np.argsort(-logits, axis=1)[:, :4] == [0, 1, 2, 3]).all()
    for name, (models, xs) in cases.items():
        for model, (padded, rag) in zip(models, results[name], strict=True):
            (gm_p, gx_p, y_p, drop_p), (gm_r, gx_r, y_r, drop_r) = padded, rag
            assert int(drop_p) == int(drop_r) == 0, name
            ref, _, _ = _reference(model, xs, 8)
            np.testing.assert_allclose(y_r, ref, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(y_r, y_p, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gx_r, gx_p, rtol=1e-5, atol=1e-6)
            leaves_p, leaves_r = jax.tree.leaves(gm_p), jax.tree.leaves(gm_r)
            assert len(leaves_p) == len(leaves_r) == 4  # router, w_gate, w_up, w_down
            for a, b in zip(leaves_r, leaves_p, strict=True):
                assert float(jnp.max(jnp.abs(b))) > 0
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Each ragged run called the op twice (dispatch, return), sending n·k rows into the
    # worst-case buffer P·n·min(k, E/P) and back.
    n = B * T // 8
    assert sent == [pair for k in TOP_K
                    for pair in ((n * k, 8 * n * min(k, 2)), (8 * n * min(k, 2), n * k))]


# ------------------------------------------------------------------ the real op, lowered
def _lower_grad(model, mesh, x):
    """HLO text of the loss's gradient with respect to the weights and the input."""
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0])

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).as_text(dialect="hlo")


def test_ragged_path_lowers_to_ragged_all_to_all_only(dropless, mesh24):
    x = jnp.zeros((B, T, D))
    model = dropless[TOP_K.index(2)]
    padded = _lower_grad(model, mesh24, x)
    with ragged_op(jax.lax.ragged_all_to_all):  # the real op: it lowers on CPU (not compiles)
        text = _lower_grad(model, mesh24, x)
    n, rows = B * T // 8, ragged.receive_rows(6, 2, 8, E)
    # Forward: dispatch [n·k, d] rows into [rows, d], return them; backward: the
    # transpose of each (JAX's rule: a ragged all-to-all with the offsets swapped).
    ops = [line for line in text.splitlines() if " ragged-all-to-all(" in line]
    assert len(ops) == 4
    assert sum(f"f32[{rows},{D}]" in op for op in ops) == 2  # into the receive buffer
    assert sum(f"f32[{n * 2},{D}]" in op for op in ops) == 2  # back home
    # Every plain all-to-all left moves E int32 sizes or offsets; the padded path's
    # dispatch moved the full [E, n, d] float32 buffer.
    plain = [c for c in hlo.collectives(text) if c.op == "all-to-all"]
    assert plain and all(c.dtypes == ("s32",) and c.shapes == ((E,),) for c in plain)
    full = [c for c in hlo.collectives(padded) if c.op == "all-to-all"]
    assert " ragged-all-to-all(" not in padded
    assert any(c.shapes == ((E, n, D),) and c.dtypes == ("f32",) for c in full)


def test_padded_path_where_ragged_does_not_apply(dropless, mesh24):
    # On CPU (no hook) a dropless flat layer runs padded; with the hook set, so do the
    # layers the ragged exchange does not cover: the two-stage and deduplicated
    # exchanges, einsum dispatch and a finite capacity.
    flat = dropless[TOP_K.index(2)]
    covered = [_variant(flat, exchange_method="hierarchical"),
               _variant(flat, exchange_dedup=True),
               _variant(flat, dispatch="einsum"),
               _variant(flat, capacity_factor=1.25)]

    def lower(models):
        graphdefs, states = zip(*(nnx.split(m) for m in models), strict=True)

        def run(states, x):
            return [nnx.merge(g, s)(x)[0] for g, s in zip(graphdefs, states, strict=True)]

        with jax.set_mesh(mesh24):
            return jax.jit(run).lower(list(states), jnp.zeros((B, T, D))).as_text()

    assert "ragged_all_to_all" not in lower([flat])
    with ragged_op(jax.lax.ragged_all_to_all):
        assert "ragged_all_to_all" not in lower(covered)
        assert "ragged_all_to_all" in lower([flat])  # the hook does reach this layer


def test_xla_cpu_cannot_compile_the_real_op(mesh24):
    # Why the CPU runs the padded path; if this starts failing, XLA:CPU has learnt the op.
    def body(x):
        sizes = jnp.ones(8, jnp.int32)
        offsets = jnp.arange(8, dtype=jnp.int32)
        lands = jnp.full(8, jax.lax.axis_index(AXES), jnp.int32)
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, lands, sizes,
                                         axis_name=AXES)

    program = jax.jit(jax.shard_map(body, in_specs=jax.P(AXES), out_specs=jax.P(AXES)))
    with jax.set_mesh(mesh24):
        lowered = program.lower(jnp.zeros((64, 1)))
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not "
                                 r"supported by XLA:CPU"):
            lowered.compile()


# ------------------------------------------------------------------ errors
def _trace_exchange(mesh, tokens, expert_index, gate, *, num_experts, axes=AXES):
    spec = jax.P(AXES)
    body = jax.shard_map(
        lambda t, i, g: ragged.ragged_exchange(t, i, g, lambda rows, sizes: rows,
                                               num_experts=num_experts, axes=axes),
        in_specs=(spec,) * 3, out_specs=spec,
    )
    with jax.set_mesh(mesh):
        jax.eval_shape(body, tokens, expert_index, gate)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_experts": 12}, r"num_experts=12 is not divisible by the 8 devices of axes "
                              r"\('node', 'device'\)"),
        ({"axes": ()}, "axes must name at least one expert mesh axis"),
        ({"tokens": jnp.zeros((8, 6, 8))}, r"tokens must be \[n, d\], got shape \(1, 6, 8\)"),
        ({"gate": jnp.zeros((8, 1))}, r"expert_index and gate must both be \[1, k\], got "
                                      r"shapes \(1, 2\) and \(1, 1\)"),
    ],
)
def test_ragged_exchange_errors(mesh24, kw, match):
    args = {"tokens": jnp.zeros((8, 4)), "expert_index": jnp.zeros((8, 2), jnp.int32),
            "gate": jnp.zeros((8, 2)), "num_experts": E}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        _trace_exchange(mesh24, **args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 2, 8, 16), "num_tokens must be positive, got 0"),
        ((6, 0, 8, 16), "top_k must be positive, got 0"),
        ((6, 2, 0, 16), "num_devices must be positive, got 0"),
        ((6, 2, 8, -16), "num_experts must be positive, got -16"),
        ((6, 2, 8, 12), "num_experts=12 is not divisible by the 8 expert devices"),
    ],
)
def test_receive_rows_errors(args, match):
    with pytest.raises(ValueError, match=match):
        ragged.receive_rows(*args)
