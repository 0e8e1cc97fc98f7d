"""Benchmark: what remat, the attention kinds and FSDP's per-layer gather do to memory.

Every figure comes from XLA itself, per device, on 8 simulated CPU devices: the
argument, temp and output bytes of ``compiled.memory_analysis()``, the FLOPs of
``compiled.cost_analysis()`` (:func:`meshkit.training.step_flops`), the compile time, and
for the remat rows the median step time. The model is the toy model of the memory issue
(``d_model=256``, 4 heads, ``d_ff=512``, 8 experts, vocabulary 256, batch 32).

Sections (``--only`` picks some):

* ``attention``: attention alone, forward and backward, on one device's share of the
  dp8 batch (``[4, T, 4, 64]``) at ``T = 2048``: ``xla`` against ``chunked`` (target
  ≤ 0.25×) and ``dot_product``.
* ``seq``: the dp8 train step at ``T = 512, 1024, 2048``, ``xla`` and ``chunked``
  attention: the step's temp memory should grow at most linearly in ``T`` with chunked.
* ``remat``: dp8, 8 layers, ``T = 512`` (activations dominate the temp memory there:
  at ``T = 64`` the gradients and the optimizer update do): ``none``, ``full`` (target
  temp ≤ 0.4× of none, step time ≤ 1.4×), ``save_dots``.
* ``fsdp``: the toy model at ``T = 64``: fsdp8 against dp8 with 4 layers (target temp ≤
  0.6×), and 4 → 8 layers (target: growth ≤ one layer's gathered weights plus
  activations), and fsdp8 with ``remat: full``.
* ``context``: context parallelism, ``chunked`` attention, 8 heads (so Ulysses splits
  them over 8 devices), one sequence per batch device. A ``T = 8192``-token sequence
  split over ``c = 4`` and ``8`` context devices (mesh ``{dp: 8/c, cp: c}``;
  ``hierarchical`` on ``{dp: 8/c, cpn: 2, cpd: c/2}``) against a ``T/c``-token sequence
  per device on dp8, per context method: target temp ≤ 1.3× (a method the heads rule
  out is listed, not run).

Usage: meshkit bench memory_block [--only attention,seq,remat,fsdp,context] [--steps N]
       [--json FILE] [key=value ...]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("memory_block")  # before the imports: Ctrl-C in one line, not a traceback

import os

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.choices import CONTEXT_METHODS, REMAT_POLICIES
from meshkit.config import Config, ConfigError, load_config
from meshkit.model.attention import attention
from meshkit.training import Programs, step_flops

MiB = 2**20
MODEL = ["model.d_model=256", "model.num_heads=4", "model.num_layers=4", "model.d_ff=512",
         "model.num_experts=8", "model.vocab_size=256", "train.batch_size=32",
         "train.seq_len=64", "exchange.node_axis=[]", "exchange.device_axis=[]"]
DP8 = ["mesh.axes={dp: 8}"]
FSDP8 = ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp"]
SECTIONS = ("attention", "seq", "remat", "fsdp", "context")
#: The context section: the sequence, the context devices, and the target temp ratio.
CONTEXT_T, CONTEXT_DEVICES, CONTEXT_LIMIT = 8192, (4, 8), 1.3
#: 8 heads (head size 32): Ulysses splits them over 8 context devices.
CONTEXT_MODEL = ["model.num_heads=8", "model.attention=chunked"]


@dataclasses.dataclass
class Row:
    """One compiled program's figures (bytes per device)."""

    section: str
    label: str
    argument: int
    temp: int
    output: int
    flops: float | None
    compile_s: float
    step_s: float | None = None
    skipped: str | None = None  # why the program was not compiled (the config refused it)


def _compile_step(config: Config) -> tuple[jax.stages.Compiled, float, Callable[[], float]]:
    """The train step compiled ahead of time, its compile time, and a function that runs
    one step (the state created on first use) and returns its seconds."""
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        start = time.perf_counter()
        compiled = programs.train_step.lower(programs.abstract_state,
                                             programs.abstract_batch).compile()
        compile_s = time.perf_counter() - start
    held: list[object] = []

    def run() -> float:
        with jax.set_mesh(mesh):
            if not held:
                t = config.train
                held[:] = [programs.init(), programs.put_batch(
                    np.zeros((t.batch_size, t.seq_len + 1), np.int32))]
            start = time.perf_counter()
            state, metrics = compiled(*held)
            jax.block_until_ready(metrics)
            held[0] = state
            return time.perf_counter() - start

    return compiled, compile_s, run


def _row(section: str, label: str, compiled: jax.stages.Compiled, compile_s: float,
         step_s: float | None = None) -> Row:
    mem = compiled.memory_analysis()
    if mem is None:
        raise SystemExit("this backend reports no memory analysis")
    return Row(section, label, mem.argument_size_in_bytes, mem.temp_size_in_bytes,
               mem.output_size_in_bytes, step_flops(compiled), compile_s, step_s)


def _step(section: str, label: str, overrides: Sequence[str]) -> Row:
    compiled, compile_s, _ = _compile_step(load_config(None, list(overrides)))
    return _row(section, label, compiled, compile_s)


def _timed(section: str, runs: dict[str, Sequence[str]], steps: int) -> list[Row]:
    """Rows whose steps are also timed: the programs take turns, one step each, so a
    machine shared with other jobs slows them alike; the median after a warm-up."""
    compiled = {label: _compile_step(load_config(None, list(o))) for label, o in runs.items()}
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(steps + 1 if steps > 0 else 0):
        for label, (_, _, run) in compiled.items():
            times[label].append(run())
    return [_row(section, label, c, compile_s,
                 float(np.median(times[label][1:])) if steps > 0 else None)
            for label, (c, compile_s, _) in compiled.items()]


def _attention_alone(kind: str, t: int) -> Row:
    """Attention forward + backward on one device's share of the dp8 batch."""
    shape = jax.ShapeDtypeStruct((4, t, 4, 64), jnp.float32)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attention(q, k, v, kind=kind, chunk=128, causal=True))

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return _row("attention", f"{kind} T={t}", compiled, time.perf_counter() - start)


def _context_label(method: str | None, c: int) -> str:
    """A context row's label: ``method`` on ``c`` context devices at ``T``, or (``None``)
    the dp8 baseline at ``T/c``."""
    if method is None:
        return f"dp8 T={CONTEXT_T // c}"
    return f"{method} c={c} T={CONTEXT_T}"


def _context_mesh(method: str, c: int) -> list[str]:
    """One sequence per batch device: ``8/c`` of them, each over ``c`` context devices;
    ``hierarchical`` runs Ulysses over ``cpd`` and a ring over ``cpn``."""
    dp = f"dp: {8 // c}, " if c < 8 else ""
    if method == "hierarchical":
        return [f"mesh.axes={{{dp}cpn: 2, cpd: {c // 2}}}", "parallel.context=[cpn, cpd]"]
    return [f"mesh.axes={{{dp}cp: {c}}}", "parallel.context=[cp]"]


def _context(model: Sequence[str]) -> list[Row]:
    """Per ``c``: the dp8 baseline at ``T/c``, then each method at ``T`` on ``c``."""
    rows = []
    for c in CONTEXT_DEVICES:
        rows.append(_step("context", _context_label(None, c),
                          [*model, *DP8, "train.batch_size=8", f"train.seq_len={CONTEXT_T // c}"]))
        for method in CONTEXT_METHODS[1:]:
            label = _context_label(method, c)
            overrides = [*model, *_context_mesh(method, c), f"train.batch_size={8 // c}",
                         f"train.seq_len={CONTEXT_T}", f"parallel.context_method={method}"]
            try:
                config = load_config(None, overrides)
            except ConfigError as e:  # the heads do not divide: listed, not run
                if not str(e).startswith("parallel.context_method:"):
                    raise
                rows.append(Row("context", label, 0, 0, 0, None, 0.0, skipped=str(e)))
                continue
            compiled, compile_s, _ = _compile_step(config)
            rows.append(_row("context", label, compiled, compile_s))
    return rows


def _sections(extra: Sequence[str], steps: int) -> dict[str, Callable[[], list[Row]]]:
    m = [*MODEL, *extra]
    layers8 = "model.num_layers=8"
    return {
        "attention": lambda: [_attention_alone(kind, 2048)
                              for kind in ("xla", "chunked", "dot_product")],
        "seq": lambda: [_step("seq", f"dp8 {kind} T={t}",
                              [*m, *DP8, f"train.seq_len={t}", f"model.attention={kind}"])
                        for kind in ("xla", "chunked") for t in (512, 1024, 2048)],
        "remat": lambda: _timed("remat", {
            f"dp8 8 layers T=512 remat={policy}": [*m, *DP8, layers8, "train.seq_len=512",
                                                   f"model.remat={policy}"]
            for policy in REMAT_POLICIES}, steps),
        "fsdp": lambda: [
            _step("fsdp", "dp8 4 layers", [*m, *DP8]),
            _step("fsdp", "fsdp8 4 layers", [*m, *FSDP8]),
            _step("fsdp", "dp8 8 layers", [*m, *DP8, layers8]),
            _step("fsdp", "fsdp8 8 layers", [*m, *FSDP8, layers8]),
            _step("fsdp", "fsdp8 4 layers remat=full", [*m, *FSDP8, "model.remat=full"]),
            _step("fsdp", "fsdp8 4 layers remat=save_dots",
                  [*m, *FSDP8, "model.remat=save_dots"]),
        ],
        "context": lambda: _context([*MODEL, *CONTEXT_MODEL, *extra]),
    }


def _ratios(rows: list[Row], report: Report) -> list[str]:
    """The issue's targets, from the rows measured: the lines to print (the report gets
    each target)."""
    by = {r.label: r for r in rows}
    out = []

    def ratio(a: str, b: str, what: str, limit: float | None, field: str = "temp") -> None:
        if a in by and b in by:
            x, y = getattr(by[a], field), getattr(by[b], field)
            if x is not None and y:
                out.append(f"{what}: {x / y:.2f}× "
                           f"({'no target' if limit is None else f'target ≤ {limit:g}×'})")
                if limit is not None:
                    report.target(what, x / y, f"<= {limit:g}")

    ratio("chunked T=2048", "xla T=2048", "chunked / xla attention temp at T=2048", 0.25)
    for kind in ("xla", "chunked"):
        temps = [by.get(f"dp8 {kind} T={t}") for t in (512, 1024, 2048)]
        if all(temps):
            a, b, c = (r.temp for r in temps if r is not None)
            out.append(f"dp8 {kind} step temp T=512→1024→2048: ×{b / a:.2f}, ×{c / b:.2f} "
                       "(linear: ≤ ×2 each)")
            if kind == "chunked":  # the xla kind's is quadratic in T: reported only
                report.target("dp8 chunked step temp: the larger growth of T=512→1024 and "
                              "T=1024→2048 (linear: 2)", max(b / a, c / b), "<= 2")
    base = "dp8 8 layers T=512 remat="
    ratio(f"{base}full", f"{base}none", "remat full / none temp", 0.4)
    ratio(f"{base}save_dots", f"{base}none", "remat save_dots / none temp", None)
    ratio(f"{base}full", f"{base}none", "remat full / none step time", 1.4, field="step_s")
    ratio("fsdp8 4 layers", "dp8 4 layers", "fsdp8 / dp8 temp, 4 layers", 0.6)
    for policy in ("full", "save_dots"):
        ratio(f"fsdp8 4 layers remat={policy}", "dp8 4 layers",
              f"fsdp8 remat={policy} / dp8 temp, 4 layers", None)
    names = ("dp8 4 layers", "dp8 8 layers", "fsdp8 4 layers", "fsdp8 8 layers")
    if all(n in by for n in names):
        dp4, dp8, fsdp4, fsdp8 = (by[n] for n in names)
        # dp8's arguments hold each layer's weights and two AdamW moments, whole.
        weights = (dp8.argument - dp4.argument) / 3 / 4
        # dp8's temp per layer: the layer's whole gradient plus its activations.
        activations = (dp8.temp - dp4.temp) / 4 - weights
        grow = fsdp8.temp - fsdp4.temp
        bound = weights + 4 * activations
        out.append(f"fsdp8 temp 4→8 layers: +{grow / MiB:.1f} MiB ({grow / 4 / MiB:.1f} per "
                   f"layer); one layer's gathered weights {weights / MiB:.1f} + 4 layers' "
                   f"activations {4 * activations / MiB:.1f} = {bound / MiB:.1f} MiB "
                   f"(target: growth ≤ that: {'met' if grow <= bound else 'missed'})")
        report.target("fsdp8 temp growth 4→8 layers (MiB)", grow / MiB,
                      f"<= {bound / MiB:.1f} (one layer's gathered weights + 4 layers' "
                      "activations, MiB)", grow <= bound)
    return out


def _context_table(rows: list[Row], report: Report) -> list[str]:
    """The context target per method and ``c``: the lines to print (the report gets a
    table and each target); none without context rows."""
    by = {r.label: r for r in rows if r.section == "context"}
    if not by:
        return []
    title = (f"context: temp of a T={CONTEXT_T} sequence on c context devices / a T/c "
             f"sequence on one (dp8), per device (target ≤ {CONTEXT_LIMIT:g}×)")
    table = report.table(title, ["method", "c", "temp MiB at T on c", "temp MiB at T/c on one",
                                 "ratio", "met"])
    head = (f"{'method':<13} {'c':>2} {'temp T on c':>12} {'temp T/c on 1':>14} "
            f"{'ratio':>6}  target ≤ {CONTEXT_LIMIT:g}×")
    out = [title, head, "-" * len(head)]
    for c in CONTEXT_DEVICES:
        base = by.get(_context_label(None, c))
        for method in CONTEXT_METHODS[1:]:
            row = by.get(_context_label(method, c))
            if row is None or base is None:
                continue
            name = f"context {method} c={c}: temp of T={CONTEXT_T} on c / T/c on one"
            if row.skipped:
                out.append(f"{method:<13} {c:>2} not run: {row.skipped}")
                table.add(method, c, None, base.temp / MiB, None, None)
                report.target(name, None, f"<= {CONTEXT_LIMIT:g}")
                continue
            ratio = row.temp / base.temp
            ok = ratio <= CONTEXT_LIMIT
            out.append(f"{method:<13} {c:>2} {row.temp / MiB:11.1f}M {base.temp / MiB:13.1f}M "
                       f"{ratio:6.2f}  {'met' if ok else 'missed'}")
            table.add(method, c, row.temp / MiB, base.temp / MiB, ratio, ok)
            report.target(name, ratio, f"<= {CONTEXT_LIMIT:g}")
    return out


def _print(rows: list[Row], title: str, report: Report) -> None:
    print(title)
    head = (f"{'section':<10} {'program':<34} {'argument':>9} {'temp':>9} {'output':>9} "
            f"{'GFLOP':>8} {'compile':>8} {'step':>8}")
    print(head)
    print("-" * len(head))
    table = report.table(title, ["section", "program", "argument MiB", "temp MiB",
                                 "output MiB", "GFLOP", "compile s", "step ms"])
    for r in rows:
        if r.skipped:  # in the context table, with its reason
            continue
        flops = f"{r.flops / 1e9:8.2f}" if r.flops else f"{'-':>8}"
        step = f"{r.step_s * 1e3:6.0f}ms" if r.step_s is not None else f"{'-':>8}"
        print(f"{r.section:<10} {r.label:<34} {r.argument / MiB:8.1f}M {r.temp / MiB:8.1f}M "
              f"{r.output / MiB:8.1f}M {flops} {r.compile_s:7.1f}s {step}")
        table.add(r.section, r.label, r.argument / MiB, r.temp / MiB, r.output / MiB,
                  r.flops / 1e9 if r.flops else None, r.compile_s,
                  None if r.step_s is None else r.step_s * 1e3)
    for line in _ratios(rows, report):
        print(line)
        table.notes.append(line)
    for line in _context_table(rows, report):
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen sections and print the table and the target ratios."""
    parser = script.parser("memory_block", __doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--steps", type=script.positive_int, default=3,
                        help="timed steps of the remat rows")
    add_json_flag(parser)
    parser.add_argument("overrides", nargs="*", help="config key=value on top of the toy model")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown sections {unknown}; valid: {', '.join(SECTIONS)}")
    sections = _sections(args.overrides, args.steps)
    report = Report("memory_block", argv, args.json)
    with report.printing():
        rows: list[Row] = []
        for name in chosen:
            rows += sections[name]()
            print(f"[{name} done]", flush=True)
        _print(rows, f"{jax.device_count()} {jax.devices()[0].platform} devices; bytes per "
               "device (XLA memory_analysis), FLOPs per device (cost_analysis: a loop body "
               "is counted once, so scanned and chunked rows undercount)", report)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(script.run(main, "memory_block"))
