"""Check the planner's memory against the compiler: compile the real step, read XLA's bytes.

:func:`verify` compiles meshkit's training step (:func:`meshkit.training.compile_step`) for
each layout at the target device count, in a subprocess that simulates that many CPU
devices, with abstract inputs (nothing is allocated), and reads one device's bytes from
XLA's ``memory_analysis()``: argument + temp + output − alias (:func:`xla_bytes`).

The subprocesses are :mod:`meshkit.training.compile_worker` (the training step lives a layer
above the planner, so only they import it): each reads jobs as JSON lines on stdin, one
at a time as it finishes the last, and writes a JSON line as each starts and ends, which
the parent turns into progress lines. Up to :data:`MAX_WORKERS` compile at once (one per
core). Each runs in its own process group, killed on any exit of the parent's loop
(Ctrl-C included) and, when SIGTERM or SIGHUP ends the command without its clean-up,
by the signal's exit (:mod:`meshkit.runtime.children`); a worker whose parent dies
without either (SIGKILL) ends itself within a second, so nothing is left running.

Why XLA's CPU figure can differ from a GPU's: the CPU compiler fuses differently (fewer,
smaller fusions, so more temporaries materialised), lays collectives out as plain copies,
and has no cuDNN attention; a GPU build adds its own workspace (cuBLAS, NCCL buffers)
that no ``memory_analysis()`` counts. The figures here are the CPU compiler's, for the
exact mesh; see docs/guides/planning.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshkit.choices import PIPELINE_SCHEDULES_BUILT
from meshkit.errors import UsageError
from meshkit.runtime import children
from meshkit.runtime.distributed import MAX_SIMULATED_DEVICES
from meshkit.units import format_bytes

__all__ = ["COMPILE_FLAGS", "ISSUE20_KEYS", "MAX_WORKERS", "VerifyError", "VerifyJob",
           "VerifyResult", "check_simulated", "known_keys", "stage_split", "verify", "verify_plan",
           "xla_bytes"]

#: The config keys of the memory issue the planner's choices map to. ``--verify`` passes
#: a choice through only when the installed config schema knows its key, so the
#: compiled step follows the planner's remat, attention and schedule once they exist.
ISSUE20_KEYS = ("model.remat", "model.attention", "model.attention_chunk",
                "parallel.schedule", "parallel.zero1", "parallel.stage_layers")


class VerifyError(UsageError):
    """``--verify`` cannot run: too many devices to simulate, or a compile failed."""


@dataclasses.dataclass(frozen=True)
class VerifyJob:
    """One compile: a config file (or the default) with overrides.

    Attributes:
        name: a label for progress lines.
        config_path: the YAML config, ``None`` for the default.
        overrides: ``key=value`` overrides (the layout's among them).
    """

    name: str
    config_path: str | None
    overrides: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """XLA's bytes of one device for one job, or why there are none.

    Attributes:
        name: the job's label.
        bytes: argument + temp + output − alias, ``None`` on an error.
        parts: ``argument``, ``temp``, ``output``, ``alias`` bytes.
        seconds: the compile's wall time.
        error: a one-line reason, or ``None``.
    """

    name: str
    bytes: int | None
    parts: dict[str, int]
    seconds: float
    error: str | None = None


def xla_bytes(stats: object) -> tuple[int, dict[str, int]]:
    """One device's bytes of a compiled program by XLA's ``memory_analysis()``.

    Args:
        stats: ``compiled.memory_analysis()``.

    Returns:
        ``(argument + temp + output − alias, the four parts)``.

    Examples:
        >>> from types import SimpleNamespace as S
        >>> xla_bytes(S(argument_size_in_bytes=10, temp_size_in_bytes=5,
        ...             output_size_in_bytes=10, alias_size_in_bytes=8))[0]
        17
    """
    parts = {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0)
             for name in ("argument", "temp", "output", "alias")}
    return parts["argument"] + parts["temp"] + parts["output"] - parts["alias"], parts


def check_simulated(devices: int) -> int:
    """Check that this host can simulate ``devices`` CPU devices in one process.

    Args:
        devices: the target device count.

    Returns:
        ``devices``.

    Raises:
        VerifyError: more than :data:`meshkit.runtime.distributed.MAX_SIMULATED_DEVICES`.

    Examples:
        >>> check_simulated(64)
        64
    """
    if devices > MAX_SIMULATED_DEVICES:
        raise VerifyError(
            f"--verify: {devices} devices are more than this host can simulate in one "
            f"process (the limit is {MAX_SIMULATED_DEVICES}); plan for fewer devices or "
            f"drop --verify")
    return devices


#: XLA:CPU flags of the compiling subprocesses: no LLVM optimisation of the generated
#: code, which is never run. ``memory_analysis()`` comes from HLO buffer assignment,
#: before code generation: its four figures were byte-identical with and without these
#: flags on every layout tried (7 at 8 devices, 3 full-size Mixtral layouts at 256), and
#: a compile spends ~20 % less CPU (the planning guide has the figures). The tests use the same.
COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                 "--xla_llvm_disable_expensive_passes=true")
#: Compiles run at once at most: each subprocess compiles one job at a time with about
#: one core, and holds its own simulated devices and compiler (~0.8 GiB resident for a
#: full-size model at 256 devices).
MAX_WORKERS = 2


def _workers(jobs: int) -> int:
    """How many compiling subprocesses: one per core, at most :data:`MAX_WORKERS`, and
    no more than the jobs."""
    return max(1, min(jobs, os.cpu_count() or 1, MAX_WORKERS))


@contextlib.contextmanager
def _worker_pool(devices: int, count: int) -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` compiling subprocesses, each in its own process group, all killed with
    their groups when the block exits (Ctrl-C included) or a stop signal ends the
    process (:func:`meshkit.runtime.children.kill_all`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join((f"--xla_force_host_platform_device_count={devices}",
                                 *COMPILE_FLAGS))
    procs: list[subprocess.Popen[str]] = []
    # Named until the finally has killed them: a signal in between still finds them.
    with contextlib.ExitStack() as named:
        try:
            for _ in range(count):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "meshkit.training.compile_worker"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, env=env,
                    start_new_session=True))  # its own group: one kill ends its children too
                named.enter_context(children.tracked(procs[-1].pid))
            yield procs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()


def _read_lines(index: int, proc: subprocess.Popen[str],
                inbox: queue.Queue[tuple[int, str | None]]) -> None:
    """Forward a worker's stdout lines to ``inbox``; ``None`` once it closes."""
    assert proc.stdout is not None
    with contextlib.suppress(OSError, ValueError):  # closed under it by the pool's exit
        for line in proc.stdout:
            inbox.put((index, line))
    inbox.put((index, None))


def _keep_tail(proc: subprocess.Popen[str], tail: collections.deque[str]) -> None:
    """Drain a worker's stderr as it comes (XLA can write more than a pipe holds, which
    would block the worker), keeping the last lines for an error message."""
    assert proc.stderr is not None
    with contextlib.suppress(OSError, ValueError):
        for line in proc.stderr:
            if line.strip():
                tail.append(line.strip())


def _send_job(proc: subprocess.Popen[str], index: int | None, job: VerifyJob | None) -> None:
    """Hand a worker its next job, or close its input when there is none; a worker that
    died meanwhile is reported once every worker has ended."""
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        if job is None:
            proc.stdin.close()
            return
        proc.stdin.write(json.dumps({"index": index, **dataclasses.asdict(job)}) + "\n")
        proc.stdin.flush()


def verify(jobs: Sequence[VerifyJob], *, devices: int,
           progress: Callable[[str], None] | None = None,
           workers: int | None = None) -> list[VerifyResult]:
    """Compile each job for ``devices`` simulated CPU devices; XLA's bytes per device.

    The jobs are compiled by up to ``workers`` subprocesses at once, each taking the next
    job when it finishes one, so a long compile does not hold back the others.

    Args:
        jobs: what to compile, in order.
        devices: the target device count (the layouts' device count).
        progress: called with one line before and after each compile.
        workers: subprocesses compiling at once (default: one per core, at most
            :data:`MAX_WORKERS`, no more than the jobs).

    Returns:
        One :class:`VerifyResult` per job, in the jobs' order; a job whose compile failed
        has ``bytes=None`` and the error's last line.

    Raises:
        VerifyError: ``devices`` beyond what the host simulates, ``workers`` below 1, or
            a subprocess died.

    Example::

        verify([VerifyJob("dp8", None, ("mesh.axes={dp: 8}",))], devices=8)
    """
    check_simulated(devices)
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise VerifyError(f"--verify: workers must be a positive integer, got {workers!r}")
    if not jobs:
        return []
    say = progress or (lambda line: None)
    count = min(workers or _workers(len(jobs)), len(jobs))
    results: dict[int, VerifyResult] = {}
    inbox: queue.Queue[tuple[int, str | None]] = queue.Queue()
    pending = iter(enumerate(jobs))
    tails: list[collections.deque[str]] = [collections.deque(maxlen=5) for _ in range(count)]
    drains: list[threading.Thread] = []
    with _worker_pool(devices, count) as procs:
        for w, proc in enumerate(procs):
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(json.dumps({"devices": devices, "parent": os.getpid()})
                                 + "\n")
            _send_job(proc, *next(pending, (None, None)))
            threading.Thread(target=_read_lines, args=(w, proc, inbox), daemon=True).start()
            drains.append(threading.Thread(target=_keep_tail, args=(proc, tails[w]),
                                           daemon=True))
            drains[-1].start()
        started = time.monotonic()
        say(f"verify: compiling {len(jobs)} layout(s) for {devices} simulated CPU devices"
            + (f", {count} at a time" if count > 1 else ""))
        open_workers = count
        while open_workers:
            w, line = inbox.get()
            if line is None:
                open_workers -= 1
                continue
            msg = json.loads(line)
            if "start" in msg:
                say(f"verify: compiling {msg['name']} ...")
                continue
            r = VerifyResult(msg["name"], msg["bytes"], msg["parts"], msg["seconds"],
                             msg["error"])
            results[msg["done"]] = r
            _send_job(procs[w], *next(pending, (None, None)))
            what = (f"{format_bytes(r.bytes)}/device" if r.bytes is not None
                    else f"failed: {r.error}")
            say(f"verify: [{len(results)}/{len(jobs)}] {r.name}: {what} "
                f"({r.seconds:.0f} s compile, {time.monotonic() - started:.0f} s so far)")
        for proc, tail, drain in zip(procs, tails, drains, strict=True):
            if proc.wait() != 0:
                drain.join(timeout=5)  # its last lines, written before it ended
                last = tail[-1] if tail else f"exit status {proc.returncode}"
                raise VerifyError(f"--verify: the compiling subprocess failed: {last}")
        if len(results) != len(jobs):
            raise VerifyError("--verify: the compiling subprocesses ended before their jobs")
    return [results[i] for i in range(len(jobs))]


def known_keys() -> frozenset[str]:
    """The keys of :data:`ISSUE20_KEYS` this meshkit's config schema knows.

    Returns:
        A subset of :data:`ISSUE20_KEYS`.

    Examples:
        >>> known_keys() <= frozenset(ISSUE20_KEYS)
        True
    """
    from meshkit.config.sections import all_keys

    return frozenset(ISSUE20_KEYS) & frozenset(all_keys())


def _compiled_schedule(schedule: str, known: frozenset[str]) -> str:
    """The schedule ``--verify`` compiles: one the transformer does not run yet (or a
    config without ``parallel.schedule``) compiles as GPipe, and says so
    (:func:`meshkit.plan.model_plan.uncompiled`)."""
    built = "parallel.schedule" in known and schedule in PIPELINE_SCHEDULES_BUILT
    return schedule if built else "gpipe"


def _compiled_dense_layers(desc: Any, stages: int, layers: int) -> int:
    """The dense layers compiled of a description's at ``layers`` layers: fewer than the
    layers, and none in a pipelined layout (meshkit refuses ``model.dense_layers`` with
    a pipeline: they are compiled as MoE layers, as
    :meth:`~meshkit.plan.model_desc.ModelDesc.differences` says)."""
    return 0 if stages > 1 else min(desc.dense_layers, max(layers - 1, 0))


def _layer_counts(num_layers: int, stages: int, virtual_stages: int,
                  extrapolate: bool) -> list[int]:
    """The layer counts compiled for one candidate: the model's, or with ``extrapolate``
    two whose stages each hold whole chunks (``virtual_stages`` of them) and at least two
    layers, when the model has that many."""
    if not extrapolate:
        return [num_layers]
    low = stages * max(2, virtual_stages)
    return [low, 2 * low] if 2 * low <= num_layers else [num_layers]


def stage_split(num_layers: int, stages: int) -> list[int]:
    """Uneven pipeline stages as ``--verify`` compiles them (``parallel.stage_layers``):
    the first ``num_layers % stages`` stages hold one layer more, so the largest holds
    ``ceil(num_layers / stages)``, the count the planner charges.

    Args:
        num_layers: the layers.
        stages: the pipeline stages (at most ``num_layers``).

    Returns:
        Layers of each stage, first to last.

    Examples:
        >>> stage_split(126, 16)[:7], stage_split(126, 16)[-1]
        ([8, 8, 8, 8, 8, 8, 8], 7)
    """
    q, r = divmod(num_layers, stages)
    return [q + 1] * r + [q] * (stages - r)


def verify_plan(desc: Any, preds: Sequence[Any], *, devices: int, count: int,
                memory_bytes: int | None, extrapolate: bool = False,
                progress: Callable[[str], None] | None = None,
                config: tuple[str | None, Sequence[str]] | None = None) -> list[Any]:
    """``meshkit plan ... --verify K``: compile the best ``count`` candidates.

    With ``config`` (``meshkit plan CONFIG``), each candidate compiles that config with
    its overrides and the candidate's layout: the config's own model, a
    ``model.factory`` one included (the compiling subprocess imports it), with the
    config's choices. Without, the description's (``--model``), as below.

    Each candidate's step is compiled as meshkit builds it (the nearest meshkit can, see
    :meth:`meshkit.plan.model_desc.ModelDesc.differences`) with one micro-step's batch;
    its accumulator (one parameter copy, when ``grad_accum > 1``) is added to XLA's
    figure. The ``interleaved`` schedule is compiled with the candidate's virtual stages.
    With ``extrapolate``, ``2S`` and ``4S`` layers are compiled (``S`` pipeline stages;
    ``vS`` and ``2vS`` for ``v`` virtual stages above 2) and XLA's bytes extended
    linearly to the model's layers: two layers a stage at least, as a scan over one
    layer is not on the line through longer ones (Llama-2-7B at dp8·fsdp8 with remat:
    30.1 GiB at 1 layer, 27.6 at 2, 28.9 at 4). Stages that do not divide the layers are
    compiled uneven (``parallel.stage_layers``, :func:`stage_split`); extrapolated, to
    ``S · ceil(layers / S)`` layers, the slots every stage then holds.

    Args:
        desc: the :class:`meshkit.plan.model_desc.ModelDesc`.
        preds: ranked :class:`meshkit.plan.model_plan.ModelPrediction` s.
        devices: the device count.
        count: how many to compile (``--verify K``).
        memory_bytes: the device memory; a verified candidate above it is flagged.
        extrapolate: compile few layers and extrapolate.
        progress: progress lines.
        config: ``(config file or None, overrides)`` of ``meshkit plan CONFIG``; with
            ``extrapolate`` its model is meshkit's (``model.num_layers`` is set).

    Returns:
        The predictions with ``verified_bytes`` set on the first ``count``, the ones that
        fit by XLA's figure first (in their ranked order), those over ``memory_bytes``
        after them, then the unverified rest.

    Raises:
        VerifyError: ``count`` below 1 or above the candidates, or ``devices`` beyond what
            this host simulates.
    """
    import dataclasses as dc

    from meshkit.plan.memory_fit import layout_memory

    if isinstance(count, bool) or count < 1 or count > len(preds):
        raise VerifyError(f"--verify: {count} is more than the {len(preds)} candidate(s) "
                          "that fit" if count > len(preds) else
                          f"--verify: must be a positive integer, got {count!r}")
    check_simulated(devices)
    known = known_keys()
    jobs: list[VerifyJob] = []
    plan: list[tuple[int, list[int]]] = []  # per candidate: layer counts compiled
    for i, p in enumerate(preds[:count]):
        c = p.candidate
        schedule = _compiled_schedule(c.schedule, known)
        virtual = c.virtual_stages if schedule == "interleaved" else 1
        layer_counts = _layer_counts(desc.num_layers, c.layout.pipeline, virtual,
                                     extrapolate)
        plan.append((i, layer_counts))
        for n in layer_counts:
            if config is not None:  # the config's own model and choices
                layers = [f"model.num_layers={n}"] if extrapolate else []
                # Even stages, as the planner ranked them (planning_config drops a
                # config's own stage_layers, which were for its own pipeline).
                even = ["parallel.stage_layers=null"] if c.layout.pipeline > 1 else []
                jobs.append(VerifyJob(f"#{i + 1} {c.name()}" + (f" L{n}" if layers else ""),
                                      config[0], (*config[1], *layers, *even,
                                                  *c.layout.overrides())))
                continue
            small = dc.replace(desc, num_layers=n, dense_layers=_compiled_dense_layers(
                desc, c.layout.pipeline, n))
            ov = small.overrides(grad_accum=c.grad_accum, remat=c.remat,
                                 attention=c.attention, known=known)
            if c.layout.pipeline > 1 and "parallel.schedule" in known:
                ov.append(f"parallel.schedule={schedule}")
                ov.append(f"parallel.virtual_stages={virtual}")
            if n % c.layout.pipeline and "parallel.stage_layers" in known:
                ov.append("parallel.stage_layers=["
                          + ", ".join(map(str, stage_split(n, c.layout.pipeline))) + "]")
            jobs.append(VerifyJob(f"#{i + 1} {c.name()} L{n}", None,
                                  tuple(ov + c.layout.overrides())))
    results = iter(verify(jobs, devices=devices, progress=progress))
    out = list(preds)
    for i, counts in plan:
        got = [next(results) for _ in counts]
        if any(r.bytes is None for r in got):
            continue
        sizes = [int(r.bytes or 0) for r in got]
        stages = out[i].candidate.layout.pipeline
        # Uneven stages each hold the largest stage's layer slots (the rest idle).
        slots = stages * -(-desc.num_layers // stages)
        total = sizes[0] if len(sizes) == 1 else round(
            sizes[0] + (sizes[1] - sizes[0]) / (counts[1] - counts[0])
            * (slots - counts[0]))
        accum = int(out[i].memory.terms["accumulator"])
        c = out[i].candidate
        built = desc.buildable()
        built = dc.replace(built, dense_layers=_compiled_dense_layers(
            built, c.layout.pipeline, built.num_layers))
        compiled = out[i].memory if config is not None else layout_memory(
            built, c.layout, grad_accum=c.grad_accum,
            remat=c.remat if "model.remat" in known else "none",
            attention=c.attention if "model.attention" in known else "xla",
            schedule=_compiled_schedule(c.schedule, known),
            virtual_stages=c.virtual_stages)
        out[i] = dc.replace(out[i], verified_bytes=total + accum,
                            compiled_prediction=compiled.total)
    head = out[:count]
    fits = [p for p in head if p.verified_bytes is not None and
            (memory_bytes is None or p.verified_bytes <= memory_bytes)]
    over = [p for p in head if p not in fits]
    return fits + over + out[count:]
