"""``meshkit calibrate``: measure this machine's FLOP/s and links, write a topology file.

What it times, each the fastest of a few runs after a warm-up (see ``_time``):

* **matmul FLOP/s**: every device multiplies its own ``[n, n]`` float32 matrices at
  once (one ``jax.shard_map``), so simulated devices share the host's cores as they do
  in training; FLOP/s per device is ``2n³`` over the time. The best of the sizes tried.
* **memory bandwidth**: every device adds 1 to its own float32 buffer (read + write).
* **collectives** over all the process's devices (the ``intra`` link), at several
  sizes: ``psum`` (all-reduce), ``all_to_all`` and a cyclic ``ppermute``
  (collective-permute), each timed as a chain of 8 in one program (a collective's cost
  in a step, not the program launch's noise). One link ``(α, β)`` is fitted to all
  three at once, each sample weighted by ``1/t`` (relative error), with the cost model's
  formulas for ``g`` devices and ``B`` bytes a device (the planner's)::

      all-reduce   2(g−1)·α + 2(g−1)/g · B/β
      all-to-all    (g−1)·α +  (g−1)/g · B/β
      permute           1·α +          B/β

* **across 2 processes** (``--processes 2``): the same three collectives over the
  process axis of 2 processes × 4 devices started by :func:`meshkit.runtime.launch.launch`
  (gloo over loopback TCP), fitted to the ``inter`` link with ``g = 2``. With one
  process, ``inter`` is a copy of ``intra`` (there is no slower link to measure).
* **over a shaped link** (``--link-rate 1gbit``): the same, with the 2 processes started
  as nodes whose NICs run at that rate (``meshkit launch --link-rate``,
  :mod:`meshkit.runtime.link`): the ``inter`` link of a cluster with such a network, for
  ``meshkit plan --topology`` and ``exchange.topology`` (so ``exchange.method: auto``)
  to decide for it. The rate is recorded under ``measured.link_rate``.

The file holds :func:`meshkit.exchange.cost.topology_to_dict`'s keys (``devices_per_node`` is the
process's device count) plus ``measured``: every raw timing. ``meshkit plan --topology``
and ``exchange.topology`` read it with :func:`meshkit.exchange.cost.load_topology`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import yaml

from meshkit._fs import cannot_write, write_file
from meshkit.errors import UsageError
from meshkit.exchange import cost

__all__ = ["OPS", "calibrate", "fit_link", "measure_collectives", "run_calibrate", "summary"]

_log = logging.getLogger(__name__)

#: The collectives timed, with ``(messages, byte factor)`` of the formulas above as
#: functions of the group size ``g``.
OPS: dict[str, Callable[[int], tuple[float, float]]] = {
    "all-reduce": lambda g: (2 * (g - 1), 2 * (g - 1) / g),
    "all-to-all": lambda g: (g - 1, (g - 1) / g),
    "collective-permute": lambda g: (1, 1.0),
}
_SIZES = (2**12, 2**16, 2**20, 2**22)  # bytes per device
_QUICK_SIZES = (2**12, 2**16, 2**20)
_MATMUL = (256, 512)
_QUICK_MATMUL = (128,)
_COPY_BYTES = 2**24
# Collectives a timed program runs back to back (each on the last one's output). One
# collective a program left its cost (tens of µs on 8 simulated devices) below the noise
# of the launch time subtracted from it, so the fitted latency came out negative and was
# clipped to 0 in every `meshkit bench plan` run; a chain of 8 in one program measures
# what a collective costs inside a training step (its program already launched) and
# divides the launch noise by 8. Measured here (8 simulated devices, 2 shared cores, 4 KiB
# a device): one all-to-all a program 281 − 174 µs (launch) = 107 µs, noise ± 100 µs;
# 16 a program (1451 − 116) / 16 = 83 µs each.
_CHAIN = 8
_WEIGHT_FLOOR_S = 2e-5
_MIN_SECONDS = 1e-7  # a floor for a sample that the dispatch time swallowed (noise)


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up.

    The fastest, not the median: on a shared machine another job's burst lands on some
    of the runs, and on the median of one measurement but not of the next, so the
    median made the rates the planner weighs against each other (matmul FLOP/s, memory
    bandwidth, links) disagree by whatever load each met: memory bandwidth 0.79 and
    0.27 GB/s in two `meshkit bench plan --quick` calibrations minutes apart (load 5–8),
    which moves the weights and optimizer terms against compute and reorders the
    near-tied top layouts. The fastest run is each rate undisturbed, all on one footing.
    """
    import jax

    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def _collective(op: str, axis: Any, g: int, chain: int = 1) -> Callable[[Any], Any]:
    """``chain`` of ``op`` over ``axis``, each on the previous one's output (a psum of
    ones grows ``g``-fold a link: ``8**8`` is still exact in float32)."""
    import jax

    def one(x: Any) -> Any:
        if op == "all-reduce":
            return jax.lax.psum(x, axis)
        if op == "all-to-all":
            return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
        return jax.lax.ppermute(x, axis, [(i, (i + 1) % g) for i in range(g)])

    def body(x: Any) -> Any:
        for _ in range(chain):
            x = one(x)
        return x

    return body


def measure_collectives(mesh: Any, axis: str, *, sizes: Sequence[int],
                        repeats: int, chain: int = _CHAIN) -> list[dict[str, Any]]:
    """Time each of :data:`OPS` over ``axis`` of ``mesh`` at each size.

    Args:
        mesh: a ``jax.sharding.Mesh``.
        axis: the mesh axis the collectives run over (group size = its size).
        sizes: bytes each device sends (a multiple of ``4 × g``).
        repeats: timed runs (the fastest is kept).
        chain: collectives a timed program runs back to back (see ``_CHAIN``).

    Returns:
        One ``{op, group, bytes, seconds}`` row per op and size; ``seconds`` is one
        collective's share of the program: the fastest time less that of an identity
        program of the smallest size (the cost of launching a program, which a collective
        inside a training step does not pay), over ``chain``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    g = mesh.shape[axis]
    spec = P(tuple(mesh.axis_names))
    # What launching any program costs (dispatch, not communication): an identity-like
    # program on the smallest buffer, subtracted from every sample.
    idle = jax.jit(jax.shard_map(lambda x: x + 0, mesh=mesh, in_specs=spec, out_specs=spec))
    small = jax.device_put(jnp.ones((mesh.size * min(sizes) // 4,), jnp.float32),
                           NamedSharding(mesh, spec))
    dispatch = _time(lambda: idle(small), repeats)
    rows = []
    for op in OPS:
        body = _collective(op, axis, g, chain)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        for size in sizes:
            per_device = size // 4
            x = jax.device_put(jnp.ones((mesh.size * per_device,), jnp.float32),
                               NamedSharding(mesh, spec))
            seconds = (_time(functools.partial(fn, x), repeats) - dispatch) / chain
            rows.append({"op": op, "group": g, "bytes": size,
                         "seconds": max(seconds, _MIN_SECONDS)})
    return rows


def fit_link(rows: Sequence[dict[str, Any]]) -> cost.Link:
    """The ``(α, β)`` that fit the rows best in relative error (formulas above).

    Args:
        rows: ``{op, group, bytes, seconds}`` samples.

    Returns:
        The link; latency clipped at 0 when the fit would make it negative.

    Raises:
        ValueError: fewer than 2 samples, or timings that give no positive bandwidth.

    Examples:
        >>> rows = [{"op": "collective-permute", "group": 2, "bytes": b,
        ...          "seconds": 1e-5 + b / 1e9} for b in (1e3, 1e6)]
        >>> link = fit_link(rows)
        >>> round(link.latency_s * 1e6, 3), round(link.bandwidth_Bps / 1e9, 3)
        (10.0, 1.0)
    """
    if len(rows) < 2:
        raise ValueError(f"fit_link: needs at least 2 samples, got {len(rows)}")
    a = np.array([[OPS[r["op"]](int(r["group"]))[0],
                   OPS[r["op"]](int(r["group"]))[1] * r["bytes"]] for r in rows])
    t = np.array([r["seconds"] for r in rows])
    # Relative error, but a sample the dispatch correction left near 0 must not outweigh
    # the others: its weight is capped as if it took _WEIGHT_FLOOR_S.
    w = 1 / np.maximum(t, _WEIGHT_FLOOR_S)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if inv_beta <= 0:
        raise ValueError("fit_link: the timings do not grow with the message size; no "
                         "bandwidth can be fitted (time larger sizes)")
    if alpha < 0:  # refit the bandwidth alone
        alpha = 0.0
        inv_beta = float(np.sum(a[:, 1] * w * t * w) / np.sum((a[:, 1] * w) ** 2))
    return cost.Link(latency_s=float(alpha), bandwidth_Bps=float(1 / inv_beta))


def _per_device_rate(mesh: Any, make: Callable[[Any], Any], shape: tuple[int, ...],
                     repeats: int) -> float:
    """Seconds for every device to run ``make`` on its own ``shape`` block at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P(tuple(mesh.axis_names))
    fn = jax.jit(jax.shard_map(make, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((mesh.size * shape[0], *shape[1:]), jnp.float32),
                       NamedSharding(mesh, spec))
    return _time(lambda: fn(x), repeats)


def calibrate(*, sizes: Sequence[int] = _SIZES, matmul: Sequence[int] = _MATMUL,
              repeats: int = 5) -> dict[str, Any]:
    """Measure this process's devices (FLOP/s, memory bandwidth, the intra link).

    Args:
        sizes: collective sizes in bytes per device.
        matmul: square matrix sizes tried for the FLOP/s (the best is kept).
        repeats: timed runs per measurement (the fastest is kept).

    Returns:
        ``{devices_per_node, intra, memory_bandwidth_Bps, flops_per_s, memory_bytes,
        measured}``: a topology file's contents but ``inter``.
    """
    import jax

    from meshkit.plan.memory import host_memory
    from meshkit.strategy.ranks import Strategy

    devices = jax.device_count()
    mesh = Strategy.from_axes({"all": devices}).mesh()
    flops = {}
    for n in matmul:
        seconds = _per_device_rate(mesh, lambda x: x @ x, (n, n), repeats)
        flops[n] = 2 * n**3 / seconds
    words = _COPY_BYTES // 4
    copy_s = _per_device_rate(mesh, lambda x: x + 1, (words,), repeats)
    rows = measure_collectives(mesh, "all", sizes=sizes, repeats=repeats)
    memory = host_memory()
    platform = jax.devices()[0].platform
    return {
        "devices_per_node": devices,
        "intra": dataclasses.asdict(fit_link(rows)),
        "memory_bandwidth_Bps": 2 * _COPY_BYTES / copy_s,
        "flops_per_s": max(flops.values()),
        # Simulated CPU devices share the host's memory.
        "memory_bytes": (memory // devices if platform == "cpu" and memory else None),
        "measured": {"platform": platform, "matmul_flops_per_s": flops,
                     "copy_seconds": copy_s, "intra": rows},
    }


def _inter_worker(path: str, sizes: Sequence[int], repeats: int) -> None:
    """One of 2 processes: time the collectives over the process axis; process 0 writes."""
    import jax

    from meshkit.runtime.distributed import initialize
    from meshkit.strategy.ranks import Strategy

    initialize()
    mesh = Strategy.from_axes({"node": 2, "device": jax.device_count() // 2}).mesh()
    rows = measure_collectives(mesh, "node", sizes=sizes, repeats=repeats)
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def _measure_inter(sizes: Sequence[int], repeats: int, *, link_rate: str | None = None,
                   link_burst: str | None = None) -> list[dict[str, Any]]:
    from meshkit.runtime.launch import launch, pass_on_signal

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inter.json")
        command = [sys.executable, "-m", "meshkit.plan.calibrate", "--inter-worker", path,
                   "--repeats", str(repeats), "--sizes", ",".join(map(str, sizes))]
        out = io.StringIO()
        # The workers have nothing to save: a short grace after a forwarded Ctrl-C.
        result = launch(command, 2, devices_per_process=4, timeout_s=300, grace_s=2.0,
                        out=out, link_rate=link_rate, link_burst=link_burst)
        pass_on_signal(result)  # Ctrl-C, SIGTERM or SIGHUP: the launcher ended the workers
        if result.returncode:
            _log.error(out.getvalue())  # the workers' own output says why
            raise UsageError(f"meshkit calibrate: the 2-process measurement failed (exit "
                             f"{result.returncode}); rerun with --processes 1")
        with open(path) as f:
            rows: list[dict[str, Any]] = json.load(f)
    return rows


def to_yaml(measured: dict[str, Any]) -> str:
    """The topology file's text: a comment, then the keys :func:`load_topology` reads."""
    head = ("# meshkit topology, measured by `meshkit calibrate` "
            f"({time.strftime('%Y-%m-%d %H:%M:%S')}); read by `meshkit plan --topology` and "
            "exchange.topology\n")
    return head + yaml.safe_dump(measured, sort_keys=False, default_flow_style=None)


def run_calibrate(output: str, *, processes: int = 2, quick: bool = False,
                  link_rate: str | None = None, link_burst: str | None = None) -> dict[str, Any]:
    """``meshkit calibrate``: measure and write the topology file.

    Args:
        output: the ``.yaml`` file to write.
        processes: 1 (this process's devices only) or 2 (also across 2 processes).
        quick: fewer sizes and repeats.
        link_rate: measure the ``inter`` link between 2 processes whose NICs are shaped
            to this rate (``1gbit``; :mod:`meshkit.runtime.link`); needs ``processes=2``.
        link_burst: the shaped NICs' bucket (``512kb``); only with ``link_rate``.

    Returns:
        What it wrote (:func:`summary` is the command's report of it).

    Raises:
        UsageError: ``output`` not a ``.yaml``/``.yml`` path in an existing directory, a
            directory, or a file that cannot be written (checked before measuring; a
            disk that fills up meanwhile is reported too), or ``processes`` not 1 or 2,
            or a failed 2-process run (the workers' output is
            logged as an error first); a malformed ``link_rate``/``link_burst``, one
            with ``processes=1``, or a machine that cannot shape a link (checked before
            measuring).
    """
    if not cost.is_topology_file(output):
        raise UsageError(f"--output: {output!r} must end in .yaml or .yml (that is how "
                         "exchange.topology tells a file from a preset)")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UsageError(f"--output: directory {folder} does not exist")
    problem = cannot_write(output)  # before minutes of measuring, not after them
    if problem is not None:
        raise UsageError(f"--output: cannot write {output}: {problem}")
    if processes not in (1, 2):
        raise UsageError(f"--processes: must be 1 or 2, got {processes!r}")
    if link_rate is not None or link_burst is not None:
        from meshkit.runtime.link import check_available, link_shape

        if link_rate is None:
            raise UsageError("--link-burst needs --link-rate")
        link_shape(link_rate, link_burst)
        if processes != 2:
            raise UsageError("--link-rate shapes the link between 2 processes; it needs "
                             f"--processes 2, got {processes}")
        check_available()
    sizes, matmul, repeats = ((_QUICK_SIZES, _QUICK_MATMUL, 3) if quick
                              else (_SIZES, _MATMUL, 5))
    result = calibrate(sizes=sizes, matmul=matmul, repeats=repeats)
    if processes == 2:
        rows = _measure_inter(sizes, repeats, link_rate=link_rate, link_burst=link_burst)
        result["inter"] = dataclasses.asdict(fit_link(rows))
        result["measured"]["inter"] = rows
        if link_rate is not None:
            result["measured"]["link_rate"] = link_rate
    else:
        result["inter"] = dict(result["intra"])
    ordered = {k: result[k] for k in ("devices_per_node", "inter", "intra",
                                      "memory_bandwidth_Bps", "flops_per_s", "memory_bytes",
                                      "measured")}
    write_file(output, to_yaml(ordered), flag="--output")
    if os.path.isfile(output):  # not a device such as /dev/null
        cost.load_topology(output, nodes=1)  # what it wrote reads back
    return ordered


def summary(measured: dict[str, Any]) -> str:
    """The links, FLOP/s and memory bandwidth of a topology, one line each.

    Args:
        measured: :func:`run_calibrate`'s result.

    Returns:
        Three lines, without a final newline.

    Examples:
        >>> link = {"latency_s": 2e-6, "bandwidth_Bps": 5e10}
        >>> print(summary({"intra": link, "inter": link, "flops_per_s": 1e12,
        ...                "memory_bandwidth_Bps": 1e11}).splitlines()[2])
        matmul  1000.00 GFLOP/s per device   memory 100.00 GB/s per device
    """
    lines = []
    for name in ("intra", "inter"):
        link = measured[name]
        lines.append(f"{name:<6} latency {link['latency_s'] * 1e6:8.1f} µs   bandwidth "
                     f"{link['bandwidth_Bps'] / 1e9:8.2f} GB/s")
    lines.append(f"matmul {measured['flops_per_s'] / 1e9:8.2f} GFLOP/s per device   memory "
                 f"{measured['memory_bandwidth_Bps'] / 1e9:.2f} GB/s per device")
    return "\n".join(lines)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="meshkit calibrate's 2-process worker")
    parser.add_argument("--inter-worker", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", required=True)
    args = parser.parse_args(argv)
    _inter_worker(args.inter_worker, [int(s) for s in args.sizes.split(",")], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
