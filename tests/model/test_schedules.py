"""Pipeline schedules: 1F1B (and every other schedule) gives GPipe's loss and gradients.

A toy stage on a ``pp × dp`` mesh (asymmetric: 2 × 4), compared with autodiff through
the GPipe schedule; the transformer's own parity runs a few training steps per schedule.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layouts import ONE_DEVICE, STRATEGIES, _config  # type: ignore[import-not-found]
from jax.sharding import PartitionSpec as P

from meshkit.model.pipeline import gpipe, interleaved, one_f_one_b

D = 4
Run = tuple[list[float], list[dict[str, np.ndarray]]]  # losses, gradients per step


def _mesh(stages: int) -> jax.sharding.Mesh:
    return jax.make_mesh((stages, 8 // stages), ("pp", "dp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _stage(w: jax.Array, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    sq = jnp.float32(0)
    for i in range(w.shape[0]):  # this stage's layers; a statistic per layer, however cut
        h = jnp.tanh(h @ w[i])
        sq = sq + jnp.sum(h**2)
    return h, {"sq": sq}


def _loss(v: jax.Array, h: jax.Array, y: jax.Array) -> jax.Array:
    last = jax.lax.axis_index("pp") == jax.lax.axis_size("pp") - 1
    return jnp.where(last, jnp.sum((h @ v - y) ** 2), 0.0)


def _losses(stages: int, m: int, schedule: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, d loss/d w, d loss/d x) of a 4-layer toy under a schedule (``interleaved``:
    2 virtual stages, the layers stacked in its order and the gradient put back)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, D, D)) / 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(D, D)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4 * m, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(4 * m, D)), jnp.float32)

    def body(w: jax.Array, v: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        xs, ys = x.reshape(m, -1, D), y.reshape(m, -1, D)

        def aux(stats: dict[str, jax.Array]) -> jax.Array:
            return 0.01 * stats["sq"]

        if schedule in ("gpipe", "interleaved"):
            if schedule == "gpipe":
                out, stats = gpipe(lambda h: _stage(w, h), xs, "pp")
            else:
                k = w.shape[0] // 2  # layers per chunk

                def chunk(c: jax.Array, h: jax.Array) -> tuple[jax.Array, Any]:
                    return _stage(jax.lax.dynamic_slice_in_dim(w, c * k, k), h)

                out, stats = interleaved(chunk, xs, "pp", virtual_stages=2)
            per = jax.vmap(lambda h, t: _loss(v, h, t))(out, ys)
            return jax.lax.psum(jnp.sum(per), ("pp", "dp")) + jax.lax.psum(aux(stats), ("pp", "dp"))
        objective, _ = one_f_one_b(_stage, w, xs, loss=_loss, loss_params=v, targets=ys,
                                   axis="pp", stats_loss=aux)
        return objective

    # Interleaved: virtual stage c·S + s (layers (c·S + s)·k ...) is chunk c of stage s.
    order = (np.arange(4).reshape(2, stages, -1).swapaxes(0, 1).reshape(-1)
             if schedule == "interleaved" else np.arange(4))
    f = jax.shard_map(body, in_specs=(P("pp"), P(), P("dp"), P("dp")), out_specs=P())
    with jax.set_mesh(_mesh(stages)):
        value, grads = jax.jit(jax.value_and_grad(lambda *a: 3.0 * f(*a), argnums=(0, 1, 2)))(
            w[order], v, x, y)
    dw = jnp.zeros_like(grads[0]).at[order].set(grads[0])
    return value, dw, *grads[1:]


# Interleaved at M = S here (what comes round the ring is used at once); the transformer's
# parity below runs M > S (it waits in stage 0's buffer).
@pytest.mark.parametrize(("stages", "m", "schedule"), [(4, 3, "1f1b"), (2, 2, "interleaved")])
def test_schedules_give_gpipes_loss_and_gradients(stages: int, m: int, schedule: str) -> None:
    want = _losses(stages, m, "gpipe")
    got = _losses(stages, m, schedule)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _train(schedule: str, *extra: str, strategy: str = "pp2-tp2-node2", steps: int = 3
           ) -> tuple[list[float], list[dict[str, np.ndarray]]]:
    """The loss and the gradients of each of ``steps`` AdamW steps of the transformer,
    by default on pp2·tp2·node2 (experts, tensor and pipeline axes at once), 4
    microbatches; the gradients of stacked layers only at the slots that hold layers."""
    from flax import nnx

    from meshkit.data.sources import make_dataset
    from meshkit.training import Programs
    from meshkit.training.models import transformer_loss

    pipelined = ["parallel.microbatches=4", f"parallel.schedule={schedule}"]
    config = _config(STRATEGIES.get(strategy, ONE_DEVICE),
                     *(pipelined if strategy in STRATEGIES else []),
                     *extra)
    stage_layers = config.parallel.stage_layers
    width = max(stage_layers or [1])
    slots = np.asarray([s * width + j for s, n in enumerate(stage_layers or []) for j in range(n)])
    if schedule == "interleaved":  # the layers stored in its order: put back in layer order
        from meshkit.model.transformer import Transformer

        slots = np.asarray(Transformer.from_config(config)._layer_slots())
    permuted = bool(stage_layers) or schedule == "interleaved"
    t, d = config.train, config.data
    data = make_dataset(d.kind, path=None, vocab_size=config.model.vocab_size, order=d.order,
                        seed=d.seed, concentration=d.concentration)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)

        @jax.jit
        def step(state: Any, batch: jax.Array) -> Any:  # the train step, gradients shown
            with programs._logical():
                model, optimizer = nnx.merge(programs.graphdef, state)
                loss, grads = nnx.value_and_grad(
                    lambda m: transformer_loss(m, batch)[0])(model)
                optimizer.update(model, grads)
                return nnx.split((model, optimizer))[1], loss, grads

        state = programs.init()
        losses, grads = [], []
        for i in range(steps):
            batch = data.batch(i, t.batch_size, t.seq_len, seed=0, split="train")
            state, loss, g = step(state, programs.put_batch(batch))
            losses.append(float(loss))
            grads.append({jax.tree_util.keystr(p): (
                np.asarray(v)[slots] if permuted and "'layers'" in jax.tree_util.keystr(p)
                else np.asarray(v)) for p, v in jax.tree_util.tree_leaves_with_path(g)})
    return losses, grads


# 3 layers as uneven stages of 2 and 1 (slots 0, 1 | 2, unused 3). The router z-loss
# enters the loss through the stages' statistics; no balance loss (a product of means,
# which microbatching changes, so a 1-device run would differ).
UNEVEN = ["model.num_layers=3", "model.aux_loss_weight=0", "model.z_loss_weight=0.01"]


@pytest.fixture(scope="module")
def gpipe_run() -> Run:
    return _train("gpipe", *UNEVEN, "parallel.stage_layers=[2, 1]")


def _assert_same(got_run: Run, want_run: Run) -> None:
    """Losses and every gradient equal (rtol 1e-5)."""
    (losses, grads), (want_losses, want_grads) = got_run, want_run
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_the_transformer_trains_alike_under_gpipe_and_1f1b(gpipe_run: Run) -> None:
    want_losses, want_grads = gpipe_run
    losses, grads = _train("1f1b", *UNEVEN, "parallel.stage_layers=[2, 1]")
    _assert_same((losses, grads), (want_losses, want_grads))


# 4 layers, 2 stages of 2 chunks of 1 layer: stage 0 holds layers 0 and 2, stage 1 1 and 3.
EVEN4 = ["model.num_layers=4", "model.aux_loss_weight=0", "model.z_loss_weight=0.01"]


def test_the_transformer_trains_alike_under_gpipe_and_interleaved() -> None:
    want_losses, want_grads = _train("gpipe", *EVEN4)
    losses, grads = _train("interleaved", *EVEN4, "parallel.virtual_stages=2")
    _assert_same((losses, grads), (want_losses, want_grads))


def test_uneven_stages_train_like_one_device(gpipe_run: Run) -> None:
    want_losses, want_grads = _train("gpipe", *UNEVEN, strategy="one device")
    losses, grads = gpipe_run
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|collective-permute|all-to-all|"
                         r"reduce-scatter)(-start)?\(")


def _collectives_in_conditionals(hlo: str) -> list[str]:
    """The collectives of a compiled module that run inside a ``conditional``'s branches
    (directly or in anything those call)."""
    bodies: dict[str, str] = {}
    for m in re.finditer(r"^(?:ENTRY )?%(\S+) \(.*?\{\n(.*?)^\}", hlo, re.M | re.S):
        bodies[m.group(1)] = m.group(2)
    branches = [name for body in bodies.values()
                for m in re.finditer(r"(?:branch_computations=\{([^}]*)\}|"
                                     r"(?:true|false)_computation=(%[\w.-]+))", body)
                for name in re.findall(r"%([\w.-]+)", m.group(0))]
    seen, found = set(), []
    while branches:
        name = branches.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        found += [m.group(0) for m in _COLLECTIVE.finditer(bodies[name])]
        branches += [n for n in re.findall(r"%([\w.-]+)", bodies[name]) if n in bodies]
    return found


def test_the_checker_finds_a_collective_in_a_cond() -> None:
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    step = jax.jit(jax.shard_map(
        lambda a: jax.lax.cond(a.sum() > 0, lambda a: a * jax.lax.psum(a.sum(), "x"),
                               lambda a: a, a),
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    assert _collectives_in_conditionals(step.lower(jnp.ones(8)).compile().as_text()) == [
        "all-reduce("]


def test_an_unused_slot_never_reaches_the_loss_or_the_gradients() -> None:
    # NaN weights in stage 1's unused slot (3): the loss and every gradient stay finite.
    # XLA:CPU runs no collective inside a cond (it would not order it against the
    # schedule's sends, and a 1F1B step deadlocked): the slot's block runs on zeroed
    # weights and is selected away, where other backends skip it with a cond.
    from flax import nnx

    from meshkit.model.transformer import skip_slots_by_cond
    from meshkit.training import Programs
    from meshkit.training.models import transformer_loss

    config = _config(STRATEGIES["dp2-pp2-tp2"], *UNEVEN, "parallel.stage_layers=[2, 1]")
    mesh = config.strategy().mesh()
    batch = np.zeros((config.train.batch_size, config.train.seq_len + 1), np.int32)
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)

        def loss_and_grads(state: Any, batch: jax.Array) -> Any:
            with programs._logical():
                model, _ = nnx.merge(programs.graphdef, state)
                layers = nnx.state(model.layers)
                nnx.update(model.layers, jax.tree.map(lambda v: v.at[3].set(jnp.nan), layers))
                return nnx.value_and_grad(lambda m: transformer_loss(m, batch)[0])(model)

        state, batch = programs.init(), programs.put_batch(batch)
        compiled = jax.jit(loss_and_grads).lower(state, batch).compile()
        assert _collectives_in_conditionals(compiled.as_text()) == []
        with skip_slots_by_cond():  # as accelerators run it: compiled, not run here
            retraced = jax.jit(lambda state, batch: loss_and_grads(state, batch))
            as_measured = retraced.lower(state, batch).compile().as_text()
        assert "all-reduce(" in _collectives_in_conditionals(as_measured)
        loss, grads = compiled(state, batch)
    assert np.isfinite(float(loss))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(np.asarray(g)).all(), jax.tree_util.keystr(path)


def test_schedule_options_that_do_not_fit_the_call_are_refused_by_name() -> None:
    from flax import nnx

    from meshkit.config import ModelConfig
    from meshkit.model.pipeline import pipeline
    from meshkit.model.transformer import Transformer

    with pytest.raises(NotImplementedError, match=r"'1f1b' needs the loss inside the schedule"):
        pipeline(jnp.ones((2, 3)), jnp.ones((4, 3)), microbatches=2, apply=lambda w, h: h,
                 schedule="1f1b")
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule 'interleaved', "
                                         r"got 'gpipe'"):
        Transformer(ModelConfig(), virtual_stages=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"virtual_stages=2 does not divide the layers per "
                                         r"stage \(num_layers=2 over 2 stages\)"):
        Transformer(ModelConfig(), schedule="interleaved", virtual_stages=2, stages=2,
                    rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"stage_layers cannot be combined with schedule "
                                         r"'interleaved'"):
        Transformer(ModelConfig(), schedule="interleaved", stage_layers=[1, 1],
                    rngs=nnx.Rngs(0))
    with (pytest.raises(ValueError, match=r"parallel.microbatches: the interleaved schedule "
                                          r"needs at least as many microbatches as stages"),
          jax.set_mesh(_mesh(4))):
        jax.jit(jax.shard_map(
            lambda x: interleaved(lambda c, h: (h, {}), x, "pp", virtual_stages=2)[0],
            in_specs=P(), out_specs=P("pp")))(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"schedule 'zigzag' is unknown; valid: gpipe, 1f1b"):
        Transformer(ModelConfig(), schedule="zigzag", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"stage_layers \[1, 2\] must be >= 1 each and sum to "
                                         r"num_layers=2"):
        Transformer(ModelConfig(), stage_layers=[1, 2], rngs=nnx.Rngs(0))


def test_a_layout_without_a_pipeline_drops_the_base_configs_schedule() -> None:
    from meshkit.config import load_config
    from meshkit.plan.planner import Layout

    base = load_config(None, ["parallel.schedule=1f1b", "mesh.axes={pp: 2, node: 2, device: 2}",
                              "parallel.pipeline=pp", "parallel.stage_layers=[1, 1]"])
    assert Layout(data=8).config(base).parallel.schedule == "gpipe"
    assert Layout(data=8).config(base).parallel.stage_layers is None
    assert Layout(pipeline=2, data=4).config(base).parallel.schedule == "1f1b"
    base = load_config(None, ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                              "mesh.axes={pp: 2, node: 2, device: 2}", "parallel.pipeline=pp",
                              "parallel.microbatches=2", "model.num_layers=4"])
    assert Layout(data=8).config(base).parallel.virtual_stages == 1



def _all_reduces_by_place(hlo: str) -> tuple[list[str], list[str]]:
    """The result types of the compiled step's all-reduces: inside a while loop's body
    (the schedule's ticks), and elsewhere."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside: list[str] = []
    outside: list[str] = []
    computation = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
        result = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        if result:
            (inside if computation in bodies else outside).append(result.group(1))
    return inside, outside


@pytest.mark.parametrize("schedule", [
    ["parallel.schedule=1f1b"],
    ["parallel.schedule=gpipe"],
    ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=4"],
], ids=lambda s: s[0].split("=")[1])
def test_schedules_sum_weight_gradients_once_after_their_ticks(schedule: list[str]) -> None:
    # pp2·dp2·tp2, d_ff 48: only the expert weights have a dimension of 48. Each tick
    # used to all-reduce every weight's gradient (over dp; the experts' over tp too) and
    # add it to the accumulator; now the ticks add local gradients, summed once after.
    from meshkit.config import load_config
    from meshkit.training import compile_step

    config = load_config(None, [
        "model.d_model=32", "model.num_heads=2", "model.d_ff=48", "model.num_layers=2",
        "model.num_experts=4", "model.vocab_size=32", "train.batch_size=8",
        "train.seq_len=8", "mesh.axes={pp: 2, dp: 2, tp: 2}", "parallel.pipeline=pp",
        "parallel.tensor=tp", "exchange.node_axis=[]", "exchange.device_axis=[]",
        "parallel.microbatches=2", *schedule])
    inside, outside = _all_reduces_by_place(compile_step(config).as_text())
    assert inside, "no all-reduce in the ticks: the loop was not found"
    # A layer's weights, or a stage's (or a chunk's) stacked.
    weights = re.compile(r"f32\[(\d+,)?(4,32,48|4,48,32|32,3,1,16)\]")
    assert not [t for t in inside if weights.search(t)], inside
    assert any(weights.search(t) for t in outside), outside
