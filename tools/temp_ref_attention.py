"""The ``xla`` attention normalised before the product with v (jax.nn.softmax), for
tools/temp_parity.py."""

import jax
import jax.numpy as jnp

from meshkit.model import attention

_NEW = attention._xla


def _old(q, k, v, *, causal):  # type: ignore[no-untyped-def]
    t = q.shape[1]
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * q.shape[-1] ** -0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores,
                           jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", weights, v)


def apply() -> None:
    attention._xla = _old


def revert() -> None:
    attention._xla = _NEW
