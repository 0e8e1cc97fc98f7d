"""Loss and gradients of issue 36's matched dp8 step: this tree's code against a patch.

Usage: python tools/temp_parity.py PATCH   (PATCH: a module in tools/ defining ``apply()``,
which swaps in the reference code; e.g. the attention before the temp fix)

Runs the train step's loss and gradients (``nnx.value_and_grad`` of the transformer
loss, the matched shape, 8 simulated devices) with this tree's code and with the patch,
and prints the loss difference and each gradient's largest relative difference.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax
import numpy as np
from flax import nnx

jax.config.update("jax_platforms", "cpu")

from temp_bytes import config  # noqa: E402

from meshkit.training.models import transformer_loss  # noqa: E402
from meshkit.training.programs import Programs  # noqa: E402


def grads(experts: int) -> tuple[float, dict[str, np.ndarray]]:
    cfg = config(experts)
    mesh = cfg.strategy().mesh()
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                              (32, 65), dtype=np.int32)
    with jax.set_mesh(mesh):
        programs = Programs(cfg, mesh)
        state = programs.init()

        @jax.jit
        def step(state, batch):  # type: ignore[no-untyped-def]
            with programs._logical():
                model, _ = nnx.merge(programs.graphdef, state)
                (loss, _), g = nnx.value_and_grad(transformer_loss, has_aux=True)(model, batch)
                return loss, nnx.to_pure_dict(g)

        loss, g = step(state, programs.put_batch(batch))
        flat = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_leaves_with_path(g)}
        return float(loss), flat


for experts in (1, 8):
    new = grads(experts)
    importlib.import_module(sys.argv[1]).apply()
    old = grads(experts)
    importlib.import_module(sys.argv[1]).revert()
    worst = max((float(np.max(np.abs(new[1][k] - old[1][k])) / (np.max(np.abs(old[1][k])) or 1)),
                 k) for k in old[1])
    print(f"experts={experts}: loss {new[0]!r} vs {old[0]!r} (diff {new[0] - old[0]:.3g}); "
          f"largest gradient difference / the gradient's max {worst[0]:.3g} at {worst[1]}")
