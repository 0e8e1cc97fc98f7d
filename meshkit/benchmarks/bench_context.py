"""Benchmark: context attention (all_gather, ring, ulysses, hierarchical and auto) over a
shaped link between 2 processes, with the cost model's predictions and the causal balance.

Run ``meshkit bench context [--link-rate R] [--seq-lens T1,T2,...] [--repeats N]
[--json FILE]``. Two processes of 4 simulated CPU devices each are two nodes whose NICs
are shaped to ``R`` (default ``1gbit``; ``meshkit launch --link-rate``), and the context
group spans both: context axes ``cpn`` (2, across the processes) and ``cpd`` (4, a
process's devices), so ``hierarchical`` is a ring over ``cpn`` and Ulysses over ``cpd``.

The step is one attention layer, forward and backward: q, k, v projections of a
``[1, T, 64]`` input (8 heads and 8 kv heads of 16, float32) → context attention (causal,
zigzag chunks) → the output projection, and the gradient of a loss on the output with
respect to the input (the weights' gradient, whose all-reduce is the same for every
method, is left out, so the step's communication is the attention's). The sequence
lengths default to 4K, 8K and 16K tokens: on 2 shared cores one 32K step runs for
about half a minute (``--seq-lens 32768`` adds it).

Timing, as ``meshkit bench moe --link-rate``: first the links are measured (``meshkit
calibrate``'s collectives over ``cpd``, and over ``cpn`` unshaped and shaped) and the
attention's compute rate (each device runs causal attention over the whole sequence
with its 1/8 of the heads, no communication); then ``--repeats`` rounds, each an
unshaped pass and a shaped pass over every program, one call each, in an order rotated
from round to round. The table reports the fastest round (other jobs only ever add time).

Per method and sequence length, a row ``{method, seq_len, link_rate, ms_measured,
ms_predicted, temp_bytes}``:

* ``ms_measured``: the shaped step;
* ``ms_predicted``: the unshaped step (measured) plus what the cost model
  (:func:`meshkit.config.context_method.predict`, with the measured compute rate) says
  the shaped link adds: its prediction on the shaped links less its prediction on the
  unshaped ones (where the ring's steps hide their bytes under compute, the link adds
  less);
* ``temp_bytes``: the compiled step's temporary memory per device (XLA's
  ``memory_analysis``);
* ``auto``: the method :func:`meshkit.config.context_method.choose` picks with the
  calibrated shaped links (its row repeats that method's measurement).

The balance table counts the causal attention blocks (``--block`` tokens square) each
of the 8 context devices computes, most and fewest, with zigzag chunks (device ``i``
holding chunks ``i`` and ``15 − i`` of 16) and with contiguous ones
(:func:`meshkit.config.context_method.causal_blocks`).
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("context")  # before the imports: Ctrl-C in one line, not a traceback

import os
import sys

# Before JAX starts its backend (the workers get theirs from the launcher).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import io
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.config import context_method
from meshkit.exchange import cost

AXES = ("cpn", "cpd")
SIZES = {"cpn": 2, "cpd": 4}
D_MODEL, HEADS, KV_HEADS, HEAD_DIM, BATCH = 64, 8, 8, 16, 1
DTYPE_BYTES = 4
SEQ_LENS = (4096, 8192, 16384)
BLOCK = 256
# Bytes a device sends to measure a link: each well above the shaped NIC's bucket
# (256 KiB), as `meshkit bench moe` found necessary.
LINK_SIZES = (2**20, 2**22, 2**23)
_MODULE = "meshkit.benchmarks.bench_context"
#: A compiled program and its arguments.
Program = tuple[Callable[..., Any], tuple[Any, ...]]


# ------------------------------------------------------------------ the programs (JAX)
def _layer_step(mesh: Any, method: str, seq_len: int) -> tuple[Program, int]:
    """The layer's jitted forward+backward under ``mesh``, its inputs and its temp bytes."""
    import jax
    import jax.numpy as jnp

    from meshkit.model.context import local_attention

    spec = jax.P(None, AXES, None)  # [b, T, d]: the sequence over the context axes

    def layer(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
        b, n, _ = x.shape
        q = (x @ wq).reshape(b, n, HEADS, HEAD_DIM)
        k = (x @ wk).reshape(b, n, KV_HEADS, HEAD_DIM)
        v = (x @ wv).reshape(b, n, KV_HEADS, HEAD_DIM)
        o = local_attention(q, k, v, axes=AXES, method=method, causal=True, chunk=BLOCK)
        return o.reshape(b, n, HEADS * HEAD_DIM) @ wo

    per_device = jax.shard_map(layer, mesh=mesh, in_specs=(spec, *[jax.P()] * 4),
                               out_specs=spec)
    step = jax.jit(jax.grad(lambda x, *w: jnp.sum(per_device(x, *w) ** 2)))
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.jit(lambda: jax.random.normal(keys[0], (BATCH, seq_len, D_MODEL)),
                out_shardings=jax.NamedSharding(mesh, spec))()
    shapes = ((D_MODEL, HEADS * HEAD_DIM), (D_MODEL, KV_HEADS * HEAD_DIM),
              (D_MODEL, KV_HEADS * HEAD_DIM), (HEADS * HEAD_DIM, D_MODEL))
    ws = tuple(jax.jit(lambda k=k, s=s: 0.1 * jax.random.normal(k, s),
                       out_shardings=jax.NamedSharding(mesh, jax.P()))()
               for k, s in zip(keys[1:], shapes, strict=True))
    compiled = step.lower(x, *ws).compile()
    analysis = compiled.memory_analysis()
    temp = -1 if analysis is None else int(analysis.temp_size_in_bytes)
    return (compiled, (x, *ws)), temp


def _compute_program(mesh: Any, seq_len: int) -> Program:
    """Each device's causal attention over the whole sequence with its 1/8 of the heads,
    forward and backward, no communication: the attention's compute alone."""
    import jax
    import jax.numpy as jnp

    from meshkit.model.context import local_attention

    spec = jax.P(None, None, AXES, None)  # [b, T, H, h]: the heads over the devices

    def body(q: Any, k: Any, v: Any) -> Any:
        return local_attention(q, k, v, axes=(), method="all_gather", causal=True,
                                 chunk=BLOCK)

    per_device = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(per_device(q, k, v) ** 2),
                            argnums=(0, 1, 2)))
    shape = (BATCH, seq_len, HEADS, HEAD_DIM)
    qkv = tuple(jax.jit(lambda i=i: jax.random.normal(jax.random.key(i), shape),
                        out_shardings=jax.NamedSharding(mesh, spec))() for i in range(3))
    return step.lower(*qkv).compile(), qkv


def _nic_counts() -> tuple[int, int]:
    """Bytes this node's shaped NIC has sent and packets its queue dropped (0, 0 when
    unshaped)."""
    import subprocess

    from meshkit.runtime.link import ENV_LINK_DEVICE

    words = subprocess.run(["tc", "-s", "qdisc", "show", "dev", os.environ[ENV_LINK_DEVICE]],
                           capture_output=True, text=True, check=False).stdout.split()
    if "tbf" not in words:
        return 0, 0
    return int(words[words.index("Sent") + 1]), int(words[words.index("(dropped") + 1].rstrip(","))


def _round(programs: dict[str, Program], turn: int, *, nic: bool = False
           ) -> dict[str, tuple[float, int, int]]:
    """Every program once, in an order rotated by ``turn``: ms each, and with ``nic`` the
    bytes the node's NIC sent and the packets it dropped meanwhile."""
    import jax

    names = list(programs)
    turn %= len(names)
    out = {}
    for name in names[turn:] + names[:turn]:
        fn, args = programs[name]
        sent, dropped = _nic_counts() if nic else (0, 0)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ms = (time.perf_counter() - start) * 1e3
        after = _nic_counts() if nic else (0, 0)
        out[name] = (ms, after[0] - sent, after[1] - dropped)
    return out


def _worker(seq_lens: Sequence[int], repeats: int, rate: str) -> None:
    """One of the 2 processes in the shaped namespace: calibrate, then time every program
    unshaped and shaped, round by round; process 0 prints one ``CONTEXT {json}`` line."""
    import jax
    import jax.numpy as jnp

    from meshkit.plan.calibrate import fit_link, measure_collectives
    from meshkit.runtime.distributed import initialize
    from meshkit.runtime.link import link_shape, reshape
    from meshkit.strategy.ranks import Strategy

    assert initialize() == 2
    mesh = Strategy.from_axes(SIZES).mesh()
    programs: dict[str, Program] = {}
    temp: dict[str, int] = {}
    compute: dict[str, Program] = {}
    with jax.set_mesh(mesh):
        for seq_len in seq_lens:
            for method in context_method.SIMPLICITY:
                key = json.dumps([method, seq_len])
                programs[key], temp[key] = _layer_step(mesh, method, seq_len)
            compute[str(seq_len)] = _compute_program(mesh, seq_len)
        for fn, args in (*programs.values(), *compute.values()):  # warm up
            jax.block_until_ready(fn(*args))
    sync = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, AXES), mesh=mesh,
                                 in_specs=jax.P(AXES), out_specs=jax.P()))
    one = jax.device_put(jnp.ones((8,)), jax.NamedSharding(mesh, jax.P(AXES)))

    def shape_link(shaped: bool) -> None:
        reshape(link_shape(rate) if shaped else None)  # each node its own NIC
        jax.block_until_ready(sync(one))  # both nodes past the change

    shape_link(False)
    intra = fit_link(measure_collectives(mesh, "cpd", sizes=LINK_SIZES, repeats=3))
    unshaped = fit_link(measure_collectives(mesh, "cpn", sizes=LINK_SIZES, repeats=3))
    compute_ms = {t: min(_round({t: p}, 0)[t][0] for _ in range(2))
                  for t, p in compute.items()}
    shape_link(True)
    shaped = fit_link(measure_collectives(mesh, "cpn", sizes=LINK_SIZES, repeats=3))
    base: dict[str, list[float]] = {name: [] for name in programs}
    ms: dict[str, list[float]] = {name: [] for name in programs}
    wire = dict.fromkeys(programs, 0.0)
    drops = dict.fromkeys(programs, 0.0)
    with jax.set_mesh(mesh):
        for turn in range(repeats):
            shape_link(False)
            for name, (t, _, _) in _round(programs, turn).items():
                base[name].append(t)
            shape_link(True)
            for name, (t, sent, dropped) in _round(programs, turn, nic=True).items():
                ms[name].append(t)
                wire[name] += sent / repeats
                drops[name] += dropped / repeats
    if jax.process_index() == 0:
        print("CONTEXT " + json.dumps({
            "rate": rate, "intra": [intra.latency_s, intra.bandwidth_Bps],
            "unshaped": [unshaped.latency_s, unshaped.bandwidth_Bps],
            "shaped": [shaped.latency_s, shaped.bandwidth_Bps],
            "compute_ms": compute_ms, "ms": ms, "base_ms": base, "temp_bytes": temp,
            "wire_bytes": wire, "drops": drops}),
            flush=True)


def _processes(seq_lens: Sequence[int], repeats: int, rate: str) -> dict[str, Any]:
    from meshkit.runtime.launch import launch, pass_on_signal

    args = [sys.executable, "-m", _MODULE, "--worker", "--repeats", str(repeats),
            "--link-rate", rate, "--seq-lens", ",".join(map(str, seq_lens))]
    out = io.StringIO()
    result = launch(args, 2, devices_per_process=4, timeout_s=3600, out=out,
                    link_rate=rate)
    pass_on_signal(result)
    if result.returncode:
        print(out.getvalue(), file=sys.stderr)
        raise RuntimeError(f"the shaped 2-process run failed (exit {result.returncode})")
    found = [line.split("CONTEXT ", 1)[1] for line in out.getvalue().splitlines()
             if "CONTEXT {" in line]
    return dict(json.loads(found[0]))


# ------------------------------------------------------------------ the table (no JAX)
def attention_flops(seq_len: int) -> float:
    """One device's causal attention FLOPs, forward and backward, as the cost model
    counts them (:func:`meshkit.config.context_method.predict`).

    Example:
        >>> attention_flops(4096) / 1e9  # 2·T²·H·h/c forward, 2.5 times that backward
        1.879048192
    """
    c = math.prod(SIZES.values())
    forward = 4 * BATCH * seq_len**2 * HEADS * HEAD_DIM / c / 2
    return (1 + context_method.BACKWARD_FLOPS) * forward


def _shape(seq_len: int, links: Sequence[cost.Link], flops_per_s: float) -> dict[str, Any]:
    return dict(seq_len=seq_len, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS,
                head_dim=HEAD_DIM, dtype_bytes=DTYPE_BYTES, context_sizes=tuple(SIZES.values()),
                links=tuple(links), flops_per_s=flops_per_s)


def context_rows(measured: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows, per sequence length: one per method and one for ``auto``.

    Args:
        measured: the worker's record: ``rate``; the links ``intra``, ``unshaped`` and
            ``shaped`` as ``[latency_s, bandwidth_Bps]``; ``compute_ms`` per sequence
            length (the attention alone); ``ms`` and ``base_ms`` (shaped and unshaped
            rounds) and ``temp_bytes`` per program, keyed ``json.dumps([method, seq_len])``.

    Returns:
        ``{method, seq_len, link_rate, ms_measured, ms_predicted, temp_bytes}`` rows, with
        ``ms_unshaped``, ``spread`` (the shaped rounds' interquartile range over their
        median), ``flops_per_s`` and, on ``auto``'s row, ``picks``.

    Example:
        >>> keys = [json.dumps([m, 4096]) for m in context_method.SIMPLICITY]
        >>> rows = context_rows({"rate": "1gbit", "intra": [1e-5, 1e9],
        ...     "unshaped": [1e-4, 1e8], "shaped": [1e-4, 3e7], "compute_ms": {"4096": 50.0},
        ...     "ms": {k: [90.0] for k in keys}, "base_ms": {k: [60.0] for k in keys},
        ...     "temp_bytes": {k: 2**20 for k in keys}})
        >>> [r["method"] for r in rows]
        ['all_gather', 'ring', 'ulysses', 'hierarchical', 'auto']
    """
    intra = cost.Link(*measured["intra"])
    inter = {name: cost.Link(*measured[name]) for name in ("unshaped", "shaped")}
    rows: list[dict[str, Any]] = []
    for seq_len in sorted({json.loads(k)[1] for k in measured["ms"]}):
        flops_per_s = attention_flops(seq_len) / (measured["compute_ms"][str(seq_len)] / 1e3)
        shapes = {name: _shape(seq_len, (link, intra), flops_per_s)
                  for name, link in inter.items()}
        mine: dict[str, dict[str, Any]] = {}
        for method in context_method.SIMPLICITY:
            key = json.dumps([method, seq_len])
            fastest, median, width = _spread(measured["ms"][key])
            base = min(measured["base_ms"][key])
            added = (context_method.predict(method, **shapes["shaped"])
                     - context_method.predict(method, **shapes["unshaped"]))
            mine[method] = {
                "method": method, "seq_len": seq_len, "link_rate": measured["rate"],
                "ms_measured": round(fastest, 2), "ms_predicted": round(base + added * 1e3, 2),
                "temp_bytes": measured["temp_bytes"][key], "ms_unshaped": round(base, 2),
                "ms_median": round(median, 2), "spread": round(width, 3),
                "flops_per_s": float(f"{flops_per_s:.4g}"),
                "wire_bytes": measured.get("wire_bytes", {}).get(key),
                "drops": measured.get("drops", {}).get(key)}
        picks = context_method.choose(**shapes["shaped"]).method
        rows.extend(mine.values())
        rows.append({**mine[picks], "method": "auto", "picks": picks})
    return rows


def _spread(samples: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    median = statistics.median(ordered)
    return ordered[0], median, (quartiles[2] - quartiles[0]) / median


def balance_rows(seq_lens: Sequence[int], block: int = BLOCK) -> list[dict[str, Any]]:
    """Most and fewest causal blocks on any of the 8 context devices, zigzag and contiguous.

    Example:
        >>> balance_rows([4096])  # 16 chunks of one block each
        [{'seq_len': 4096, 'block': 256, 'zigzag': [17, 17], 'contiguous': [31, 3]}]
    """
    c = math.prod(SIZES.values())
    out = []
    for seq_len in seq_lens:
        row: dict[str, Any] = {"seq_len": seq_len, "block": block}
        for name, zigzag in (("zigzag", True), ("contiguous", False)):
            blocks = context_method.causal_blocks(seq_len, c, block, zigzag=zigzag)
            row[name] = [max(blocks), min(blocks)]
        out.append(row)
    return out


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the rows say of the issue's questions, in numbers.

    Returns:
        ``auto_over_fastest``: per sequence length, auto's measured time over the fastest
        method's; ``worst_prediction``: the largest ``|predicted / measured − 1|`` and its
        row; ``hierarchical``: per sequence length >= 16K, hierarchical's measured time
        over ring's and over Ulysses'.

    Example:
        >>> rows = [{"method": m, "seq_len": 16384, "ms_measured": t, "ms_predicted": t}
        ...         for m, t in (("ring", 10.0), ("ulysses", 8.0), ("hierarchical", 9.0),
        ...                      ("all_gather", 12.0), ("auto", 8.0))]
        >>> v = verdicts(rows)
        >>> v["auto_over_fastest"], v["hierarchical"]
        ({16384: 1.0}, {16384: {'over_ring': 0.9, 'over_ulysses': 1.125}})
    """
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["seq_len"], {})[r["method"]] = r
    auto = {t: round(m["auto"]["ms_measured"] / min(r["ms_measured"] for name, r in m.items()
                                                    if name != "auto"), 3)
            for t, m in by.items()}
    errors = [(r["ms_predicted"] / r["ms_measured"] - 1, r) for r in rows if r["method"] != "auto"]
    worst = max(errors, key=lambda e: abs(e[0]))
    hier = {t: {f"over_{o}": round(m["hierarchical"]["ms_measured"] / m[o]["ms_measured"], 3)
                for o in ("ring", "ulysses")}
            for t, m in by.items() if t >= 16384}
    return {"auto_over_fastest": auto,
            "worst_prediction": {"error": round(worst[0], 3), "method": worst[1]["method"],
                                 "seq_len": worst[1]["seq_len"]},
            "hierarchical": hier}


def print_tables(measured: dict[str, Any], report: Report) -> list[dict[str, Any]]:
    """Print and record the method table, the balance table and the verdicts."""
    rows = context_rows(measured)
    rate = measured["rate"]
    setup = (f"one attention layer fwd+bwd: [{BATCH}, T, {D_MODEL}] input, {HEADS} heads, "
             f"{KV_HEADS} kv heads of {HEAD_DIM}, float32, causal; context cpn 2 (across 2 "
             f"processes, link {rate}) × cpd 4")
    links = (f"links: inter shaped α {measured['shaped'][0] * 1e6:.0f} µs, β "
             f"{measured['shaped'][1] / 1e6:.1f} MB/s a device; unshaped α "
             f"{measured['unshaped'][0] * 1e6:.0f} µs, β {measured['unshaped'][1] / 1e6:.0f} "
             f"MB/s; intra α {measured['intra'][0] * 1e6:.0f} µs, β "
             f"{measured['intra'][1] / 1e6:.0f} MB/s")
    print(setup)
    print(f"  {links}")
    table = report.table(setup, ["method", "seq_len", "link_rate", "ms_measured",
                                 "ms_predicted", "temp_MiB", "ms_unshaped", "spread",
                                 "wire_MiB", "drops", "picks"],
                         notes=[links, "ms_measured: fastest shaped round; ms_predicted: the "
                                "unshaped step plus what the cost model says the shaped link "
                                "adds; auto: the method context_method.choose picks with the "
                                "calibrated links (its measurement repeated); wire_MiB, "
                                "drops: what node 0's shaped NIC sent and its queue dropped "
                                "per shaped step"])
    print(f"{'method':>12} {'T':>6} {'measured':>9} {'predicted':>9} {'pred/meas':>9} "
          f"{'unshaped':>9} {'temp MiB':>9} {'spread':>7} {'wire MiB':>9} {'drops':>6}")
    for r in rows:
        name = r["method"] if r["method"] != "auto" else f"auto→{r['picks']}"
        print(f"{name:>12} {r['seq_len']:>6} {r['ms_measured']:>9.1f} {r['ms_predicted']:>9.1f} "
              f"{r['ms_predicted'] / r['ms_measured']:>9.2f} {r['ms_unshaped']:>9.1f} "
              f"{r['temp_bytes'] / 2**20:>9.1f} {r['spread']:>7.0%} {_mib(r['wire_bytes']):>9} "
              f"{'-' if r['drops'] is None else round(r['drops']):>6}")
        table.add(r["method"], r["seq_len"], r["link_rate"], r["ms_measured"],
                  r["ms_predicted"], r["temp_bytes"] / 2**20, r["ms_unshaped"], r["spread"],
                  None if r["wire_bytes"] is None else r["wire_bytes"] / 2**20, r["drops"],
                  r.get("picks"))
    seq_lens = sorted({r["seq_len"] for r in rows})
    _print_balance(seq_lens, report)
    v = verdicts(rows)
    for t, ratio in v["auto_over_fastest"].items():
        report.target(f"auto / fastest at T={t}", ratio, "<= 1.1")
    report.target("worst |predicted / measured - 1|", abs(v["worst_prediction"]["error"]),
                  "<= 0.25")
    for t, ratios in v["hierarchical"].items():
        for name, ratio in ratios.items():
            report.target(f"hierarchical / {name[5:]} at T={t}", ratio, "reported")
    print("auto / fastest: " + ", ".join(f"T={t}: {x:.2f}"
                                          for t, x in v["auto_over_fastest"].items()))
    w = v["worst_prediction"]
    print(f"worst prediction: {w['error']:+.0%} ({w['method']}, T={w['seq_len']})")
    for t, ratios in v["hierarchical"].items():
        print(f"hierarchical at T={t}: {ratios['over_ring']:.2f}× ring, "
              f"{ratios['over_ulysses']:.2f}× ulysses (measured)")
    report.data["rows"] = rows
    report.data["verdicts"] = v
    return rows


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _print_balance(seq_lens: Sequence[int], report: Report) -> None:
    title = (f"causal attention blocks ({BLOCK}×{BLOCK} tokens) per context device, 8 devices: "
             "most / fewest")
    print(title)
    table = report.table(title, ["seq_len", "zigzag most", "zigzag fewest", "zigzag ratio",
                                 "contiguous most", "contiguous fewest", "contiguous ratio"])
    print(f"{'T':>6} {'zigzag':>13} {'ratio':>6} {'contiguous':>13} {'ratio':>6}")
    for row in balance_rows(seq_lens):
        (zh, zl), (ch, cl) = row["zigzag"], row["contiguous"]
        print(f"{row['seq_len']:>6} {f'{zh} / {zl}':>13} {zh / zl:>6.2f} {f'{ch} / {cl}':>13} "
              f"{ch / cl:>6.2f}")
        table.add(row["seq_len"], zh, zl, zh / zl, ch, cl, ch / cl)
    report.data["balance"] = balance_rows(seq_lens)


# ------------------------------------------------------------------ the command
def _seq_lens(text: str) -> tuple[int, ...]:
    c2 = 2 * math.prod(SIZES.values())
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "integers") from None
    bad = [t for t in values if t < c2 * BLOCK or t % (c2 * BLOCK)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]} is not a multiple of 2·c·block = "
                                         f"{c2 * BLOCK} (16 zigzag chunks of whole blocks)")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments.
    """
    parser = script.parser("context", __doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--link-rate", default="1gbit", metavar="R",
                        help="the rate of the link between the 2 processes (default 1gbit)")
    parser.add_argument("--seq-lens", type=_seq_lens, default=SEQ_LENS, metavar="T1,T2",
                        help="sequence lengths (default 4096,8192,16384)")
    parser.add_argument("--repeats", type=script.positive_int, default=2,
                        help="rounds, each unshaped then shaped (>= 1; default 2)")
    add_json_flag(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (see the module docstring).

    Args:
        argv: command-line arguments without the program name.

    Returns:
        0 on success, 2 for a bad rate or a machine that cannot shape a link.
    """
    args = parse_args(argv)
    if args.worker:
        _worker(args.seq_lens, args.repeats, args.link_rate)
        return 0
    from meshkit.errors import UsageError
    from meshkit.runtime.link import check_available, link_shape

    try:  # a malformed rate or a machine that cannot shape: one line, before anything
        link_shape(args.link_rate)
        check_available()
    except UsageError as e:
        print(f"meshkit bench context: error: {e}", file=sys.stderr)
        return 2
    report = Report("context", argv, args.json)
    with report.printing():
        print_tables(_processes(args.seq_lens, args.repeats, args.link_rate), report)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "context"))
