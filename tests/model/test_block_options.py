"""Remat policies and attention kinds: the same losses and gradients as ``none``/``xla``.

Three SGD steps of one jitted program per option, on one device and on an fsdp·tp
layout (where the layers run scanned, FSDP weights are gathered inside the loop and
the tensor all-reduce sits inside the remat), each against one device with ``xla``
attention and no remat, to rtol 1e-5. To keep compiles few, each model-level run pairs
one attention kind with one remat policy; :func:`attention` itself is compared kind by
kind. Memory and FLOPs per option: ``meshkit bench memory_block``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _sgd import Run, assert_same_run, sgd_run
from flax import nnx

from meshkit.cli import main
from meshkit.config import ConfigError, load_config
from meshkit.model.attention import attention
from meshkit.model.pipeline import pipeline
from meshkit.model.remat import remat
from meshkit.model.transformer import Transformer

MODEL = [
    "model.vocab_size=16", "model.d_model=16", "model.num_heads=2", "model.d_ff=16",
    "model.num_layers=2", "model.num_experts=4", "model.top_k=2", "model.capacity_factor=2",
    "model.attention_chunk=4", "train.batch_size=8", "train.seq_len=8",
    "exchange.node_axis=[]", "exchange.device_axis=[]",
]
LAYOUTS = {
    "one": ["mesh.axes={dp: 1}"],
    "fsdp4-tp2": ["mesh.axes={fsdp: 4, tp: 2}", "parallel.fsdp=fsdp", "parallel.tensor=tp"],
}
VARIANTS = {
    "dot_product+save_dots": ["model.attention=dot_product", "model.remat=save_dots"],
    "chunked+full": ["model.attention=chunked", "model.remat=full"],
}
STEPS = 3


@pytest.fixture(scope="module")
def initial() -> dict[str, Any]:
    """The initial parameters, created once (eagerly, on one device) for every run:
    each layout and option then only compiles its step."""
    with nnx.use_eager_sharding(False):
        model = Transformer.from_config(load_config(None, [*MODEL, *LAYOUTS["one"]]))
    return nnx.to_pure_dict(nnx.state(model))


def _run(layout: str, extra: list[str], initial: dict[str, Any]) -> Run:
    """Losses and gradients of ``STEPS`` plain SGD steps on one batch (one compile)."""
    return sgd_run(load_config(None, [*MODEL, *LAYOUTS[layout], *extra]), initial, STEPS)


@pytest.fixture(scope="module")
def references() -> dict[str, Run]:
    return {}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_options_match_xla_attention_without_remat(
        layout: str, variant: str, initial: dict[str, Any], references: dict[str, Run]) -> None:
    # One reference for both layouts: an option on the fsdp·tp mesh matches one device.
    if not references:
        references["one"] = _run("one", [], initial)
    want_losses, want_grads = references["one"]
    assert want_losses[-1] < want_losses[0]  # the steps do something
    assert_same_run(_run(layout, VARIANTS[variant], initial), (want_losses, want_grads))


@pytest.mark.parametrize("causal", [True, False])
def test_each_attention_kind_matches_xla(causal: bool) -> None:
    q, k, v, g = jax.random.normal(jax.random.key(0), (4, 2, 12, 2, 4))

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def grads(kind: str, chunk: int) -> tuple[jax.Array, ...]:
        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return jnp.sum(attention(q, k, v, kind=kind, chunk=chunk, causal=causal) * g)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    want = jax.tree.leaves(grads("xla", 12))
    # chunk 4: three blocks (the causal skip and the diagonal mask).
    kinds = (("dot_product", 12), ("chunked", 4)) if causal else (("chunked", 4),)
    for kind, chunk in kinds:
        for got, ref in zip(jax.tree.leaves(grads(kind, chunk)), want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=f"{kind}/{chunk}")


def test_chunked_attention_accumulates_bfloat16_in_float32() -> None:
    q, k, v = jax.random.normal(jax.random.key(1), (3, 1, 16, 2, 8))
    want = jax.jit(attention)(q, k, v)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(functools.partial(attention, kind="chunked", chunk=4))(*half)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.03)


def test_xla_attention_keeps_one_score_array_per_layer_for_backward() -> None:
    # The scores dominate (T = 128, one head of 2): each further attention layer before
    # the backward pass adds what XLA keeps of it, in units of one [B, H, T, T] array.
    # The exponentials only (normalising the output); the probabilities too would be 2.
    x, g = jax.random.normal(jax.random.key(2), (2, 1, 128, 1, 2))

    def temp(layers: int) -> int:
        def loss(x: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = attention(x, x, x)
            return jnp.sum(x * g)

        stats = jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis()
        return int(stats.temp_size_in_bytes)

    per_layer = (temp(4) - temp(2)) / 2 / (128 * 128 * 4)
    assert 0.5 < per_layer < 1.5, per_layer


def test_remat_wraps_a_users_blocks_in_the_pipeline_api() -> None:
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key: jax.Array) -> nnx.Linear:
        return nnx.Linear(4, 4, rngs=nnx.Rngs(params=key))

    blocks = make(jax.random.split(jax.random.key(0), 3))  # 3 stacked layers
    x = jax.random.normal(jax.random.key(1), (4, 4))

    def grad(policy: str) -> jax.Array:
        apply = remat(lambda block, h: jnp.tanh(block(h)), policy)
        loss = nnx.grad(lambda m: jnp.sum(pipeline(m, x, microbatches=2, apply=apply) ** 2))
        return nnx.jit(loss)(blocks)["kernel"][...]

    np.testing.assert_allclose(grad("full"), grad("none"), rtol=1e-6)


@pytest.mark.parametrize(("override", "message"), [
    ("model.remat=some", "model.remat: must be one of none, full, save_dots; got 'some'"),
    ("model.attention=flash", "model.attention: must be one of xla, dot_product, chunked"),
    ("model.attention_chunk=3", "model.attention_chunk: 3 does not divide train.seq_len=8"),
])
def test_bad_options_are_refused_naming_the_key(
        override: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunked = [] if "remat" in override else ["model.attention=chunked"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MODEL, *chunked, override])
    # The command line: exit 2, one line naming the key, before anything compiles.
    assert main(["train", *MODEL, *chunked, override, f"train.workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_library_calls_refuse_unknown_names() -> None:
    q = jnp.ones((1, 6, 1, 2))
    with pytest.raises(ValueError, match="unknown kind 'flash'; valid: xla, dot_product"):
        attention(q, q, q, kind="flash")
    with pytest.raises(ValueError, match="chunk 4 does not divide the sequence length 6"):
        attention(q, q, q, kind="chunked", chunk=4)
    with pytest.raises(ValueError, match="unknown policy 'all'; valid: none, full, save_dots"):
        remat(lambda x: x, "all")
