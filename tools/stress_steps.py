"""Run one config's train step many times on 8 simulated CPU devices, to catch a race.

A collective that two devices reach in different orders hangs them for good; XLA:CPU
then aborts the process (exit 134) once a device has waited ``--timeout`` seconds. The
step is the one of ``tests/model/test_schedules.py`` (an AdamW step that returns its
gradients too), and the default config the one whose 1F1B step with uneven stages
deadlocked there while its unused slots were skipped by a ``jax.lax.cond`` (``--cond``
traces that program again). Load the cores meanwhile (``python -c "while True: pass" &``
twice) to make the race likely.

Usage: python tools/stress_steps.py [--steps 400] [--timeout 20] [--cond] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

UNEVEN_1F1B = [
    "model.vocab_size=16", "model.d_model=16", "model.num_heads=2", "model.d_ff=16",
    "model.num_experts=8", "model.top_k=2", "model.capacity_factor=4",
    "model.num_layers=3", "model.aux_loss_weight=0", "model.z_loss_weight=0.01",
    "train.batch_size=16", "train.seq_len=8",
    "mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp", "parallel.tensor=tp",
    "exchange.device_axis=[]", "parallel.microbatches=4", "parallel.schedule=1f1b",
    "parallel.stage_layers=[2, 1]",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--timeout", type=int, default=20,
                        help="seconds a device may wait in a collective before XLA aborts")
    parser.add_argument("--cond", action="store_true",
                        help="skip unused slots with a cond on CPU too (the program that hung)")
    parser.add_argument("overrides", nargs="*", default=UNEVEN_1F1B)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds="
                               f"{args.timeout}")
    import jax
    import numpy as np
    from flax import nnx

    from meshkit.config import load_config
    from meshkit.model.transformer import skip_slots_by_cond
    from meshkit.training import Programs
    from meshkit.training.models import transformer_loss

    config = load_config(None, args.overrides)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh), skip_slots_by_cond() if args.cond else contextlib.nullcontext():
        programs = Programs(config, mesh)

        @jax.jit
        def step(state: Any, batch: jax.Array) -> Any:
            with programs._logical():
                model, optimizer = nnx.merge(programs.graphdef, state)
                loss, grads = nnx.value_and_grad(
                    lambda m: transformer_loss(m, batch)[0])(model)
                optimizer.update(model, grads)
                return nnx.split((model, optimizer))[1], loss, grads

        state = programs.init()
        batch = programs.put_batch(
            np.zeros((config.train.batch_size, config.train.seq_len + 1), np.int32))
        start = time.monotonic()
        for _ in range(args.steps):
            state, loss, _ = step(state, batch)
            jax.block_until_ready(loss)
    print(f"{args.steps} steps, no hang, {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
