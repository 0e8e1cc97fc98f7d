"""Benchmark: one model trained under every 8-device strategy, each axis doing its role.

Each strategy of the parity tests (data, fsdp, tensor, pipeline and expert axes) trains
the same model, large enough that the matmuls dominate (``d_model=256``, 4 layers,
``d_ff=512``, 8 experts), for a few timed steps. The table shows the median step time,
tokens/s, the ratio to the ``dp8`` baseline (pure data parallelism) and one device's
bytes of the training state (parameters + AdamW moments, from the arrays' shards).

The pipeline bubble is measured, not assumed: at a fixed microbatch size, the step time
of the ``pp`` strategies (the fastest of the timed steps) is taken at ``M`` and ``2M``
microbatches; the difference is ``M`` ticks, which gives the time of one tick ``τ``.
The ``S − 1`` bubble ticks of a step then cost ``(S − 1)·τ / t(M)`` of it, shown beside
the GPipe formula
``(S − 1)/(M + S − 1)`` (which ignores the work outside the pipeline: embedding, loss,
optimizer). The interleaved schedule's ``v`` chunks per stage make ``2M`` microbatches
``v·M`` ticks more, and its formula ``(S − 1)/(v·M + S − 1)``.

``--only NAME,...`` runs only the strategies named (e.g. ``--only "pp2 interleaved v2
M8"``).

``--tp-moe`` measures the MoE's choice under tensor parallelism instead: meshkit splits
each device's tokens over the tensor ranks before routing (and all-gathers the outputs);
the alternative defined here lets every tensor rank route and run all of them.

Usage: meshkit bench parallel [--steps N] [--quick] [--tp-moe] [--only NAME,...]
[--json FILE] [key=value ...]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("parallel")  # before the imports: Ctrl-C in one line, not a traceback

import os

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)

import argparse
from collections.abc import Sequence
from typing import Any

import jax

from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.benchmarks.bench_train import measure
from meshkit.config import load_config
from meshkit.model.moe import MoE
from meshkit.model.pipeline import bubble_fraction
from meshkit.sharding.rules import ShardingRules
from meshkit.training import init_state

MODEL = ["model.d_model=256", "model.num_heads=4", "model.num_layers=4", "model.d_ff=512",
         "model.num_experts=8", "model.vocab_size=256", "train.batch_size=32",
         "train.seq_len=64"]
QUICK = ["model.d_model=64", "model.num_layers=2", "model.d_ff=128", "model.vocab_size=16",
         "train.seq_len=16"]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
STRATEGIES = [
    ("dp8", ["mesh.axes={dp: 8}", *NO_EXPERTS]),
    ("fsdp8", ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *NO_EXPERTS]),
    ("tp2 node2 device2", ["mesh.axes={tp: 2, node: 2, device: 2}", "parallel.tensor=tp"]),
    ("pp2 node2 device2", ["mesh.axes={pp: 2, node: 2, device: 2}", "parallel.pipeline=pp",
                           "parallel.microbatches=4"]),
    ("pp2 tp2 node2", ["mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp",
                       "parallel.tensor=tp", "parallel.microbatches=4",
                       "exchange.device_axis=[]"]),
    ("fsdp2 node2 device2", ["mesh.axes={fsdp: 2, node: 2, device: 2}",
                             "parallel.fsdp=fsdp"]),
    ("dp2 pp2 tp2", ["mesh.axes={dp: 2, pp: 2, tp: 2}", "parallel.pipeline=pp",
                     "parallel.tensor=tp", "parallel.microbatches=4", *NO_EXPERTS]),
    # The interleaved schedule, and GPipe at the same M as its control (the method's own
    # distance from the formula, at microbatches of one sequence per device).
    ("pp2 gpipe M8", ["mesh.axes={pp: 2, node: 2, device: 2}", "parallel.pipeline=pp",
                      "parallel.microbatches=8"]),
    ("pp2 interleaved v2 M8", ["mesh.axes={pp: 2, node: 2, device: 2}",
                               "parallel.pipeline=pp", "parallel.schedule=interleaved",
                               "parallel.virtual_stages=2", "parallel.microbatches=8",
                               # 2 chunks of 1 layer per stage, --quick's 2 layers too few.
                               "model.num_layers=4"]),
]


def state_mib(overrides: Sequence[str]) -> float:
    """One device's share of the initial training state, in MiB."""
    state = init_state(load_config(None, list(overrides)))
    device = jax.devices()[0]
    total = sum(s.data.nbytes for leaf in jax.tree.leaves(state)
                for s in leaf.addressable_shards if s.device == device)
    return total / 2**20


def bubble(overrides: Sequence[str], steps: int) -> tuple[float, float]:
    """Measured and formula bubble fractions of a pipelined strategy.

    Returns:
        ``((S − 1)·τ / t(M), (S − 1)/(v·M + S − 1))`` with ``τ`` from ``t(2M) − t(M)``
        (``v·M`` ticks) at the same microbatch size.
    """
    config = load_config(None, list(overrides))
    if config.parallel.pipeline is None:
        raise ValueError("bubble: the overrides set no parallel.pipeline")
    m, s = config.parallel.microbatches, config.strategy().shape[config.parallel.pipeline]
    v = config.parallel.virtual_stages
    double = [*overrides, f"parallel.microbatches={2 * m}",
              f"train.batch_size={2 * config.train.batch_size}"]
    # The fastest step of each: the least disturbed by other work on the machine.
    t_m = measure(overrides, steps)["fastest_ms"]
    t_2m = measure(double, steps)["fastest_ms"]
    tick = (t_2m - t_m) / (v * m)
    return (s - 1) * tick / t_m, bubble_fraction(s, m, virtual_stages=v)


def _repeat_on_every_tensor_rank(self: MoE, x: jax.Array, *, split: bool = False) -> Any:
    """The rejected design: no token split, so tensor ranks repeat each other's work
    (``split``, sequence parallelism, is not measured here)."""
    b, t, d = x.shape
    rules = self.rules
    # Statistics over the batch only: the same rules without the tensor axes. (ShardingRules
    # takes its constructor's arguments, not its fields: dataclasses.replace cannot.)
    self.rules = ShardingRules(
        data=rules.data, fsdp=rules.fsdp, pipeline=rules.pipeline, node=rules.node,
        device=rules.device, batch=rules.batch,
        logical={name: list(axes) or None for name, axes in rules.names})
    try:
        y, stats = self._route_and_run(x.reshape(b * t, d))
    finally:
        self.rules = rules
    return y.reshape(b, t, d).astype(x.dtype), stats


def tp_moe(base: Sequence[str], steps: int, report: Report) -> None:
    """Time ``tp2 node2 device2`` with the MoE's token split and without it, twice."""
    overrides = [*base, *dict(STRATEGIES)["tp2 node2 device2"]]
    split = MoE.local
    print(f"{'MoE under tp=2':<30} {'step ms':>8} {'tokens/s':>9}")
    table = report.table("MoE under tp=2: the token split over tensor ranks against "
                         "repeating on every rank (two interleaved rounds)",
                         ["MoE under tp=2", "step ms", "tokens/s"])
    try:
        for _ in range(2):  # interleaved, so both see the same machine load
            for name, local in (("split tokens (meshkit)", split),
                                ("repeat on every tensor rank", _repeat_on_every_tensor_rank)):
                MoE.local = local  # type: ignore[method-assign]
                r = measure(overrides, steps)
                print(f"{name:<30} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9,.0f}", flush=True)
                table.add(name, r["step_ms"], r["tokens_per_s"])
    finally:
        MoE.local = split  # type: ignore[method-assign]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (a bad one: one line, exit 2).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The parsed arguments; every strategy's config loads with the overrides.

    Raises:
        meshkit.config.ConfigError: an override that no strategy's config accepts (exit 2).
    """
    parser = script.parser("parallel", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=script.positive_int, default=5,
                        help="timed steps per strategy (>= 1)")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--tp-moe", action="store_true",
                        help="compare the MoE's token split over tensor ranks with repeating")
    parser.add_argument("--only", default=None,
                        help="comma-separated strategy names to run (default: all)")
    add_json_flag(parser)
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    names = [n for n, _ in STRATEGIES]
    for name in (args.only or "").split(",") if args.only else []:
        if name not in names:
            parser.error(f"--only: unknown strategy {name!r}; valid: {', '.join(names)}")
    base = [*MODEL, *(QUICK if args.quick else []), *args.overrides]
    # Every strategy's config before the first one compiles.
    for _, strategy in STRATEGIES:
        load_config(None, [*base, *strategy])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every strategy and print the table.

    Args:
        argv: ``--steps N``, ``--quick``, ``--tp-moe``, ``--only``, ``--json FILE`` and
            config overrides for every strategy.

    Returns:
        0.
    """
    args = parse_args(argv)
    report = Report("parallel", argv, args.json)
    with report.printing():
        _run(args, report)
    report.write()
    return 0


def _run(args: argparse.Namespace, report: Report) -> None:
    """Measure the strategies (or ``--tp-moe``), print the table and fill the report's."""
    base = [*MODEL, *(QUICK if args.quick else []), *args.overrides]
    m = load_config(None, base).model
    t = load_config(None, base).train
    title = (f"{jax.device_count()} {jax.devices()[0].platform} devices; d_model={m.d_model} "
             f"layers={m.num_layers} d_ff={m.d_ff} experts={m.num_experts} top_k={m.top_k} "
             f"vocab={m.vocab_size} batch={t.batch_size}x{t.seq_len} tokens; median of "
             f"{args.steps} steps")
    print(f"{title}\n")
    if args.tp_moe:
        tp_moe(base, args.steps, report)
        return
    print(f"{'strategy':<22} {'step ms':>8} {'tokens/s':>9} {'vs dp8':>7} {'state MiB':>9} "
          f"{'bubble':>7} {'(S-1)/(vM+S-1)':>14}", flush=True)
    table = report.table(title, ["strategy", "step ms", "tokens/s", "vs dp8", "state MiB",
                                 "bubble", "(S-1)/(vM+S-1)"],
                         notes=["vs dp8: the first strategy run's step time over this one's; "
                                "bubble: measured from the fastest steps at M and 2M "
                                "microbatches, beside the formula"])
    baseline = None
    only = args.only.split(",") if args.only else None
    for name, strategy in STRATEGIES:
        if only is not None and name not in only:
            continue
        overrides = [*base, *strategy]
        r = measure(overrides, args.steps)
        baseline = baseline or r["step_ms"]
        state = state_mib(overrides)
        line = (f"{name:<22} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} "
                f"{baseline / r['step_ms']:>6.2f}x {state:>9.2f}")
        measured = formula = None
        if "parallel.pipeline=pp" in strategy:
            measured, formula = bubble(overrides, args.steps)
            line += f" {measured:>7.1%} {formula:>14.1%}"
        print(line, flush=True)
        table.add(name, r["step_ms"], r["tokens_per_s"], baseline / r["step_ms"], state,
                  measured, formula)


if __name__ == "__main__":
    raise SystemExit(script.run(main, "parallel"))
