"""Benchmark: meshkit against MaxText on one matched model, seven layouts, in back-to-back pairs.

The matched model: d_model 128, 2 layers, 4 heads (head size 32), SwiGLU d_ff 512,
vocabulary 512, sequences of 64, a global batch of 32, float32 parameters and compute,
AdamW (b1 0.9, b2 0.95, weight decay 0.01, gradients clipped at norm 1), no activation
checkpointing, on 8 simulated CPU devices. The MoE rows put 8 experts of that SwiGLU in
every layer, top-2, capacity factor 1.25 (MaxText's capacity-bounded path,
``sparse_matmul=false``), load-balancing loss weight 0.01. Each side's parameters are
counted from the state it built and printed: a difference means the models are not
matched, and the row says so.

Seven layouts (:data:`LAYOUTS`, each with both sides' settings): dense dp8, fsdp8 and
dp2×tp4; MoE dp8, fsdp8, dp2×tp4 (meshkit's ``parallel.moe_tensor: ffn``, MaxText's
tensor axis on the experts' hidden dimension) and ep8 (the expert axis also shards the
other parameters, as MaxText's rules do).

Per layout:

* the step time: meshkit's compiled train step (:func:`meshkit.training.compile_step`),
  then MaxText's own trainer (``maxtext.trainers.pre_train.train``, in a process of its
  own: :mod:`meshkit.benchmarks._peer_maxtext`), then meshkit, then MaxText, ``--pairs``
  times; each run's median over ``--steps`` steps, every step timed until its outputs
  are ready, MaxText's first :data:`MAXTEXT_WARMUP` (compiling) left out. The table
  gives the median of the pairs' ratios meshkit / MaxText (below 1: meshkit faster);
  back-to-back pairs share whatever load the machine has at the time.
* one device's memory by XLA's ``memory_analysis()`` of each side's compiled train step:
  the total (arguments + outputs + temporaries − donated,
  :func:`meshkit.plan.verify.xla_bytes`) and the temporaries alone.

Nothing is tuned to the peer: each side runs its own defaults for everything the
model does not fix (meshkit's sort dispatch, MaxText's layer loop and attention).
MaxText is an optional extra (``pip install 'meshkit[peer]'``, Python >= 3.12), or any
interpreter that has it (``--maxtext-python PATH``). Without it the benchmark prints
meshkit's columns and a line saying how to install it.

Rows whose config keys this build does not have, or whose layout this build's config
refuses, are skipped with the reason printed.

``--quick`` shrinks the model on both sides (d_model 32, d_ff 64, vocabulary 64,
sequences of 16), for a smoke test. ``--json FILE`` writes the report
(:mod:`meshkit.benchmarks._report`), with every row's fields in ``data``.

Usage: meshkit bench peer [--layouts A,B] [--pairs N] [--steps N]
[--maxtext-python PATH] [--quick] [--json FILE]
"""

from __future__ import annotations

from meshkit.cli import script

if __name__ == "__main__":
    script.start("peer")  # before the imports: Ctrl-C in one line, not a traceback

import os

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
DEVICES = 8
set_cpu_device_count(DEVICES)

import argparse
import dataclasses
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from meshkit.benchmarks import _peer_maxtext
from meshkit.benchmarks._report import Report, add_json_flag
from meshkit.config import Config, ConfigError, all_keys, load_config
from meshkit.plan.verify import xla_bytes
from meshkit.training import compile_step, config_dataset, init_state

#: What to install, said when MaxText is not found (MaxText 0.2.5 needs Python >= 3.12).
INSTALL = ("pip install 'meshkit[peer]' (Python >= 3.12), or pass --maxtext-python PATH "
           "of an interpreter that has MaxText")
#: MaxText's first timed steps left out: the first call compiles (its ahead-of-time
#: compile does not fill jit's cache), the second may still wait on the first.
MAXTEXT_WARMUP = 2
#: Seconds one MaxText run may take (start, compile, the steps) before it is stopped.
MAXTEXT_TIMEOUT_S = 900
_PROBE_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Shape:
    """The matched model and batch, from which both sides' settings are made."""

    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 512
    vocab_size: int = 512
    seq_len: int = 64
    batch_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    lr: float = 1e-2
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    aux_loss_weight: float = 0.01


FULL = Shape()
QUICK = Shape(d_model=32, d_ff=64, vocab_size=64, seq_len=16)


def meshkit_model(shape: Shape, *, moe: bool) -> list[str]:
    """meshkit's overrides for the model, batch and optimizer of ``shape``.

    Args:
        shape: the matched shape.
        moe: MoE layers (else a dense SwiGLU in every layer).

    Returns:
        ``key=value`` items.

    Example:
        >>> meshkit_model(FULL, moe=False)[-2:]
        ['model.num_experts=0', 'model.mlp=swiglu']
    """
    s = shape
    common = [f"model.d_model={s.d_model}", f"model.num_layers={s.num_layers}",
              f"model.num_heads={s.num_heads}", f"model.d_ff={s.d_ff}",
              f"model.vocab_size={s.vocab_size}", f"train.seq_len={s.seq_len}",
              f"train.batch_size={s.batch_size}", "model.dtype=float32", "model.remat=none",
              f"train.lr={s.lr}", f"train.weight_decay={s.weight_decay}",
              f"train.grad_clip={s.grad_clip}",
              # The Markov source's table is vocab^(order+1): order 2 would be 512^3.
              # The tokens do not change a step's cost (MaxText's are synthetic).
              "data.order=1"]
    if not moe:
        return [*common, "model.num_experts=0", "model.mlp=swiglu"]
    return [*common, f"model.num_experts={s.num_experts}", f"model.top_k={s.top_k}",
            f"model.capacity_factor={s.capacity_factor}",
            f"model.aux_loss_weight={s.aux_loss_weight}"]


def maxtext_model(shape: Shape, *, moe: bool) -> list[str]:
    """MaxText's overrides (``configs/base.yml`` keys) for the same model, batch and
    optimizer as :func:`meshkit_model`.

    Args:
        shape: the matched shape.
        moe: MoE layers (MaxText's ``mixtral`` block), else ``llama2``'s dense SwiGLU.

    Returns:
        ``key=value`` items.

    Example:
        >>> maxtext_model(FULL, moe=False)[:3]
        ['base_emb_dim=128', 'base_num_decoder_layers=2', 'base_num_query_heads=4']
    """
    s = shape
    common = [f"base_emb_dim={s.d_model}", f"base_num_decoder_layers={s.num_layers}",
              f"base_num_query_heads={s.num_heads}", f"base_num_kv_heads={s.num_heads}",
              f"head_dim={s.d_model // s.num_heads}", f"base_mlp_dim={s.d_ff}",
              'mlp_activations=["silu","linear"]', f"vocab_size={s.vocab_size}",
              f"max_target_length={s.seq_len}",
              f"per_device_batch_size={s.batch_size / DEVICES:g}",
              "dtype=float32", "weight_dtype=float32",
              # Scanned layers are checkpointed whatever the policy says: unrolled, "none"
              # is no remat (meshkit's layers are a Python loop too).
              "remat_policy=none", "scan_layers=false",
              "opt_type=adamw", "adam_b1=0.9", "adam_b2=0.95", "adam_eps=1e-8",
              f"learning_rate={s.lr}", f"adam_weight_decay={s.weight_decay}",
              f"gradient_clipping_threshold={s.grad_clip}", "logits_via_embedding=false"]
    if not moe:
        return [*common, "decoder_block=llama2", "num_experts=1"]
    return [*common, "decoder_block=mixtral", f"base_moe_mlp_dim={s.d_ff}",
            f"num_experts={s.num_experts}",
            f"num_experts_per_tok={s.top_k}", f"capacity_factor={s.capacity_factor}",
            # The capacity-bounded einsum path; sparse_matmul drops no token.
            "sparse_matmul=false", "megablox=false",
            f"load_balance_loss_weight={s.aux_loss_weight}"]


#: meshkit without expert axes (the MoE rows' experts then stay whole on every device).
_NO_EXPERT_AXES = ("exchange.node_axis=[]", "exchange.device_axis=[]")
#: MaxText's mesh, every axis 1 but those a layout names (its fsdp axis defaults to -1,
#: "all devices left").
_MAXTEXT_ONES = ("ici_data_parallelism=1", "ici_fsdp_parallelism=1",
                 "ici_tensor_parallelism=1", "ici_expert_parallelism=1")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row: a layout, and how each side says it.

    Attributes:
        name: the row's name (``--layouts``).
        moe: MoE layers (else dense).
        meshkit: meshkit's overrides for the mesh and the roles.
        maxtext: MaxText's ``ici_*_parallelism`` overrides.
    """

    name: str
    moe: bool
    meshkit: tuple[str, ...]
    maxtext: tuple[str, ...]


def _layouts() -> tuple[Layout, ...]:
    dp8 = ("mesh.axes={dp: 8}", *_NO_EXPERT_AXES)
    fsdp8 = ("mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *_NO_EXPERT_AXES)
    dp2tp4 = ("mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp", *_NO_EXPERT_AXES)
    x_dp8 = ("ici_data_parallelism=8",)
    x_fsdp8 = ("ici_fsdp_parallelism=8",)
    x_dp2tp4 = ("ici_data_parallelism=2", "ici_tensor_parallelism=4")
    return (
        Layout("dense-dp8", False, dp8, x_dp8),
        Layout("dense-fsdp8", False, fsdp8, x_fsdp8),
        Layout("dense-dp2tp4", False, dp2tp4, x_dp2tp4),
        Layout("moe-dp8", True, dp8, x_dp8),
        Layout("moe-fsdp8", True, fsdp8, x_fsdp8),
        # MaxText's tensor axis splits each expert's hidden dimension: meshkit's ffn.
        Layout("moe-dp2tp4", True, (*dp2tp4, "parallel.moe_tensor=ffn"), x_dp2tp4),
        # MaxText's rules shard the non-expert weights over the expert axis too.
        Layout("moe-ep8", True, ("mesh.axes={ep: 8}", "exchange.node_axis=[]",
                                 "exchange.device_axis=[ep]", "parallel.fsdp=[ep]"),
               ("ici_expert_parallelism=8",)),
    )


#: Every row, in print order: the one place a layout is defined for both sides.
LAYOUTS = _layouts()


def meshkit_overrides(layout: Layout, shape: Shape = FULL) -> list[str]:
    """meshkit's ``key=value`` overrides of one row: the model, then the layout.

    Example:
        >>> meshkit_overrides(LAYOUTS[0])[-3:]
        ['mesh.axes={dp: 8}', 'exchange.node_axis=[]', 'exchange.device_axis=[]']
    """
    return [*meshkit_model(shape, moe=layout.moe), *layout.meshkit]


def maxtext_overrides(layout: Layout, shape: Shape = FULL, *, steps: int,
                      workdir: str) -> list[str]:
    """MaxText's overrides of one row: the model, the layout, and the run (synthetic
    data, ``steps`` steps, no checkpoints, no TensorBoard, output under ``workdir``).

    Example:
        >>> maxtext_overrides(LAYOUTS[0], steps=3, workdir="/tmp/x")[-1]
        'ici_data_parallelism=8'
    """
    run = [f"steps={steps}", "dataset_type=synthetic", "enable_checkpointing=false",
           "enable_tensorboard=false", f"base_output_directory={workdir}",
           "run_name=peer", "hardware=cpu", "skip_jax_distributed_system=true"]
    return [*run, *maxtext_model(shape, moe=layout.moe), *_MAXTEXT_ONES, *layout.maxtext]


def run_pairs(pairs: int, meshkit: Callable[[], float],
              maxtext: Callable[[], float] | None) -> tuple[list[float], list[float]]:
    """Run the two sides back to back: meshkit, MaxText, meshkit, MaxText, ...

    Args:
        pairs: how many pairs.
        meshkit: one meshkit run: its step time.
        maxtext: one MaxText run: its step time (``None``: meshkit alone, ``pairs``
            times).

    Returns:
        meshkit's times and MaxText's, in run order (MaxText's empty without it).

    Example:
        >>> order = []
        >>> run_pairs(2, lambda: order.append("m") or 1.0, lambda: order.append("x") or 2.0)
        ([1.0, 1.0], [2.0, 2.0])
        >>> order
        ['m', 'x', 'm', 'x']
    """
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(pairs):
        ours.append(meshkit())
        if maxtext is not None:
            theirs.append(maxtext())
    return ours, theirs


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of the pairs' ratios ``ours[i] / theirs[i]``.

    Raises:
        ValueError: no pairs, or not as many of one side as of the other.

    Example:
        >>> paired_ratio([1.0, 3.0, 2.0], [2.0, 2.0, 2.0])
        1.0
    """
    if not ours or len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} meshkit runs against {len(theirs)} MaxText runs: "
                         "no pairs")
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def maxtext_python(path: str | None) -> tuple[str | None, str | None]:
    """The interpreter that runs MaxText's side, and MaxText's version there.

    Args:
        path: ``--maxtext-python`` (``None``: this interpreter, if it has MaxText).

    Returns:
        ``(interpreter, version)``; ``(None, None)`` when no path was given and this
        interpreter has no MaxText.

    Raises:
        ValueError: ``path`` is not an interpreter that has MaxText (the message names
            ``--maxtext-python``).

    Example:
        >>> maxtext_python("/no/such/python")
        Traceback (most recent call last):
        ...
        ValueError: --maxtext-python /no/such/python: no such file
    """
    if path is None:
        if importlib.util.find_spec("maxtext") is None:
            return None, None
        path = sys.executable
    elif not Path(path).is_file():
        raise ValueError(f"--maxtext-python {path}: no such file")
    elif not os.access(path, os.X_OK):
        raise ValueError(f"--maxtext-python {path}: not executable")
    probe = "import importlib.metadata as m; print(m.version('maxtext'))"
    try:
        done = subprocess.run([path, "-c", probe], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"--maxtext-python {path}: cannot run it: {e}") from None
    if done.returncode != 0:
        raise ValueError(f"--maxtext-python {path}: MaxText is not installed there "
                         "(pip install 'maxtext[tpu]==0.2.5'; Python >= 3.12)")
    return path, done.stdout.strip()


def maxtext_env() -> dict[str, str]:
    """The environment of a MaxText run: CPU only, :data:`DEVICES` simulated devices,
    Google Cloud's services stubbed out (``DECOUPLE_GCLOUD``)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE",
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={DEVICES}"])}


def run_maxtext(python: str, overrides: Sequence[str], workdir: Path) -> dict[str, Any]:
    """One run of MaxText's trainer (:mod:`meshkit.benchmarks._peer_maxtext`).

    Args:
        python: the interpreter that has MaxText.
        overrides: MaxText's ``key=value`` overrides (:func:`maxtext_overrides`).
        workdir: an empty folder for its output and log.

    Returns:
        What the worker wrote: ``step_s``, ``memory``, ``params``, ``devices``, versions.

    Raises:
        RuntimeError: the run failed or timed out (with its log's last lines).
    """
    out, log = workdir / "result.json", workdir / "maxtext.log"
    command = [python, _peer_maxtext.__file__, str(out), *overrides]
    with open(log, "w") as f:
        try:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                                  env=maxtext_env(), timeout=MAXTEXT_TIMEOUT_S, check=False)
            failed = None if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            failed = f"still running after {MAXTEXT_TIMEOUT_S} s"
    if failed or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"MaxText's run failed ({failed or 'no result'}): "
                           f"{' '.join(command)}\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def maxtext_step_s(result: dict[str, Any], steps: int) -> float:
    """The median of a MaxText run's step times, its warm-up left out.

    Raises:
        RuntimeError: the run timed fewer than ``steps`` steps past the warm-up.

    Example:
        >>> maxtext_step_s({"step_s": [9.0, 5.0, 1.0, 3.0, 2.0]}, 3)
        2.0
    """
    timed = result["step_s"][MAXTEXT_WARMUP:]
    if len(timed) < steps:
        raise RuntimeError(f"MaxText timed {len(result['step_s'])} steps, expected "
                           f"{steps + MAXTEXT_WARMUP}")
    return statistics.median(timed)


class MeshkitRun:
    """meshkit's side of one row: the compiled step, its memory, and timed steps.

    Args:
        config: the row's config.
    """

    def __init__(self, config: Config) -> None:
        self.compiled = compile_step(config)
        self.total_bytes, self.parts = xla_bytes(self.compiled.memory_analysis())
        self.state = init_state(config)
        params = nnx.filter_state(self.state[0], nnx.Param)  # state[0]: the model's
        self.params = sum(int(x.size) for x in jax.tree.leaves(params))
        (_, batch_sharding), _ = self.compiled.input_shardings
        data, t = config_dataset(config), config.train
        self.batches = [jax.device_put(data.batch(i, t.batch_size, t.seq_len, seed=t.seed),
                                       batch_sharding) for i in range(2)]
        self._step(0)  # warm-up: the first call's dispatch set-up

    def _step(self, i: int) -> None:
        self.state, metrics = self.compiled(self.state, self.batches[i % 2])
        jax.block_until_ready((self.state, metrics))

    def time(self, steps: int) -> float:
        """The median seconds of ``steps`` steps, each until its outputs are ready."""
        times = []
        for i in range(steps):
            start = time.perf_counter()
            self._step(i)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def _configs(chosen: Sequence[Layout], shape: Shape) -> tuple[dict[str, Config], dict[str, str]]:
    """Each chosen row's config, or why the row is skipped (keys this build lacks, a
    layout its config refuses), all before anything compiles."""
    known = set(all_keys())
    configs: dict[str, Config] = {}
    skipped: dict[str, str] = {}
    for layout in chosen:
        overrides = meshkit_overrides(layout, shape)
        lacking = [k for k in (o.partition("=")[0] for o in overrides) if k not in known]
        if lacking:
            skipped[layout.name] = f"not in this build: {', '.join(lacking)}"
            continue
        try:
            configs[layout.name] = load_config(None, overrides)
        except ConfigError as e:
            skipped[layout.name] = f"this build refuses the layout: {e}"
    return configs, skipped


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the rows and print the table.

    Args:
        argv: ``--layouts A,B``, ``--pairs N``, ``--steps N``, ``--maxtext-python PATH``,
            ``--quick``, ``--json FILE``.

    Returns:
        0; a usage error (an unknown layout, a count below 1, a ``--maxtext-python``
        without MaxText) exits 2 before anything compiles.
    """
    parser = script.parser("peer", __doc__.splitlines()[0])
    names = [layout.name for layout in LAYOUTS]
    parser.add_argument("--layouts", default=None,
                        help=f"comma-separated rows (default: all): {', '.join(names)}")
    parser.add_argument("--pairs", type=script.positive_int, default=3,
                        help="back-to-back pairs (meshkit, MaxText) per row")
    parser.add_argument("--steps", type=script.positive_int, default=20,
                        help="timed steps per run")
    parser.add_argument("--maxtext-python", metavar="PATH", default=None,
                        help="an interpreter that has MaxText (default: this one, if it has)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller model on both sides (a smoke test)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    chosen = names if args.layouts is None else [n.strip() for n in args.layouts.split(",")]
    unknown = [n for n in chosen if n not in names]
    if unknown or not chosen:
        parser.error(f"--layouts: unknown rows {unknown}; valid: {', '.join(names)}")
    try:
        python, version = maxtext_python(args.maxtext_python)
    except ValueError as e:
        parser.error(str(e))
    shape = QUICK if args.quick else FULL
    layouts = [layout for layout in LAYOUTS if layout.name in chosen]
    configs, skipped = _configs(layouts, shape)

    report = Report("peer", argv, args.json)
    with report.printing():
        _run(args, report, layouts, configs, skipped, python, version, shape)
    report.write()
    return 0


def _mib(n: float | None) -> float | None:
    return None if n is None else n / 2**20


def _text(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _run(args: argparse.Namespace, report: Report, layouts: Sequence[Layout],
         configs: dict[str, Config], skipped: dict[str, str], python: str | None,
         version: str | None, shape: Shape) -> None:
    """Measure the rows in pairs, print the table and fill the report."""
    s = shape
    title = (f"{jax.device_count()} {jax.devices()[0].platform} devices; d_model={s.d_model} "
             f"layers={s.num_layers} heads={s.num_heads} d_ff={s.d_ff} vocab={s.vocab_size} "
             f"batch={s.batch_size}x{s.seq_len} float32, MoE {s.num_experts} experts "
             f"top-{s.top_k} capacity {s.capacity_factor}; "
             f"{args.pairs} pair{'s' if args.pairs > 1 else ''} of runs of {args.steps} "
             f"steps; memory per device")
    if python is None:
        print(f"MaxText is not installed: meshkit's columns only. To compare: {INSTALL}.\n")
    else:
        where = "in this interpreter" if args.maxtext_python is None else f"in {python}"
        print(f"MaxText {version}, {where}\n")
    print(title + "\n")
    print(f"{'layout':<14} {'params mk':>10} {'params mt':>10} {'mk/mt step':>10} "
          f"{'mk step ms':>10} {'total mk':>9} {'total mt':>9} {'temp mk':>9} {'temp mt':>9}",
          flush=True)
    table = report.table(title, ["layout", "params meshkit", "params MaxText",
                                 "step meshkit / MaxText (paired median)", "meshkit step ms",
                                 "total MiB meshkit", "total MiB MaxText",
                                 "temp MiB meshkit", "temp MiB MaxText"])
    if python is None:
        table.notes.append(f"MaxText is not installed: {INSTALL}")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="meshkit-peer-") as tmp:
        for layout in layouts:
            if layout.name in skipped:
                print(f"{layout.name:<14} skipped: {skipped[layout.name]}", flush=True)
                table.notes.append(f"{layout.name} skipped: {skipped[layout.name]}")
                continue
            rows[layout.name] = row = _measure(layout, configs[layout.name], args, python,
                                               shape, Path(tmp))
            ratio = row["ratio"]
            cells = (row["meshkit_params"], row["maxtext_params"], ratio,
                     statistics.median(row["meshkit_step_s"]) * 1e3,
                     _mib(row["meshkit_total"]), _mib(row["maxtext_total"]),
                     _mib(row["meshkit_temp"]), _mib(row["maxtext_temp"]))
            table.add(layout.name, *cells)
            print(f"{layout.name:<14} {cells[0]:>10} {_text(cells[1], 'd'):>10} "
                  f"{_text(ratio, '.2f'):>10} {cells[3]:>10.1f} "
                  + " ".join(f"{_text(c, '.2f'):>9}" for c in cells[4:]), flush=True)
            if python and row["meshkit_params"] != row["maxtext_params"]:
                line = (f"{layout.name}: the models differ: meshkit has "
                        f"{row['meshkit_params']} parameters, MaxText {row['maxtext_params']}")
                print(f"  {line}", flush=True)
                table.notes.append(line)
    report.data.update({"rows": rows, "skipped": skipped, "maxtext": version,
                        "maxtext_python": python})


def _measure(layout: Layout, config: Config, args: argparse.Namespace, python: str | None,
             shape: Shape, tmp: Path) -> dict[str, Any]:
    """One row: meshkit compiled once, then the pairs (each MaxText run its own process)."""
    ours = MeshkitRun(config)
    found: list[dict[str, Any]] = []

    def maxtext() -> float:
        assert python is not None
        workdir = tmp / f"{layout.name}-{len(found)}"
        workdir.mkdir()
        overrides = maxtext_overrides(layout, shape, steps=args.steps + MAXTEXT_WARMUP,
                                      workdir=str(workdir / "out"))
        found.append(run_maxtext(python, overrides, workdir))
        shutil.rmtree(workdir / "out", ignore_errors=True)
        if found[-1]["devices"] != DEVICES:
            raise RuntimeError(f"MaxText ran on {found[-1]['devices']} devices, not {DEVICES}")
        return maxtext_step_s(found[-1], args.steps)

    mine, theirs = run_pairs(args.pairs, lambda: ours.time(args.steps),
                             maxtext if python else None)
    memory = found[0]["memory"] if found else None
    return {
        # MaxText's times only as each pair's ratio: alone, they would be read unpaired.
        "meshkit_step_s": mine,
        "pair_ratios": [a / b for a, b in zip(mine, theirs, strict=True)] if theirs else [],
        "ratio": paired_ratio(mine, theirs) if theirs else None,
        "meshkit_params": ours.params, "maxtext_params": found[0]["params"] if found else None,
        "meshkit_total": ours.total_bytes, "meshkit_temp": ours.parts["temp"],
        "meshkit_memory": ours.parts,
        "maxtext_total": None if memory is None else (
            memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]),
        "maxtext_temp": None if memory is None else memory["temp"],
        "maxtext_memory": memory,
        "maxtext_jax": found[0]["jax"] if found else None,
    }


if __name__ == "__main__":
    raise SystemExit(script.run(main, "peer"))
