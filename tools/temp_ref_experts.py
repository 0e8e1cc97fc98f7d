"""The gated FFN's backward pass as committed, for tools/temp_parity.py.

With the proposed tie to ``dy`` applied to ``meshkit/model/experts.py`` (issue 36's
temp report), ``python tools/temp_parity.py temp_ref_experts`` compares the two.
"""

import jax

from meshkit.model import experts

_NEW = experts._gated_down_bwd


def _old(activation, res, dy):  # type: ignore[no-untyped-def]
    g, u, w_down, group_sizes = res
    _, vjp = jax.vjp(lambda g, u, w: experts._down(activation, g, u, w, group_sizes),
                     g, u, w_down)
    dg, du, dw = vjp(dy)
    return dg, du, dw, None


def apply() -> None:
    experts._gated_down.defvjp(experts._gated_down_fwd, _old)


def revert() -> None:
    experts._gated_down.defvjp(experts._gated_down_fwd, _NEW)
