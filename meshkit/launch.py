"""``meshkit launch``: run N local processes of one command over ``jax.distributed``.

Each process gets a coordinator on a free 127.0.0.1 port and its id in the environment
(see :mod:`meshkit.distributed`), and optionally K simulated CPU devices. Their output is
streamed with a ``[i]`` prefix. When any process fails, the others are ended (SIGTERM,
then SIGKILL after a grace period) and the launcher exits with the failed process's code,
naming it: a dead peer never leaves the job hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from meshkit.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    set_cpu_device_count,
)

__all__ = ["LaunchResult", "free_port", "launch", "process_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Returns:
        The port number.

    Example:
        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_env(
    base: Mapping[str, str], coordinator: str, num_processes: int, process_id: int,
    devices_per_process: int | None,
) -> dict[str, str]:
    """The environment of one launched process.

    Args:
        base: the launcher's environment.
        coordinator: ``host:port`` of process 0's coordinator.
        num_processes: how many processes.
        process_id: this one's id.
        devices_per_process: simulated CPU devices per process, or ``None`` to leave
            the device count to the command (``meshkit train`` sets its own): a count
            inherited from ``base`` is removed, since it was meant for one process.

    Returns:
        A new environment mapping.

    Example:
        >>> env = process_env({}, "127.0.0.1:9", 2, 1, 4)
        >>> env["MESHKIT_PROCESS_ID"], env["XLA_FLAGS"]
        ('1', '--xla_force_host_platform_device_count=4')
    """
    env = dict(base)
    env.update({
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        "PYTHONUNBUFFERED": "1",
    })
    set_cpu_device_count(devices_per_process, env, replace=True)
    if devices_per_process is not None:
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a launch ended.

    Attributes:
        returncode: 0, or the first failed process's exit code (128 + signal if killed).
        failed: the id of the process that failed first, or ``None``.
        seconds_to_stop: seconds from noticing the failure to every process gone.
    """

    returncode: int
    failed: int | None
    seconds_to_stop: float


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    # The group outlives its leader when the leader exits first: signal it regardless.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _end(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        _signal_group(p, signal.SIGKILL)
        p.wait()


def _watch(p: subprocess.Popen[bytes], i: int, exits: queue.Queue[tuple[int, int]]) -> None:
    exits.put((i, p.wait()))


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float = 60.0,
    out: IO[str] | None = None,
) -> LaunchResult:
    """Run ``num_processes`` local copies of ``command`` as one ``jax.distributed`` job.

    Args:
        command: the program and its arguments.
        num_processes: how many processes (≥ 1).
        devices_per_process: simulated CPU devices each (``None``: the command decides).
        timeout_s: once a process fails, the others must be gone within this bound:
            SIGTERM first, SIGKILL after min(5 s, half the bound). (JAX's distributed
            runtime catches SIGTERM for preemption handling, so a peer blocked in a
            collective often only ends at the SIGKILL.)
        out: where prefixed output goes (default ``sys.stdout``).

    Returns:
        A :class:`LaunchResult`.

    Raises:
        ValueError: an empty command, fewer than 1 process, or a bad device count.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> launch([sys.executable, "-c", "print('hi')"], 2, out=out).returncode
        0
        >>> sorted(out.getvalue().splitlines())  # each line prefixed by its process
        ['[0] hi', '[1] hi']
    """
    if not command:
        raise ValueError("launch: no command given (usage: meshkit launch -n N -- COMMAND)")
    if num_processes < 1:
        raise ValueError(f"launch: -n must be ≥ 1, got {num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"launch: --devices-per-process must be ≥ 1, got {devices_per_process}")
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps = []
    # Exits arrive in the order they happen, so "failed first" is the earliest death.
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    failed: int | None = None
    try:
        for i in range(num_processes):
            env = process_env(os.environ, coordinator, num_processes, i, devices_per_process)
            # A new session per process, so ending one ends its children too.
            p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            for target, args in ((_pump, (p.stdout, f"[{i}] ", out, lock)),
                                 (_watch, (p, i, exits))):
                t = threading.Thread(target=target, args=args, daemon=True)
                t.start()
                if target is _pump:
                    pumps.append(t)
        for _ in range(num_processes):
            i, returncode = exits.get()
            if returncode != 0:
                failed = i
                break
        noticed = time.monotonic()
        if failed is not None:
            _end(procs, grace_s=min(5.0, timeout_s / 2))
        stopped = time.monotonic() - noticed
    except BaseException:
        _end(procs, grace_s=2.0)
        raise
    # Output still in the pipes gets a moment to drain, within the bound.
    drain_until = time.monotonic() + 1.0
    for t in pumps:
        t.join(timeout=max(0.0, drain_until - time.monotonic()))
    if failed is None:
        return LaunchResult(0, None, 0.0)
    code = _code(procs[failed].returncode) or 1
    with lock:
        out.write(
            f"meshkit launch: process {failed} failed first (exit code {code}); "
            f"ended the others in {stopped:.1f} s\n"
        )
        out.flush()
    return LaunchResult(code, failed, stopped)
