"""Shared by the MoE, dedup and ragged tests: sizes, a numpy reference MoE, weight clones,
and a differentiable dense JAX reference for the pluggable MoE's tests."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

D, F, E, K = 8, 16, 16, 2  # 16 experts: two per device on 8 devices
B, T = 8, 6  # one sequence of 6 tokens per device


def _variant(model, **settings):
    """The same weights under other static settings (dispatch, exchange), no re-init."""
    clone = nnx.clone(model)
    for name, value in settings.items():
        setattr(clone, name, value)
    return clone


def _np_route(p, k, num_nodes=1, max_nodes=None):
    """Numpy node-limited top-k: node score = sum of its top ceil(k/max_nodes) probs."""
    n, e = p.shape
    cand = p
    if max_nodes is not None and max_nodes < num_nodes:
        per = e // num_nodes
        best = min(per, -(-k // max_nodes))
        score = -np.sort(-p.reshape(n, num_nodes, per), axis=-1)[..., :best].sum(-1)
        kept = np.argsort(-score, axis=-1, kind="stable")[:, :max_nodes]
        allowed = np.zeros((n, num_nodes), bool)
        np.put_along_axis(allowed, kept, True, axis=-1)
        cand = np.where(np.repeat(allowed, per, axis=1), p, -1.0)
    top = np.argsort(-cand, axis=-1, kind="stable")[:, :k]
    gates = np.take_along_axis(p, top, -1)
    if k >= 2:
        gates = gates / gates.sum(-1, keepdims=True)
    return top, gates


def _reference(model, x, n_batch_devices, num_nodes=2):
    """Numpy: per device, route its tokens, count slots in a loop, sum gate · FFN_e
    (+ the shared experts' SwiGLU)."""
    k = model.top_k
    router = np.asarray(model.router[...], np.float64)
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (model.w_gate, model.w_up, model.w_down))
    xs = np.asarray(x, np.float64)
    y = np.zeros_like(xs)
    b = xs.shape[0] // n_batch_devices
    dropped = 0
    first = np.zeros(E)
    mean_p = np.zeros(E)
    for dev in range(n_batch_devices):
        tok = xs[dev * b : (dev + 1) * b].reshape(-1, D)
        n = tok.shape[0]
        logits = tok @ router
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top, gates = _np_route(p, k, num_nodes, model.max_nodes)
        cap = math.ceil(model.capacity_factor * n * k / E) or n  # 0: dropless
        fill = np.zeros(E, int)
        out = np.zeros_like(tok)
        if model.num_shared_experts:
            sg, su, sd = (np.asarray(w[...], np.float64)
                          for w in (model.shared_gate, model.shared_up, model.shared_down))
            h = tok @ sg
            out += (h / (1 + np.exp(-h)) * (tok @ su)) @ sd
        for j in range(k):  # choice-major: all first choices before any second choice
            for t in range(n):
                e = top[t, j]
                if fill[e] < cap:
                    h = tok[t] @ wg[e]
                    h = h / (1 + np.exp(-h)) * (tok[t] @ wu[e])
                    out[t] += gates[t, j] * (h @ wd[e])
                else:
                    dropped += 1
                fill[e] += 1
        y[dev * b : (dev + 1) * b] = out.reshape(b, T, D)
        first += np.bincount(top[:, 0], minlength=E) / n / n_batch_devices
        mean_p += p.mean(0) / n_batch_devices
    return y, dropped, E * np.sum(first * mean_p)


def _softmax_top_k(w_router, k):
    """The built-in router's routing (no node limit) in plain JAX: ``tokens -> (index, gate)``."""

    def routing(tokens):
        probs = jax.nn.softmax(tokens.astype(jnp.float32) @ w_router, axis=-1)
        gate, index = jax.lax.top_k(probs, k)
        if k >= 2:
            gate = gate / gate.sum(-1, keepdims=True)
        return index, gate

    return routing


def _dense_moe(tokens, routing, expert_fn):
    """JAX, one device, differentiable: each token through each of its chosen experts.

    ``routing(tokens [n, d]) -> (index [n, k], gate [n, k])``; ``expert_fn(index, tokens)
    -> [n, k, d]`` runs expert ``index[t, j]`` on token ``t``. No exchange, no capacity:
    what every MoE layer and dispatcher must give when nothing is dropped.
    """
    index, gate = routing(tokens)
    return jnp.einsum("nk,nkd->nd", gate, expert_fn(index, tokens))
