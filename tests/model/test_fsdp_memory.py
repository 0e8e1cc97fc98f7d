"""FSDP memory: what the backward pass keeps of an MoE layer and of a gathered weight.

Smallest shapes; no timing. The figures themselves are in ``meshkit bench memory``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshkit.config import load_config
from meshkit.model.experts import gated_ffn
from meshkit.model.transformer import _rms_norm
from meshkit.training import Programs


def _plain(rows, w_gate, w_up, w_down, group_sizes=None):  # type: ignore[no-untyped-def]
    """gated_ffn written out, differentiated by plain autodiff."""
    if group_sizes is None:
        g = jnp.einsum("esd,edf->esf", rows, w_gate)
        u = jnp.einsum("esd,edf->esf", rows, w_up)
        return jnp.einsum("esf,efd->esd", jax.nn.silu(g) * u, w_down)
    g = jax.lax.ragged_dot(rows, w_gate, group_sizes)
    u = jax.lax.ragged_dot(rows, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, group_sizes)


@pytest.mark.parametrize("grouped", [False, True])
def test_gated_ffn_gradients_equal_plain_autodiff(grouped: bool) -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    e, d, f = 2, 4, 6
    rows = jax.random.normal(keys[0], (5, d) if grouped else (e, 3, d))
    w_gate, w_up = (jax.random.normal(k, (e, d, f)) for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, f, d))
    sizes = jnp.array([2, 2], jnp.int32) if grouped else None
    dy = jax.random.normal(keys[4], rows.shape)

    def loss(fn):  # type: ignore[no-untyped-def]
        return lambda *w: jnp.sum(fn(*w, group_sizes=sizes) * dy)

    got = jax.grad(loss(gated_ffn), argnums=(0, 1, 2, 3))(rows, w_gate, w_up, w_down)
    want = jax.grad(loss(_plain), argnums=(0, 1, 2, 3))(rows, w_gate, w_up, w_down)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gated_ffn_keeps_only_gate_and_up_for_backward() -> None:
    # The [L, S, f] arrays the backward pass keeps: g and u only (the nonlinearity, the
    # product and their derivatives are recomputed there).
    e, s, d, f = 2, 3, 4, 5
    rows = jnp.ones((e, s, d))
    w_gate, w_up, w_down = jnp.ones((e, d, f)), jnp.ones((e, d, f)), jnp.ones((e, f, d))
    _, vjp = jax.vjp(gated_ffn, rows, w_gate, w_up, w_down)
    kept = [x for x in jax.tree.leaves(vjp) if getattr(x, "shape", None) == (e, s, f)]
    assert len(kept) == 2


def _scan_outputs_in_shard_map(jaxpr: Any, inside: bool = False) -> set[tuple[int, ...]]:
    """The shapes of every scan output inside a shard_map body (per-device shapes)."""
    shapes: set[tuple[int, ...]] = set()
    for eqn in jaxpr.eqns:
        here = inside or eqn.primitive.name == "shard_map"
        if here and eqn.primitive.name == "scan":
            shapes |= {tuple(v.aval.shape) for v in eqn.outvars}
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                shapes |= _scan_outputs_in_shard_map(sub, here)
    return shapes


def test_fsdp_step_never_stacks_gathered_layer_weights() -> None:
    # A scan that outputs [layers, *gathered weight] keeps every layer's full weights at
    # once (JAX's scan partial evaluation hoisting a stage's gathers out of the pipeline's
    # tick loop did): FSDP would save nothing. Per device, the stacked weights are
    # [layers, d/8, ...]; their whole (gathered) shapes must appear in no scan.
    config = load_config(None, [
        "model.vocab_size=16", "model.d_model=16", "model.num_heads=2", "model.d_ff=24",
        "model.num_layers=3", "model.num_experts=4", "train.batch_size=8",
        "train.seq_len=8", "mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp",
        "exchange.node_axis=[]", "exchange.device_axis=[]"])
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        traced = programs.train_step.trace(programs.abstract_state, programs.abstract_batch)
    params = programs.abstract_state[0]["layers"]
    gathered = {tuple(leaf.shape) for leaf in jax.tree.leaves(params)
                if "fsdp" in jax.tree.leaves(tuple(leaf.sharding.spec))}
    assert (3, 16, 3, 2, 8) in gathered  # the stacked QKV weight, for one
    outputs = _scan_outputs_in_shard_map(traced.jaxpr.jaxpr)
    assert (3, 2, 3, 2, 8) in outputs  # its per-device shards' gradient: scans were found
    assert not gathered & outputs


def test_rms_norm_keeps_one_full_size_array_for_backward() -> None:
    # x only: x**2 would keep its derivative 2x as well, one more [b, T, d] per norm.
    x = jnp.arange(24.0).reshape(2, 3, 4)
    _, vjp = jax.vjp(lambda x: _rms_norm(x, jnp.ones(4), 1e-6), x)
    assert sum(getattr(a, "shape", None) == x.shape for a in jax.tree.leaves(vjp)) == 1
