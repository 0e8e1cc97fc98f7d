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

**Shaped links** (``--link-rate R1,R2,...``): the two processes are two nodes whose NICs
are shaped to the rate (``meshkit launch --link-rate``), so every byte between the nodes
crosses a link of that rate while bytes between a process's own devices stay on its own
loopback. Two programs per routing and plan, each compiled once:

* ``exchange``: **the MoE exchange alone** — the layer's router, the plan's dispatch
  and combine (the dispatcher the layer runs), experts that only scale their rows, and
  the backward pass: the four all-to-alls, the buffers' gathers and scatters and their
  transposes, and nothing else. This is the figure the exchange plans are judged by;
* ``layer``: the whole MoE layer forward and backward (router, exchange, experts, the
  load-balancing statistics).

Sizing: ``d_model=512``, ``d_ff=16``, 256 tokens per device. The bytes grow with
``d_model``; ``d_ff=16`` keeps the experts' matmuls small so the layer, too, is mostly
its exchange. A wider ``d_model`` does not make the link dominate more on a machine like
this one: every byte the exchange moves also costs CPU time without the link (gloo's
TCP, the buffers' copies), so the unshaped step grows with the bytes as the link time
does; only the per-token work (routing, slot plans) shrinks in proportion, and it is
small already. At 1 Gbit/s the link's time and the unshaped time are of one order.

Timing: per rate, first ``meshkit calibrate``'s collectives measure the link (α, β) over
the node axis, then ``--repeats`` rounds, each an unshaped pass then a shaped pass over
every program, one call each, in an order rotated from round to round, so that a
drifting load (other jobs on the machine) weighs on every program and on both passes
alike. The table reports the fastest round (other jobs only ever add time) and, per
rate, the spread of the rounds (interquartile range over the median). Per plan and rate:

* ``un``, ``ms``: the step unshaped and shaped;
* ``pred``: the cost model's: the step unshaped less its four exchanges' time on the
  unshaped node link, composed with their time on the link as set
  (:func:`meshkit.exchange.cost.predict`: what overlaps in the model, as flat's bytes
  inside a node under its bytes across, overlaps here too), the shorter of the two
  adding ``OVERLAP`` (0.75) of itself to the longer: on 2 cores the other device
  threads' work goes on while some wait on the link;
* ``*``: the plan ``exchange.method: auto`` picks with that calibrated topology;
* ``wire``: what node 0's NIC sent per step (its qdisc's byte counter).

``--json FILE`` writes the report (:mod:`meshkit.benchmarks._report`; ``-``: stdout, the
tables to stderr); with ``--link-rate`` its ``data`` holds ``rows``, one per program,
plan, routing and rate: ``program``, ``plan``, ``top_k``, ``max_nodes``, ``link_rate``,
``ms_measured`` (fastest round), ``ms_median``, ``spread``, the same three unshaped,
``ms_predicted``, ``auto``, ``wire_bytes_per_step``, and the links: ``alpha_s`` and
``beta_Bps`` (calibrated), ``unshaped_link``, ``intra_link`` and ``memory_Bps``.

Usage: meshkit bench moe [--quick] [--repeats R] [--no-processes]
       [--link-rate 0.25gbit,1gbit,2.5gbit] [--json FILE]
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
import ast
import io
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.config import ExchangeConfig, ModelConfig
from meshkit.exchange import cost
from meshkit.exchange.capacity import capacity, dedup_nodes_per_token
from meshkit.model.moe import MoE
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy.hlo import collectives
from meshkit.strategy.ranks import Strategy

D, F, E, CF = 256, 256, 16, 1.25
TOKENS_PER_DEVICE = 256
LINK_D, LINK_F = 512, 16  # with --link-rate: bytes grow with d_model, the matmuls with d_ff
LINK_ROUTINGS = ((2, None), (4, None), (4, 1))
# What the worker sends over the node axis to measure the link (bytes per device): each
# well above the shaped NIC's bucket (256 KiB a node), which lets that much through at
# once after an idle spell. A 64 KiB size (as calibrate's smallest) went through the
# bucket at once, so the one-line fit's latency came out negative, was clipped to 0 and
# the bandwidth absorbed it: 9.3 MB/s a device at 0.25 Gbit/s, whose share is 7.8.
LINK_SIZES = (2**20, 2**22, 2**23)
EXCHANGES_PER_STEP = 4  # dispatch and combine, forward and backward
#: How much of the shorter of (the step's work besides its exchanges' modelled time, the
#: exchanges' time on the shaped link) still adds to the longer (_predicted_ms): 1 is
#: the two in sequence, 0 the shorter wholly under the longer. On 2 cores, 8 device
#: threads' work goes on while some wait on the link. Chosen on one 3-rate run by the mean
#: |error| of its 54 cells (0.75: 6.9 %, against 9.9 % at 1), then held on a second run
#: (54 of 54 within 25 %, mean 7.0 %; 51 of 54 at 1); see the README.
OVERLAP = 0.75
PLAN_METHOD = {"flat": "flat", "two-stage": "hierarchical", "dedup": "dedup"}
SEQ = 64
ROUTINGS = ((1, None), (2, None), (4, None), (4, 1), (8, None), (8, 1))
QUICK_ROUTINGS = ((2, None), (4, None), (4, 1))
_MODULE = "meshkit.benchmarks.bench_moe"  # the workers run it too: python -m _MODULE
#: ``(top_k, max_nodes)`` of a routing (``max_nodes`` ``None``: any node).
Routings = Sequence[tuple[int, int | None]]
#: A jitted forward+backward step (``nnx.jit``'s wrapper: it has ``lower``).
Step = Any
#: A compiled program to time and its arguments.
Program = tuple[Callable[..., Any], tuple[Any, ...]]
PLANS = {  # name -> the exchange section
    "flat": ExchangeConfig(method="flat"),
    "two-stage": ExchangeConfig(method="hierarchical"),
    "dedup": ExchangeConfig(dedup=True),
}


def _step(mesh: jax.sharding.Mesh, top_k: int, max_nodes: int | None, plan: str,
          d: int = D, f: int = F) -> tuple[Step, MoE, jax.Array]:
    """The jitted forward+backward of one layer, its model and input, under ``mesh``."""
    rules = ShardingRules(node="node", device="device")
    with jax.set_mesh(mesh):
        config = ModelConfig(d_model=d, d_ff=f, num_experts=E, top_k=top_k,
                             capacity_factor=CF, max_nodes=max_nodes)
        model = nnx.jit(lambda: MoE(config, rules, exchange=PLANS[plan], rngs=nnx.Rngs(0)))()
        batch = mesh.size * TOKENS_PER_DEVICE // SEQ
        x = jax.jit(lambda: jax.random.normal(jax.random.key(1), (batch, SEQ, d)),
                    out_shardings=jax.NamedSharding(mesh, rules.spec("batch", None, None)))()

        def loss(m: MoE, x: jax.Array) -> jax.Array:
            y, s = m(x)
            return jnp.mean(y**2) + 0.01 * s.aux_loss

        step = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    return step, model, x


def _inter_node_bytes(step: Step, model: MoE, x: jax.Array,
                      mesh: jax.sharding.Mesh) -> tuple[float, float]:
    """Bytes mesh position 0 sends to other nodes through the compiled all-to-alls, and
    the bytes XLA's cost analysis says the whole step reads and writes (all devices)."""
    m = mesh.shape["device"]
    with jax.set_mesh(mesh):
        compiled = step.lower(model, x).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0]
    accessed = float(analysis.get("bytes accessed", float("nan")))
    sent = 0.0
    for op in collectives(compiled):
        if op.op != "all-to-all":
            continue
        for group in op.groups:
            if 0 in group:
                sent += op.bytes / len(group) * sum(d // m != 0 for d in group)
    return sent, accessed


def _time(step: Step, model: MoE, x: jax.Array, mesh: jax.sharding.Mesh,
          repeats: int) -> float:
    with jax.set_mesh(mesh):
        for _ in range(2):
            jax.block_until_ready(step(model, x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(model, x))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(routings: Routings, repeats: int, *, with_bytes: bool,
            ) -> dict[tuple[int, int | None, str], tuple[float, float, float]]:
    """``(top_k, max_nodes, plan) -> (ms, inter-node bytes, XLA's bytes accessed)`` on this
    job's mesh (the bytes nan without ``with_bytes``).

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
            nbytes, accessed = (_inter_node_bytes(step, model, x, mesh) if with_bytes
                                else (float("nan"), float("nan")))
            out[top_k, max_nodes, plan] = (_time(step, model, x, mesh, repeats), nbytes,
                                           accessed)
    return out


def _worker(routings: Routings, repeats: int) -> None:
    from meshkit.runtime.distributed import initialize

    assert initialize() == 2
    for (top_k, max_nodes, plan), (ms, *_) in measure(routings, repeats,
                                                      with_bytes=False).items():
        if jax.process_index() == 0:
            print(f"RESULT {top_k} {max_nodes} {plan} {ms:.3f}", flush=True)


def _two_processes(quick: bool, repeats: int) -> dict[tuple[int, int | None, str], float]:
    from meshkit.runtime.launch import launch, pass_on_signal

    args = [sys.executable, "-m", _MODULE, "--worker", "--repeats", str(repeats)]
    out = io.StringIO()
    result = launch([*args, *(["--quick"] if quick else [])], 2, devices_per_process=4,
                    timeout_s=600, out=out)
    pass_on_signal(result)  # a signal the launcher forwarded: one line, not a failed run
    if result.returncode:
        print(out.getvalue(), file=sys.stderr)
        raise RuntimeError(f"the 2-process run failed (exit {result.returncode})")
    found = {}
    for line in out.getvalue().splitlines():
        if "RESULT" in line:
            k, mn, plan, ms = line.split("RESULT")[1].split()
            found[int(k), None if mn == "None" else int(mn), plan] = float(ms)
    return found


# ------------------------------------------------------------------ shaped links
def _wire_bytes() -> int:
    """Bytes this node's shaped NIC has sent so far (0 when unshaped)."""
    import subprocess

    from meshkit.runtime.link import ENV_LINK_DEVICE

    words = subprocess.run(["tc", "-s", "qdisc", "show", "dev", os.environ[ENV_LINK_DEVICE]],
                           capture_output=True, text=True, check=False).stdout.split()
    return int(words[words.index("Sent") + 1]) if "tbf" in words else 0


def _copy_bandwidth(mesh: jax.sharding.Mesh) -> float:
    """Bytes per second one device reads and writes in a local copy (all at once)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P(tuple(mesh.axis_names))
    fn = jax.jit(jax.shard_map(lambda v: v + 1, mesh=mesh, in_specs=spec, out_specs=spec))
    words = 2**22
    v = jax.device_put(jnp.ones((mesh.size * words,), jnp.float32), NamedSharding(mesh, spec))
    jax.block_until_ready(fn(v))
    start = time.perf_counter()
    for _ in range(5):
        jax.block_until_ready(fn(v))
    return 2 * 4 * words * 5 / (time.perf_counter() - start)


def _exchange_step(mesh: jax.sharding.Mesh, top_k: int, max_nodes: int | None,
                   plan: str) -> Program:
    """The MoE exchange alone, forward and backward: the layer's router, then the plan's
    dispatch and combine around experts that only scale their rows (no matmuls), and the
    gradient of a loss on the output with respect to the tokens and the router.

    The dispatcher is the one the layer runs (:func:`meshkit.model.dispatchers.make_dispatcher`
    with the plan's exchange section), so the four all-to-alls, the buffers' gathers and
    scatters and their transposes are the layer's own; the expert matmuls, the shared
    statistics (the load-balancing loss's psums) and the layer's parameters are not.
    """
    from meshkit.exchange.dispatch import Routing
    from meshkit.model.dispatchers import make_dispatcher
    from meshkit.model.router import route

    rules = ShardingRules(node="node", device="device")
    exchange = PLANS[plan]
    spec = jax.P(("node", "device"))

    def body(x: jax.Array, w_router: jax.Array) -> jax.Array:
        expert_index, gate, _ = route(x @ w_router, top_k, num_nodes=mesh.shape["node"],
                                      max_nodes=max_nodes)
        dispatcher = make_dispatcher(
            rules=rules, num_experts=E, top_k=top_k, capacity_factor=CF, max_nodes=max_nodes,
            method=exchange.method, order=exchange.order, dedup=exchange.dedup,
            bytes_per_row=x.shape[1] * x.dtype.itemsize, num_tokens=x.shape[0])
        batch, context = dispatcher.dispatch(x, Routing(expert_index, gate))
        y = dispatcher.combine(batch.rows * 1.5, context)
        return jnp.sum(y * y)[None]

    per_device = jax.shard_map(body, mesh=mesh, in_specs=(spec, jax.P()), out_specs=spec)
    step = jax.jit(jax.grad(lambda x, w: jnp.sum(per_device(x, w)), argnums=(0, 1)))
    x = jax.jit(lambda: jax.random.normal(jax.random.key(1), (mesh.size * TOKENS_PER_DEVICE,
                                                              LINK_D)),
                out_shardings=jax.NamedSharding(mesh, spec))()
    w = jax.jit(lambda: 0.05 * jax.random.normal(jax.random.key(2), (LINK_D, E)),
                out_shardings=jax.NamedSharding(mesh, jax.P()))()
    return step, (x, w)


def _round(programs: dict[str, Program], turn: int, *, wire: bool
           ) -> tuple[dict[str, float], dict[str, float]]:
    """Time every program once, in an order rotated by ``turn``: over the rounds each
    program takes each place, so a drifting load hits every program alike.

    Returns:
        ``{name: ms}`` and ``{name: bytes the NIC sent}`` (zeros without ``wire``).
    """
    names = list(programs)
    turn %= len(names)
    times, sent = {}, dict.fromkeys(names, 0.0)
    for name in names[turn:] + names[:turn]:
        fn, args = programs[name]
        before = _wire_bytes() if wire else 0
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[name] = (time.perf_counter() - start) * 1e3
        if wire:
            sent[name] = float(_wire_bytes() - before)
    return times, sent


def _link_worker(routings: Routings, repeats: int, rates: Sequence[str]) -> None:
    """One of 2 processes in a shaped namespace: per rate, calibrate the link, then time
    every program unshaped and shaped, the two interleaved round by round."""
    from meshkit.plan.calibrate import fit_link, measure_collectives
    from meshkit.runtime.distributed import initialize
    from meshkit.runtime.link import link_shape, reshape

    assert initialize() == 2
    me = jax.process_index()
    mesh = Strategy.from_axes({"node": 2, "device": 4}).mesh()
    programs: dict[str, Program] = {}
    for k, mn in routings:
        for plan in PLANS:
            programs[repr(("exchange", k, mn, plan))] = _exchange_step(mesh, k, mn, plan)
            step, model, x = _step(mesh, k, mn, plan, LINK_D, LINK_F)
            programs[repr(("layer", k, mn, plan))] = (step, (model, x))
    sync = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ("node", "device")), mesh=mesh,
                                 in_specs=jax.P(("node", "device")), out_specs=jax.P()))
    one = jax.device_put(jnp.ones((8,)), jax.NamedSharding(mesh, jax.P(("node", "device"))))
    with jax.set_mesh(mesh):
        for fn, args in programs.values():  # compile and warm up
            for _ in range(2):
                jax.block_until_ready(fn(*args))
    intra = fit_link(measure_collectives(mesh, "device", sizes=LINK_SIZES, repeats=3))
    memory = _copy_bandwidth(mesh)

    def shape_link(rate: str | None) -> None:
        reshape(None if rate is None else link_shape(rate))  # each node its own NIC
        jax.block_until_ready(sync(one))  # both nodes past the change

    shape_link(None)
    unshaped = fit_link(measure_collectives(mesh, "node", sizes=LINK_SIZES, repeats=3))
    for rate in rates:
        shape_link(rate)
        inter = fit_link(measure_collectives(mesh, "node", sizes=LINK_SIZES, repeats=3))
        base: dict[str, list[float]] = {name: [] for name in programs}
        shaped: dict[str, list[float]] = {name: [] for name in programs}
        wire = dict.fromkeys(programs, 0.0)
        with jax.set_mesh(mesh):
            # Unshaped and shaped rounds alternate: the prediction starts from the
            # unshaped step, and a drifting load must weigh on both alike.
            for turn in range(repeats):
                shape_link(None)
                times, _ = _round(programs, turn, wire=False)
                shape_link(rate)
                more, sent = _round(programs, turn, wire=True)
                for name in programs:
                    base[name].append(times[name])
                    shaped[name].append(more[name])
                    wire[name] += sent[name] / repeats
        if me == 0:
            print("LINK " + json.dumps({
                "rate": rate, "alpha_s": inter.latency_s, "beta_Bps": inter.bandwidth_Bps,
                "unshaped": [unshaped.latency_s, unshaped.bandwidth_Bps],
                "intra": [intra.latency_s, intra.bandwidth_Bps], "memory_Bps": memory,
                "ms": shaped, "base_ms": base, "wire": wire}), flush=True)


def _shaped_processes(rates: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    from meshkit.runtime.launch import launch, pass_on_signal

    args = [sys.executable, "-m", _MODULE, "--worker", "--repeats", str(repeats),
            "--link-rate", ",".join(rates)]
    out = io.StringIO()
    result = launch(args, 2, devices_per_process=4, timeout_s=3600, out=out,
                    link_rate=rates[0])
    pass_on_signal(result)
    if result.returncode:
        print(out.getvalue(), file=sys.stderr)
        raise RuntimeError(f"the shaped 2-process run failed (exit {result.returncode})")
    return [json.loads(line.split("LINK ", 1)[1]) for line in out.getvalue().splitlines()
            if "LINK {" in line]


def _exchange_bytes(top_k: int) -> int:
    """One exchange's buffer per device, as ``exchange.method: auto`` sizes it."""
    c = capacity(TOKENS_PER_DEVICE, num_experts=E, top_k=top_k, capacity_factor=CF)
    return E * c * LINK_D * 4


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(min, median, spread)`` of timings; the spread is the interquartile range over
    the median (0.1: the middle half of the samples lie within 10 % of the median).

    The min is the figure the table reports: other jobs on the machine only ever add time,
    so the fastest of the interleaved rounds is the one they disturbed least.

    Example:
        >>> spread([10.0, 11.0, 12.0, 30.0])
        (10.0, 11.5, 1.326086956521739)
    """
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    median = statistics.median(ordered)
    return ordered[0], median, (quartiles[2] - quartiles[0]) / median


def _predicted_ms(unshaped_ms: float, *, method: str, size: int, shaped: cost.Topology,
                  unshaped: cost.Topology, routing: dict[str, Any]) -> float:
    """A step's time on the shaped link, from its unshaped time and the cost model.

    The step's work besides its exchanges is the unshaped step less the model's four
    exchanges on the unshaped link (``rest``); on the shaped link the exchanges take the
    model's ``link`` ms. The longer of the two adds whole, the shorter by
    :data:`OVERLAP` (``max + OVERLAP · min``; the sum at ``OVERLAP = 1``).
    """
    def exchanges_ms(topology: cost.Topology) -> float:
        return 1e3 * EXCHANGES_PER_STEP * cost.predict(method, size, topology, **routing)

    rest = max(unshaped_ms - exchanges_ms(unshaped), 0.0)
    link = exchanges_ms(shaped)
    return max(rest, link) + OVERLAP * min(rest, link)


def link_rows(measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``--json`` rows: measured and predicted ms per program, plan, routing and rate.

    The prediction (:func:`_predicted_ms`) is the plan's unshaped step (measured, fastest
    round) less the cost model's time of its four exchanges on the unshaped node link,
    composed with their time on the shaped one by :func:`meshkit.exchange.cost.predict`
    (so that what the model says overlaps, flat's bytes inside a node under its bytes
    across, or follows, the two-stage exchange's stages, is counted so), the shorter
    of the two overlapping the longer by ``1 − OVERLAP``. The shaped link is taken twice:
    as it is set (``ms_predicted``: each device ``rate / M``, the calibrated latency) and
    as calibrated (``ms_predicted_calibrated``), which ``auto`` uses.
    """
    from meshkit.runtime.link import parse_rate

    nodes, per_node = 2, 4
    rows = []
    for m in measured:
        def topology(inter: cost.Link, m: dict[str, Any] = m) -> cost.Topology:
            return cost.Topology(nodes, per_node, inter, cost.Link(*m["intra"]),
                                 m["memory_Bps"])

        calibrated = topology(cost.Link(m["alpha_s"], m["beta_Bps"]))
        nominal = topology(cost.Link(m["alpha_s"], parse_rate(m["rate"]) / 8 / per_node))
        unshaped = topology(cost.Link(*m["unshaped"]))
        for key, samples in m["ms"].items():
            what, top_k, max_nodes, plan = ast.literal_eval(key)  # our own repr of a tuple
            u = dedup_nodes_per_token(TOKENS_PER_DEVICE, num_experts=E, nodes=nodes,
                                      top_k=top_k, max_nodes=max_nodes, capacity_factor=CF)
            size = _exchange_bytes(top_k)
            routing = {"top_k": top_k, "nodes_per_token": u}
            ms, median, width = spread(samples)
            base, base_median, base_width = spread(m["base_ms"][key])
            predicted = {name: _predicted_ms(base, method=PLAN_METHOD[plan], size=size,
                                             shaped=topo, unshaped=unshaped, routing=routing)
                         for name, topo in (("nominal", nominal), ("calibrated", calibrated))}
            rows.append({
                "program": what, "plan": plan, "top_k": top_k, "max_nodes": max_nodes,
                "link_rate": m["rate"], "ms_measured": round(ms, 2),
                "ms_median": round(median, 2), "spread": round(width, 3),
                "ms_predicted": round(predicted["nominal"], 2),
                "ms_predicted_calibrated": round(predicted["calibrated"], 2),
                "ms_unshaped": round(base, 2), "ms_unshaped_median": round(base_median, 2),
                "spread_unshaped": round(base_width, 3),
                "auto": {v: k for k, v in PLAN_METHOD.items()}[
                    cost.choose(size, calibrated, **routing)],
                "wire_bytes_per_step": m["wire"][key],
                "alpha_s": m["alpha_s"], "beta_Bps": m["beta_Bps"],
                "unshaped_link": m["unshaped"], "intra_link": m["intra"],
                "memory_Bps": m["memory_Bps"],
            })
    return rows


def _print_link_table(rows: list[dict[str, Any]], report: Report) -> None:
    rates = list(dict.fromkeys(r["link_rate"] for r in rows))
    setup = (f"MoE over a shaped link: E={E}, d_model={LINK_D}, d_ff={LINK_F}, "
             f"{TOKENS_PER_DEVICE} tokens per device, capacity_factor={CF}; 2 processes × 4 "
             "devices")
    print(setup)
    footnote = ("* the plan exchange.method: auto picks with the calibrated link; pred: the "
                "cost model with the link as set (rate / 4 a device), overlapping the step's "
                f"other work by {1 - OVERLAP:g} of the shorter")
    links = []
    for rate in rates:
        r = next(r for r in rows if r["link_rate"] == rate)
        links.append(f"{rate}: inter α {r['alpha_s'] * 1e6:.0f} µs, "
                     f"β {r['beta_Bps'] / 1e6:.1f} MB/s per device")
        print(f"  {links[-1]}")
    for what, title in (("exchange", "the exchange alone (dispatch + combine, fwd + bwd)"),
                        ("layer", "the whole layer (router, exchange, experts; fwd + bwd)")):
        mine = [r for r in rows if r["program"] == what]
        print(f"{title}: ms, fastest of the rounds (unshaped/shaped/predicted)")
        table = report.table(
            f"{setup}: {title}, ms, fastest of the rounds",
            ["top_k", "max_nodes", "plan", "link rate", "unshaped ms", "shaped ms",
             "predicted ms", "predicted ms (calibrated link)", "spread", "auto picks",
             "wire MiB/step"],
            notes=[*links, "spread: the shaped rounds' interquartile range over their "
                   "median; auto picks: whether exchange.method: auto picks this plan with "
                   "the calibrated link", footnote[2:]])
        for r in mine:
            table.add(r["top_k"], r["max_nodes"], r["plan"], r["link_rate"], r["ms_unshaped"],
                      r["ms_measured"], r["ms_predicted"], r["ms_predicted_calibrated"],
                      r["spread"], r["auto"] == r["plan"], r["wire_bytes_per_step"] / 2**20)
        head = "".join(f"{rate + ' un/ms/pred':>26}" for rate in rates)
        print(f"{'top_k':>5} {'max_nodes':>9} {'plan':>10}{head}  wire MiB/step")
        keys = list(dict.fromkeys((r["top_k"], r["max_nodes"], r["plan"]) for r in mine))
        for k, mn, plan in keys:
            cell = {r["link_rate"]: r for r in mine
                    if (r["top_k"], r["max_nodes"], r["plan"]) == (k, mn, plan)}
            cells = "".join(
                f"{cell[rate]['ms_unshaped']:>10.1f}/{cell[rate]['ms_measured']:.1f}/"
                f"{cell[rate]['ms_predicted']:<6.1f}" + ("*" if cell[rate]["auto"] == plan
                                                          else " ")
                for rate in rates)
            wire = cell[rates[len(rates) // 2]]["wire_bytes_per_step"] / 2**20
            print(f"{k:>5} {mn!s:>9} {plan:>10}{cells}  {wire:.2f}")
        for rate in rates:
            widths = sorted(r["spread"] for r in mine if r["link_rate"] == rate)
            line = (f"{rate}: spread (IQR/median) of the shaped rounds: median "
                    f"{statistics.median(widths):.0%}, worst {widths[-1]:.0%}")
            print(f"  {line}")
            table.notes.append(line)
        for rate in rates:
            for k, mn in dict.fromkeys((r["top_k"], r["max_nodes"]) for r in mine):
                group = {r["plan"]: r for r in mine if r["link_rate"] == rate
                         and (r["top_k"], r["max_nodes"]) == (k, mn)}
                best = min(g["ms_measured"] for g in group.values())
                auto = group[next(iter(group.values()))["auto"]]["ms_measured"]
                worst = []
                for field in ("ms_predicted", "ms_predicted_calibrated"):
                    err = {p: g[field] / g["ms_measured"] - 1 for p, g in group.items()}
                    plan = max(err.items(), key=lambda item: abs(item[1]))[0]
                    worst.append(f"{err[plan]:+.0%} ({plan})")
                line = (f"{what} {rate} top_k={k} max_nodes={mn}: dedup/flat "
                        f"{group['dedup']['ms_measured'] / group['flat']['ms_measured']:.2f}, "
                        f"auto {auto / best:.2f}× the fastest, worst prediction "
                        f"{worst[0]}, with the calibrated link {worst[1]}")
                print(f"  {line}")
                table.notes.append(line)
    print(footnote)
    report.data["rows"] = rows


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
    parser.add_argument("--link-rate", metavar="R1,R2,...",
                        help="also time the layer over a link shaped to each rate (e.g. "
                        "0.25gbit,1gbit,2.5gbit; meshkit launch --link-rate)")
    add_json_flag(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (see the module docstring)."""
    args = parse_args(argv)
    routings = QUICK_ROUTINGS if args.quick else ROUTINGS
    if args.worker and args.link_rate:
        _link_worker(LINK_ROUTINGS, args.repeats, [r.strip() for r in args.link_rate.split(",")])
        return 0
    if args.worker:
        _worker(routings, args.repeats)
        return 0
    report = Report("moe", argv, args.json)
    with report.printing():
        code = _main_link(args, report) if args.link_rate else _main_layer(args, report)
    if code == 0:
        report.write()
    return code


def _main_layer(args: argparse.Namespace, report: Report) -> int:
    """The layer's table: 8 simulated devices, and 2 processes unless ``--no-processes``."""
    routings = QUICK_ROUTINGS if args.quick else ROUTINGS
    local = measure(routings, args.repeats, with_bytes=True)
    procs = {} if args.no_processes else _two_processes(args.quick, args.repeats)
    title = (f"MoE layer fwd+bwd: E={E}, d_model={D}, d_ff={F}, {TOKENS_PER_DEVICE} tokens per "
             f"device, capacity_factor={CF}; node × device = 2 × 4")
    print(title)
    print(f"{'top_k':>5} {'max_nodes':>9} {'plan':>10} {'inter-node KiB':>15} "
          f"{'XLA MiB':>8} {'ms 8 sim':>9} {'ms 2 proc':>10}")
    note = "XLA MiB: bytes the compiled step reads and writes, by XLA's cost analysis"
    table = report.table(title, ["top_k", "max_nodes", "plan", "inter-node KiB", "XLA MiB",
                                 "ms 8 sim", "ms 2 proc"],
                         notes=[note, f"median of {args.repeats} steps"])
    for (top_k, max_nodes, plan), (ms, nbytes, accessed) in local.items():
        two = procs.get((top_k, max_nodes, plan))
        print(f"{top_k:>5} {max_nodes!s:>9} {plan:>10} {nbytes / 1024:>15.0f} "
              f"{accessed / 2**20:>8.1f} {ms:>9.1f} {'-' if two is None else f'{two:.1f}':>10}")
        table.add(top_k, max_nodes, plan, nbytes / 1024, accessed / 2**20, ms, two)
    print(note)
    return 0


def _main_link(args: argparse.Namespace, report: Report) -> int:
    from meshkit.errors import UsageError
    from meshkit.runtime.link import check_available, link_shape

    rates = [r.strip() for r in args.link_rate.split(",")]
    try:  # a malformed rate or a machine that cannot shape: one line, before anything
        for rate in rates:
            link_shape(rate)
        check_available()
    except UsageError as e:
        print(f"meshkit bench moe: error: {e}", file=sys.stderr)
        return 2
    _print_link_table(link_rows(_shaped_processes(rates, args.repeats)), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "moe"))
