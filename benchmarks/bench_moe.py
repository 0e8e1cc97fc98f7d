"""Benchmark: one MoE layer, forward and backward, under the flat, two-stage and
node-deduplicated exchanges, per (top_k, max_nodes).

For each routing (``top_k`` of 16 experts, ``max_nodes`` nodes per token at most) and
each exchange plan the table shows:

* ``inter-node KiB``: bytes one device sends to the other node through the compiled
  program's all-to-alls (forward and backward; :func:`meshkit.strategy.hlo.collectives`);
* ``ms 8 sim``: median time of a forward+backward step on 8 simulated CPU devices of
  one process (``node`` × ``device`` = 2 × 4);
* ``ms 2 proc``: the same over two real processes of 4 devices each (``jax.distributed``
  on 127.0.0.1, started with :func:`meshkit.runtime.launch.launch`), the node axis being the
  process boundary, so every byte between the nodes goes through the collectives'
  transport (gloo over TCP).

The layer is sized so the expert matmuls matter: ``d_model=256``, ``d_ff=256`` per
expert, 256 tokens per device, ``capacity_factor=1.25``.

Usage: python benchmarks/bench_moe.py [--quick] [--repeats R] [--no-processes]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("moe")  # before the imports: Ctrl-C in one line, not a traceback

import os
import sys

# Before JAX starts its backend: 8 simulated CPU devices (the worker sets its own).
from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--worker" not in sys.argv:
    set_cpu_device_count(8)

import argparse
import io
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.model.moe import MoE
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy.hlo import collectives
from meshkit.strategy.ranks import Strategy

D, F, E, CF = 256, 256, 16, 1.25
TOKENS_PER_DEVICE = 256
SEQ = 64
ROUTINGS = ((1, None), (2, None), (4, None), (4, 1), (8, None), (8, 1))
QUICK_ROUTINGS = ((2, None), (4, None), (4, 1))
PLANS = {  # name -> the exchange section
    "flat": ExchangeConfig(method="flat"),
    "two-stage": ExchangeConfig(method="hierarchical"),
    "dedup": ExchangeConfig(dedup=True),
}


def _step(mesh: jax.sharding.Mesh, top_k: int, max_nodes: int | None, plan: str):
    """The jitted forward+backward of one layer, its model and input, under ``mesh``."""
    rules = ShardingRules(node="node", device="device")
    with jax.set_mesh(mesh):
        config = ModelConfig(d_model=D, d_ff=F, num_experts=E, top_k=top_k,
                             capacity_factor=CF, max_nodes=max_nodes)
        model = nnx.jit(lambda: MoE(config, rules, exchange=PLANS[plan], rngs=nnx.Rngs(0)))()
        batch = mesh.size * TOKENS_PER_DEVICE // SEQ
        x = jax.jit(lambda: jax.random.normal(jax.random.key(1), (batch, SEQ, D)),
                    out_shardings=jax.NamedSharding(mesh, rules.spec("batch", None, None)))()

        def loss(m, x):
            y, s = m(x)
            return jnp.mean(y**2) + 0.01 * s.aux_loss

        step = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    return step, model, x


def _inter_node_bytes(step, model, x, mesh: jax.sharding.Mesh) -> float:
    """Bytes mesh position 0 sends to other nodes through the compiled all-to-alls."""
    m = mesh.shape["device"]
    with jax.set_mesh(mesh):
        compiled = step.lower(model, x).compile()
    sent = 0.0
    for op in collectives(compiled):
        if op.op != "all-to-all":
            continue
        for group in op.groups:
            if 0 in group:
                sent += op.bytes / len(group) * sum(d // m != 0 for d in group)
    return sent


def _time(step, model, x, mesh: jax.sharding.Mesh, repeats: int) -> float:
    with jax.set_mesh(mesh):
        for _ in range(2):
            jax.block_until_ready(step(model, x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(model, x))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(routings: Sequence[tuple[int, int | None]], repeats: int, *,
            with_bytes: bool) -> dict[tuple[int, int | None, str], tuple[float, float]]:
    """``(top_k, max_nodes, plan) -> (ms, inter-node bytes or nan)`` on this job's mesh.

    Args:
        routings: ``(top_k, max_nodes)`` pairs.
        repeats: timed steps per entry (after two warm-up steps).
        with_bytes: also read the inter-node bytes from the compiled program.

    Returns:
        The measurements.

    Example::

        measure([(4, 1)], 5, with_bytes=True)[(4, 1, "dedup")]
    """
    mesh = Strategy.from_axes({"node": 2, "device": 4}).mesh()
    out = {}
    for top_k, max_nodes in routings:
        for plan in PLANS:
            step, model, x = _step(mesh, top_k, max_nodes, plan)
            nbytes = _inter_node_bytes(step, model, x, mesh) if with_bytes else float("nan")
            out[top_k, max_nodes, plan] = (_time(step, model, x, mesh, repeats), nbytes)
    return out


def _worker(routings, repeats: int) -> None:
    from meshkit.runtime.distributed import initialize

    assert initialize() == 2
    for (top_k, max_nodes, plan), (ms, _) in measure(routings, repeats,
                                                     with_bytes=False).items():
        if jax.process_index() == 0:
            print(f"RESULT {top_k} {max_nodes} {plan} {ms:.3f}", flush=True)


def _two_processes(quick: bool, repeats: int) -> dict[tuple[int, int | None, str], float]:
    from meshkit.runtime.launch import launch

    args = [sys.executable, os.path.abspath(__file__), "--worker", "--repeats", str(repeats)]
    out = io.StringIO()
    result = launch([*args, *(["--quick"] if quick else [])], 2, devices_per_process=4,
                    timeout_s=600, out=out)
    if result.returncode:
        print(out.getvalue(), file=sys.stderr)
        raise RuntimeError(f"the 2-process run failed (exit {result.returncode})")
    found = {}
    for line in out.getvalue().splitlines():
        if "RESULT" in line:
            k, mn, plan, ms = line.split("RESULT")[1].split()
            found[int(k), None if mn == "None" else int(mn), plan] = float(ms)
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments.
    """
    parser = script.parser("moe", __doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three routings only")
    parser.add_argument("--repeats", type=script.positive_int, default=5,
                        help="timed steps per entry (>= 1)")
    parser.add_argument("--no-processes", action="store_true",
                        help="skip the 2-process run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (see the module docstring)."""
    args = parse_args(argv)
    routings = QUICK_ROUTINGS if args.quick else ROUTINGS
    if args.worker:
        _worker(routings, args.repeats)
        return 0
    local = measure(routings, args.repeats, with_bytes=True)
    procs = {} if args.no_processes else _two_processes(args.quick, args.repeats)
    print(f"MoE layer fwd+bwd: E={E}, d_model={D}, d_ff={F}, {TOKENS_PER_DEVICE} tokens per "
          f"device, capacity_factor={CF}; node × device = 2 × 4")
    print(f"{'top_k':>5} {'max_nodes':>9} {'plan':>10} {'inter-node KiB':>15} "
          f"{'ms 8 sim':>9} {'ms 2 proc':>10}")
    for (top_k, max_nodes, plan), (ms, nbytes) in local.items():
        two = procs.get((top_k, max_nodes, plan))
        print(f"{top_k:>5} {max_nodes!s:>9} {plan:>10} {nbytes / 1024:>15.0f} {ms:>9.1f} "
              f"{'-' if two is None else f'{two:.1f}':>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "moe"))
