"""Context parallelism: the sequence split over the context axes, under every method.

Each layout runs two plain SGD steps of meshkit's transformer from the same initial
parameters (made once on one device) and must give the one-device run's losses and
gradients to rtol 1e-5; the kernel alone is checked against one device for every method
on every context mesh; the compiled step must move K/V over exactly the context groups,
as each method says.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _sgd import Run, assert_same_run, sgd_run
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshkit.config import Config, load_config
from meshkit.model import flash
from meshkit.model.context import from_zigzag, local_attention, to_zigzag, zigzag_order
from meshkit.model.transformer import Transformer
from meshkit.sharding.place import shard_model
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy import Strategy
from meshkit.strategy.hlo import collectives, groups_as_ranks
from meshkit.training import compile_step

BASE = [
    "model.vocab_size=16", "model.d_model=16", "model.num_heads=4", "model.d_ff=16",
    "model.num_layers=2", "model.aux_loss_weight=0", "train.batch_size=4",
    "train.seq_len=16", "model.num_experts=0", "exchange.node_axis=[]",
    "exchange.device_axis=[]",
]
GQA = ["model.num_heads=8", "model.num_kv_heads=2"]
MOE = ["model.num_experts=4", "model.top_k=2", "model.capacity_factor=2"]
ONE = ["mesh.axes={dp: 1}"]
CP4 = ["mesh.axes={cp: 4}", "parallel.context=cp"]
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    # name: (model options, layout options); one method per layout, every method twice.
    "dp2-cp4-ring": ([], ["mesh.axes={dp: 2, cp: 4}", "parallel.context=cp",
                          "parallel.context_method=ring"]),
    "cp4-all_gather-gqa": (GQA, [*CP4, "parallel.context_method=all_gather"]),
    "cpn2-cpd2-hierarchical": ([], ["mesh.axes={cpn: 2, cpd: 2}", "parallel.context=[cpn, cpd]",
                                    "parallel.context_method=hierarchical"]),
    "tp2-cp2-sp-ring-gqa": (GQA, ["mesh.axes={tp: 2, cp: 2}", "parallel.tensor=tp",
                                  "parallel.context=cp", "parallel.context_method=ring",
                                  "parallel.sequence_parallel=true"]),
    "pp2-cp2-1f1b-all_gather": ([], ["mesh.axes={pp: 2, cp: 2}", "parallel.pipeline=pp",
                                     "parallel.context=cp", "parallel.context_method=all_gather",
                                     "parallel.microbatches=2", "parallel.schedule=1f1b"]),
    "dp2-ep2-cp2-moe-ulysses": (MOE, ["mesh.axes={dp: 2, ep: 2, cp: 2}", "parallel.context=cp",
                                      "parallel.context_method=ulysses",
                                      "exchange.device_axis=ep"]),
}
STEPS = 2


def _config(model: list[str], layout: list[str]) -> Config:
    return load_config(None, [*BASE, *model, *layout])


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[dict[str, Any], Run]]:
    """Per model: its initial parameters and its one-device run, made on first use."""
    return {}


def _reference(model: list[str], references: dict[str, tuple[dict[str, Any], Run]]
               ) -> tuple[dict[str, Any], Run]:
    key = " ".join(model)
    if key not in references:
        config = _config(model, ONE)
        with nnx.use_eager_sharding(False):
            initial = nnx.to_pure_dict(nnx.state(Transformer.from_config(config)))
        references[key] = initial, sgd_run(config, initial, STEPS)
    return references[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_device(layout: str, references: Any) -> None:
    model, options = LAYOUTS[layout]
    initial, want = _reference(model, references)
    assert want[0][-1] < want[0][0]  # the steps do something
    assert_same_run(sgd_run(_config(model, options), initial, STEPS), want)


# ---------------------------------------------------------------------- kernel
def _reference_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                         segments: jax.Array | None) -> jax.Array:
    """Materialised causal attention on one device, kv heads repeated."""
    t = q.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    keep = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if segments is not None:
        keep = keep & (segments[:, None, :, None] == segments[:, None, None, :])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -1e30), -1), v)


# The model's layouts above cover the methods without documents; these, with them:
# hierarchical's Ulysses and ring carry the document ids as the plain methods do.
KERNEL_MESHES = {"cp4": ({"cp": 4}, ("cp",), ("all_gather",)),
                 "cpn2-cpd2": ({"cpn": 2, "cpd": 2}, ("cpn", "cpd"), ("ring", "hierarchical"))}


@pytest.mark.parametrize("mesh_name", list(KERNEL_MESHES))
def test_every_method_matches_one_device(mesh_name: str) -> None:
    """Output and gradients of q, k and v, with 8 query heads on 4 kv heads and packed
    documents, against materialised attention; float32, rtol 1e-5."""
    shape, axes, methods = KERNEL_MESHES[mesh_name]
    mesh = Strategy.from_axes(shape).mesh()
    c = int(np.prod([shape[a] for a in axes]))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 32, 8, 4))
    k, v = (jax.random.normal(key, (2, 32, 4, 4)) for key in keys[1:])
    segments = jnp.asarray([[0] * 5 + [1] * 17 + [2] * 10, [0] * 32])
    spec = P(None, axes)

    def loss_of(method: str) -> Any:
        def local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
            return local_attention(q, k, v, axes=axes, method=method, segment_ids=seg,
                                   chunk=2)

        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            args = [to_zigzag(x, c) for x in (q, k, v, segments)]
            out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(*args)
            return jnp.sum(jnp.sin(from_zigzag(out, c)))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(_reference_attention(q, k, v, segments)))

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
    for method in methods:
        with jax.set_mesh(mesh):
            got, grads = loss_of(method)(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=method)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=method)


def test_zigzag_gives_each_device_an_early_and_a_late_chunk() -> None:
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = jnp.arange(24).reshape(2, 12)
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, 3), 3), x)
    with pytest.raises(ValueError, match="2·4 equal chunks"):
        zigzag_order(12, 4)


def test_a_query_seeing_no_key_merges_to_nothing() -> None:
    q = jnp.ones((1, 2, 1, 2))
    out, lse = flash.forward(q, q, q, q_index=jnp.arange(2), kv_index=jnp.arange(2) + 5,
                             chunk=2)
    assert not np.isfinite(np.asarray(lse)).any() and not np.asarray(out).any()


def _model_on(config: Config, initial: dict[str, Any]) -> Transformer:
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer.from_config(config)))
    nnx.replace_by_pure_dict(state, initial)
    return shard_model(nnx.merge(graphdef, state), config.strategy().mesh(),
                       ShardingRules.from_config(config))


def test_a_packed_row_is_its_documents_run_one_by_one() -> None:
    """Three documents (each ending with the eos id 0) and the start of a fourth in one
    row, split over cpn2 × cpd2 (hierarchical): the loss is the token mean of the
    documents' losses, each run alone on one device; the fourth predicts nothing."""
    docs = [[3, 4, 5, 0], [6, 7, 8, 9, 10, 0], [11, 12, 13, 14, 15, 0]]
    row = jnp.asarray([[t for doc in docs for t in doc] + [2]], jnp.int32)  # [1, T + 1]
    packed = _config(["data.eos_id=0"], [
        "mesh.axes={cpn: 2, cpd: 2}", "parallel.context=[cpn, cpd]",
        "parallel.context_method=hierarchical", "train.batch_size=1"])
    one = _config([], [*ONE, "train.batch_size=1"])
    with nnx.use_eager_sharding(False):
        initial = nnx.to_pure_dict(nnx.state(Transformer.from_config(one)))
    model = _model_on(packed, initial)
    with jax.set_mesh(packed.strategy().mesh()):
        _, (ce, _) = nnx.jit(lambda m: m.loss(row))(model)
    alone = _model_on(one, initial)
    total = count = 0.0
    with jax.set_mesh(one.strategy().mesh()):
        for doc in docs:
            tokens = jnp.asarray([doc], jnp.int32)
            logits, _ = nnx.jit(lambda m, t: m(t))(alone, tokens[:, :-1])
            total += float(jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:])))
            count += len(doc) - 1
    np.testing.assert_allclose(float(ce), total / count, rtol=1e-5)
    # The logits come back in token order: the packed row's, on one device.
    with jax.set_mesh(packed.strategy().mesh()):
        split, _ = nnx.jit(lambda m: m(row[:, :-1]))(model)
    one_packed = _config(["data.eos_id=0"], [*ONE, "train.batch_size=1"])
    with jax.set_mesh(one.strategy().mesh()):
        whole, _ = nnx.jit(lambda m: m(row[:, :-1]))(_model_on(one_packed, initial))
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-6)


def _ranks(config: Config, op: str) -> list[tuple[tuple[int, ...], ...]]:
    """Each ``op`` collective's groups (a permute's: its (source, target) pairs) as ranks."""
    strategy = config.strategy()
    return [tuple(tuple(g) for g in groups_as_ranks(c.groups, strategy))
            for c in collectives(compile_step(config)) if c.op == op]


def _axis_groups(config: Config, *axes: str) -> set[tuple[int, ...]]:
    return {tuple(g) for g in config.strategy().groups(axes).tolist()}


def _ring_pairs(config: Config, *axes: str) -> set[tuple[int, int]]:
    """(source, next) pairs round each group of ``axes``, both directions."""
    pairs = set()
    for g in _axis_groups(config, *axes):
        for i, r in enumerate(g):
            pairs |= {(r, g[(i + 1) % len(g)]), (g[(i + 1) % len(g)], r)}
    return pairs


HLO_LAYOUTS = {
    "ring": ["mesh.axes={dp: 2, cp: 4}", "parallel.context=cp", "parallel.context_method=ring"],
    "all_gather": ["mesh.axes={dp: 2, cp: 4}", "parallel.context=cp",
                   "parallel.context_method=all_gather"],
    "ulysses": ["mesh.axes={dp: 2, cp: 4}", "parallel.context=cp",
                "parallel.context_method=ulysses"],
    "hierarchical": ["mesh.axes={cpn: 2, dp: 2, cpd: 2}", "parallel.context=[cpn, cpd]",
                     "parallel.context_method=hierarchical"],
}
ONE_LAYER = ["model.num_layers=1"]  # the groups are the same in every layer


@pytest.mark.parametrize("method", list(HLO_LAYOUTS))
def test_the_compiled_step_moves_kv_over_the_context_groups(method: str) -> None:
    config = _config(ONE_LAYER, HLO_LAYOUTS[method])
    context = config.context_axes
    cp = {tuple(sorted(g)) for g in _axis_groups(config, *context)}
    permutes = [pair for c in _ranks(config, "collective-permute") for pair in c]
    a2a = [{tuple(sorted(g)) for g in c} for c in _ranks(config, "all-to-all")]
    gathers = [{tuple(sorted(g)) for g in c} for c in _ranks(config, "all-gather")]
    if method == "ring":
        assert permutes and set(permutes) <= _ring_pairs(config, "cp")
        assert not a2a
    elif method == "all_gather":
        assert cp in gathers and not permutes and not a2a
    elif method == "ulysses":
        assert a2a and all(g == cp for g in a2a) and not permutes
    else:
        inner = {tuple(sorted(g)) for g in _axis_groups(config, "cpd")}
        assert a2a and all(g == inner for g in a2a)
        assert permutes and set(permutes) <= _ring_pairs(config, "cpn")


def test_sequence_parallel_reduce_scatters_where_it_would_all_reduce() -> None:
    """tp2 · cp2 with sequence parallelism: no [b, T, d] activation is all-reduced over
    the tensor groups, forward or backward; reduce-scatters and all-gathers there instead."""
    config = _config([*GQA, *ONE_LAYER], LAYOUTS["tp2-cp2-sp-ring-gqa"][1])
    strategy = config.strategy()
    tp = {tuple(sorted(g)) for g in _axis_groups(config, "tp")}
    step = collectives(compile_step(config))

    def over_tp(c: Any) -> bool:
        return {tuple(sorted(g)) for g in groups_as_ranks(c.groups, strategy)} == tp

    activations = [c for c in step if c.op == "all-reduce" and over_tp(c)
                   and len(c.shape) == 3 and c.shape[-1] == config.model.d_model]
    assert not activations, activations
    assert any(c.op == "reduce-scatter" and over_tp(c) for c in step)
    assert any(c.op == "all-gather" and over_tp(c) for c in step)


def test_the_api_names_what_it_refuses() -> None:
    """meshkit.context_attention outside a config: each bad input, one message."""
    import meshkit

    mesh = Strategy.from_axes({"cp": 4, "dp": 2}).mesh()
    rules = meshkit.ShardingRules(data="dp", context="cp")
    q = jnp.ones((2, 16, 2, 4))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="method must be one of auto, all_gather"):
            meshkit.context_attention(q, q, q, rules=rules, method="p2p")
        with pytest.raises(ValueError, match="a sequence of 12 tokens does not cut into 2·4"):
            meshkit.context_attention(q[:, :12], q[:, :12], q[:, :12], rules=rules)
        with pytest.raises(ValueError, match="ulysses splits the 2 local query heads over 4"):
            jax.jit(lambda q: meshkit.context_attention(q, q, q, rules=rules,
                                                        method="ulysses"))(q)
        with pytest.raises(ValueError, match="hierarchical needs an outer and an inner"):
            jax.jit(lambda q: meshkit.context_attention(q, q, q, rules=rules,
                                                        method="hierarchical"))(q)
    with pytest.raises(ValueError, match=r"under `with jax\.set_mesh"):
        meshkit.context_attention(q, q, q, rules=rules)


def test_the_rules_in_effect_stand_in_for_rules() -> None:
    """Without rules=, context_attention and the zigzag helpers read the logical rules in
    effect (as a factory model's step runs under meshkit's trainer)."""
    import meshkit

    mesh = Strategy.from_axes({"dp": 2, "cp": 4}).mesh()
    rules = meshkit.ShardingRules(data="dp", context="cp")
    q = jax.random.normal(jax.random.key(1), (2, 16, 2, 4))

    def run(given: meshkit.ShardingRules | None) -> jax.Array:
        zz = meshkit.to_zigzag(q, given)
        return meshkit.from_zigzag(meshkit.context_attention(zz, zz, zz, rules=given), given)

    with jax.set_mesh(mesh):
        want = jax.jit(lambda: run(rules))()
        with nnx.logical_axis_rules(rules.flax_rules()):
            got = jax.jit(lambda: run(None))()
        with pytest.raises(ValueError, match="no sharding rules: pass rules="):
            run(None)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(want, _reference_attention(q, q, q, None), rtol=1e-5,
                               atol=1e-6)


def test_the_transformer_refuses_what_it_cannot_run() -> None:
    """Built directly (no config to check it first), each refusal names its argument."""
    from meshkit.config import ModelConfig

    model = ModelConfig(vocab_size=16, d_model=16, num_heads=4, d_ff=16, num_experts=0)
    rules = ShardingRules(pipeline="pp")
    with pytest.raises(ValueError, match="context_method must be one of all_gather"):
        Transformer(model, ShardingRules(), context_method="p2p", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"packed documents \(eos_id\) cannot be combined"):
        Transformer(model, rules, eos_id=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"packed documents \(eos_id\) cannot be combined"):
        Transformer(model, ShardingRules(), eos_id=0, microbatches=2, rngs=nnx.Rngs(0))
