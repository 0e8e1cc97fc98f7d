"""``meshkit launch``: run N local processes of one command over ``jax.distributed``.

Each process gets a coordinator on a free 127.0.0.1 port and its id in the environment
(see :mod:`meshkit.runtime.distributed`), and optionally K simulated CPU devices. Their output is
streamed with a ``[i]`` prefix. When any process fails, the others are ended (SIGTERM,
then SIGKILL after a grace period) and the launcher exits with the failed process's code,
naming it, its pid and the signal that killed it (``process 1 (pid 4242) was killed by
SIGKILL first``): a dead peer never leaves the job hanging.

Each process runs in a process group of its own, and the launcher never leaves one behind:

* SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to every group; the processes
  get a grace period (``grace_s``: time to save a checkpoint) before SIGKILL, and a
  second signal ends the grace at once;
* when the processes have exited, whatever they left running in their groups is ended
  too;
* when the launcher itself dies without clean-up (SIGKILL, the OOM killer), a small
  reaper process it started first (:mod:`meshkit.runtime._reaper`, in a session of its
  own, reading a pipe from the launcher) sees the pipe close and SIGKILLs every group.

With ``link_rate`` (``meshkit launch --link-rate 1gbit``) the launch runs inside one
private network namespace, and each process becomes a node with a rate-shaped NIC
(:mod:`meshkit.runtime.link`): this launcher starts a second one, in the namespace, as
its only process, and that one starts the N processes. The guarantees above hold at
both levels (a SIGKILLed outer launcher's reaper kills the inner one, whose own reaper
then kills the processes), and the namespaces end with their last process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO, Any, ClassVar

from meshkit.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, UsageError
from meshkit.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    MAX_SIMULATED_DEVICES,
    set_cpu_device_count,
)
from meshkit.runtime.link import LinkShape, check_available, link_shape, wrap

__all__ = [
    "DEFAULT_GRACE_S",
    "FORWARDED_SIGNALS",
    "CommandNotExecutable",
    "CommandNotFound",
    "LaunchResult",
    "free_port",
    "launch",
    "pass_on_signal",
    "process_env",
]

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals the launcher passes on to every process group (then waits, then SIGKILLs)."""
DEFAULT_GRACE_S = 30.0
"""Seconds the processes get after a forwarded signal before SIGKILL: enough to save a
checkpoint (schedulers such as SLURM allow 30 s or more between SIGTERM and SIGKILL)."""
_POLL_S = 0.05
_log = logging.getLogger(__name__)


class CommandNotFound(UsageError):
    """The command to launch does not exist (exit code 127, as a shell)."""

    exit_code: ClassVar[int] = EXIT_NOT_FOUND


class CommandNotExecutable(UsageError):
    """The command to launch exists but cannot be run (exit code 126, as a shell)."""

    exit_code: ClassVar[int] = EXIT_NOT_EXECUTABLE


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Returns:
        The port number.

    Examples:
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

    Examples:
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
            After a forwarded signal: the processes' common exit code if they all
            exited by themselves with the same nonzero code (e.g. 4, preempted), else
            128 + the signal.
        failed: the id of the process that failed first, or ``None``.
        seconds_to_stop: seconds from noticing the failure (or the signal) to every
            process gone.
        signal: the signal the launcher received and forwarded, or ``None``.
    """

    returncode: int
    failed: int | None
    seconds_to_stop: float
    signal: int | None = None


def pass_on_signal(result: LaunchResult) -> None:
    """After a launch that a signal stopped, let the signal act on this process too.

    A program that launches workers itself (``meshkit calibrate``, ``meshkit bench moe``)
    has lent its signals to :func:`launch`, which forwarded one and ended the workers;
    their tracebacks are no news. Raised here again, the signal reaches the program's
    own handler (one line and 129, 130 or 143 in a ``meshkit`` command), as if it had
    come after the launch.

    Args:
        result: what :func:`launch` returned.

    Raises:
        KeyboardInterrupt: the signal's handler neither raised nor ended the process.

    Examples:
        >>> pass_on_signal(LaunchResult(0, None, 0.0))  # no signal: nothing happens
    """
    if result.signal is not None:
        signal.raise_signal(result.signal)
        raise KeyboardInterrupt


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _how_it_ended(returncode: int) -> str:
    """``failed``, or ``was killed by SIGKILL`` for a process a signal ended."""
    if returncode >= 0:
        return "failed"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    # The group outlives its leader when the leader exits first: signal it regardless.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _group_alive(p: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(p.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class _Signals:
    """Catches the forwarded signals while the launcher runs (main thread only).

    The handler only records: the launcher's loops poll :attr:`received`, so no
    exception can land in the middle of starting a process and lose track of it. A
    second signal sets :attr:`hurry`: the grace period ends at once.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.hurry = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.hurry = True


def _end(
    procs: Sequence[subprocess.Popen[bytes]],
    grace_s: float,
    sig: int = signal.SIGTERM,
    signals: _Signals | None = None,
) -> bool:
    """Send ``sig`` to every group, wait up to ``grace_s``, then SIGKILL what is left.

    Returns:
        Whether any process had to be killed (had not exited within the grace period).
    """
    for p in procs:
        _signal_group(p, sig)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if signals is not None and signals.hurry:
            break
        time.sleep(_POLL_S)
    killed = any(p.poll() is None for p in procs)
    for p in procs:
        # Also ends what a process left behind in its group after it exited.
        _signal_group(p, signal.SIGKILL)
        p.wait()
    return killed


def _end_leftovers(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """End what exited processes left running in their groups (no orphans)."""
    left = [p for p in procs if _group_alive(p)]
    if left:
        _end(left, grace_s=1.0)


def _check_command(command: Sequence[str]) -> None:
    """Fail as a shell would, before starting anything: 127 not found, 126 not runnable."""
    program = command[0]
    if os.sep in program:
        candidates = [program]
    else:
        candidates = [os.path.join(d or ".", program)
                      for d in os.environ.get("PATH", os.defpath).split(os.pathsep)]
    found = [c for c in candidates if os.path.exists(c)]
    runnable = [c for c in found if os.path.isfile(c) and os.access(c, os.X_OK)]
    if runnable:
        return
    if not found:
        raise CommandNotFound(f"command not found: {program}")
    what = "is a directory" if os.path.isdir(found[0]) else "is not executable"
    raise CommandNotExecutable(f"cannot run {program}: {found[0]} {what}")


def _check_seconds(value: float, flag: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 0):
        raise UsageError(f"launch: {flag} must be a positive number of seconds, got {value!r}")
    return float(value)


_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")


class _Reaper:
    """The launcher's side of :mod:`meshkit.runtime._reaper`: names each group to it.

    If the reaper cannot start or dies, the launch goes on without it (a warning in
    the log): it only matters if the launcher is killed too.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        try:
            # -I -S: the standard library only, nothing from the user's environment.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _REAPER], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                start_new_session=True)
        except OSError as e:
            _log.warning(f"meshkit launch: no reaper ({e}); if the launcher is killed, its "
                         "processes may outlive it")

    def _tell(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except OSError:  # BrokenPipeError included: the reaper is gone
            _log.warning("meshkit launch: the reaper is gone; if the launcher is killed, "
                         "its processes may outlive it")
            self._proc = None

    def watch(self, pgid: int) -> None:
        """Have the reaper SIGKILL group ``pgid`` if the launcher dies."""
        self._tell(f"+{pgid}")

    def release(self, *, kill: bool) -> None:
        """End the reaper: quietly, or (``kill``) after it SIGKILLs every group named."""
        if self._proc is None:
            return
        if not kill:
            self._tell("done")
        proc, self._proc = self._proc, None
        if proc is None:  # _tell found it gone
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _watch(p: subprocess.Popen[bytes], i: int, exits: queue.Queue[tuple[int, int]]) -> None:
    exits.put((i, p.wait()))


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float = 60.0,
    grace_s: float = DEFAULT_GRACE_S,
    out: IO[str] | None = None,
    link_rate: str | None = None,
    link_burst: str | None = None,
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
        grace_s: when the launcher receives SIGTERM, SIGINT or SIGHUP (in the main
            thread), it forwards the signal to every process group and SIGKILLs what is
            left after this many seconds (at once on a second signal).
        out: where prefixed output goes (default ``sys.stdout``).
        link_rate: run the whole launch in a network namespace whose loopback, the link
            between the processes, is shaped to this rate (``1gbit``;
            :mod:`meshkit.runtime.link`). Needs ≥ 2 processes.
        link_burst: the shaped link's bucket (``512kb``; default
            :func:`meshkit.runtime.link.link_shape`'s); only with ``link_rate``.

    Returns:
        A :class:`LaunchResult`.

    Raises:
        UsageError: an empty command, fewer than 1 process, a device count outside
            1..MAX_SIMULATED_DEVICES, or a ``timeout_s`` or ``grace_s`` that is not a
            positive number (all ``ValueError``); a malformed ``link_rate`` or
            ``link_burst``, a burst without a rate, or a rate with one process.
        LinkUnavailable: a ``link_rate`` where this machine cannot shape a link (no
            namespaces for this user, no ``tc``; a ``UsageError`` naming which).
        CommandNotFound: no such command (exit code 127).
        CommandNotExecutable: the command is a directory or not executable (126).

    Examples:
        >>> import io
        >>> out = io.StringIO()
        >>> launch([sys.executable, "-c", "print('hi')"], 2, out=out).returncode
        0
        >>> sorted(out.getvalue().splitlines())  # each line prefixed by its process
        ['[0] hi', '[1] hi']
    """
    if not command:
        raise UsageError("launch: no command given (usage: meshkit launch -n N -- COMMAND)")
    if num_processes < 1:
        raise UsageError(f"launch: -n must be ≥ 1, got {num_processes}")
    if devices_per_process is not None and not 1 <= devices_per_process <= MAX_SIMULATED_DEVICES:
        raise UsageError(f"launch: --devices-per-process must be in 1..{MAX_SIMULATED_DEVICES}, "
                         f"got {devices_per_process}")
    timeout_s = _check_seconds(timeout_s, "--timeout")
    grace_s = _check_seconds(grace_s, "--grace")
    shape = _link(link_rate, link_burst, num_processes)
    _check_command(command)
    out = out or sys.stdout
    if shape is not None:
        return _launch_shaped(command, num_processes, shape,
                              devices_per_process=devices_per_process, timeout_s=timeout_s,
                              grace_s=grace_s, out=out)
    with _Signals() as signals:
        return _run(command, num_processes, devices_per_process=devices_per_process,
                    timeout_s=timeout_s, grace_s=grace_s, out=out, signals=signals)


def _link(rate: str | None, burst: str | None, num_processes: int) -> LinkShape | None:
    """The checked link shape, or ``None``; the machine is probed last (the slow part)."""
    if rate is None:
        if burst is not None:
            raise UsageError("launch: --link-burst needs --link-rate")
        return None
    shape = link_shape(rate, burst)
    if num_processes < 2:
        raise UsageError(f"launch: --link-rate shapes the link between processes; it needs "
                         f"-n 2 or more, got -n {num_processes}")
    check_available()
    return shape


def _launch_shaped(
    command: Sequence[str], num_processes: int, shape: LinkShape, *,
    devices_per_process: int | None, timeout_s: float, grace_s: float, out: IO[str],
) -> LaunchResult:
    """Run an inner launcher of ``command`` in a shaped namespace, as the only process."""
    inner = [sys.executable, "-m", "meshkit.cli", "launch", "-n", str(num_processes),
             "--timeout", repr(timeout_s), "--grace", repr(grace_s)]
    if devices_per_process is not None:
        inner += ["--devices-per-process", str(devices_per_process)]
    node = [sys.executable, "-m", "meshkit.runtime.link", "--node", "--"]
    # The inner launcher reports failures and signals itself; its output and exit code
    # pass through unchanged. It gets its grace period and a little more before SIGKILL.
    with _Signals() as signals:
        return _run(wrap([*inner, "--", *node, *command], shape), 1, devices_per_process=None,
                    timeout_s=timeout_s + grace_s, grace_s=grace_s + 5.0, out=out,
                    signals=signals, relay=True)


def _run(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None,
    timeout_s: float,
    grace_s: float,
    out: IO[str],
    signals: _Signals,
    relay: bool = False,
) -> LaunchResult:
    procs: list[subprocess.Popen[bytes]] = []
    reaper = _Reaper()  # first: no process may start without it watching
    try:
        return _supervise(command, num_processes, devices_per_process=devices_per_process,
                          timeout_s=timeout_s, grace_s=grace_s, out=out, signals=signals,
                          procs=procs, reaper=reaper, relay=relay)
    finally:
        # Every path ends the groups first; should one still be alive (an error while
        # ending them), the reaper kills it.
        reaper.release(kill=any(_group_alive(p) for p in procs))


def _supervise(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None,
    timeout_s: float,
    grace_s: float,
    out: IO[str],
    signals: _Signals,
    procs: list[subprocess.Popen[bytes]],
    reaper: _Reaper,
    relay: bool = False,
) -> LaunchResult:
    """Start the processes (into ``procs``), wait for the first failure, end them all.

    ``relay``: the one process is an inner launcher; pass its output and exit code on
    without prefixes or a report of our own (it makes its own).
    """
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    pumps = []
    # Exits arrive in the order they happen, so "failed first" is the earliest death.
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    failed: int | None = None
    exited = 0
    try:
        for i in range(num_processes):
            if signals.received is not None:
                break
            env = process_env(os.environ, coordinator, num_processes, i, devices_per_process)
            # A new session per process, so ending one ends its children too.
            try:
                p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:  # e.g. a script without a #! line
                raise CommandNotExecutable(f"cannot run {command[0]}: {e.strerror}") from None
            procs.append(p)
            reaper.watch(p.pid)  # a session leader: its pid is its group's id
            prefix = "" if relay else f"[{i}] "
            for target, args in ((_pump, (p.stdout, prefix, out, lock)),
                                 (_watch, (p, i, exits))):
                t = threading.Thread(target=target, args=args, daemon=True)
                t.start()
                if target is _pump:
                    pumps.append(t)
        while exited < len(procs) and signals.received is None:
            try:
                i, returncode = exits.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            exited += 1
            if returncode != 0:
                failed = i
                break
        noticed = time.monotonic()
        if signals.received is not None:
            return _forward(signals, procs, pumps, grace_s=grace_s, out=out, lock=lock,
                            relay=relay)
        if failed is not None:
            _end(procs, grace_s=min(5.0, timeout_s / 2))
        else:
            _end_leftovers(procs)
        stopped = time.monotonic() - noticed
    except BaseException:
        _end(procs, grace_s=2.0)
        raise
    _drain(pumps)
    if failed is None:
        return LaunchResult(0, None, 0.0)
    returncode = procs[failed].returncode
    code = _code(returncode) or 1
    if relay:
        return LaunchResult(code, None, stopped)
    with lock:
        out.write(
            f"meshkit launch: process {failed} (pid {procs[failed].pid}) "
            f"{_how_it_ended(returncode)} first (exit code {code}); ended the others in "
            f"{stopped:.1f} s\n"
        )
        out.flush()
    return LaunchResult(code, failed, stopped)


def _drain(pumps: Sequence[threading.Thread]) -> None:
    """Give output still in the pipes a moment to arrive, within a bound."""
    drain_until = time.monotonic() + 1.0
    for t in pumps:
        t.join(timeout=max(0.0, drain_until - time.monotonic()))


def _forward(
    signals: _Signals,
    procs: Sequence[subprocess.Popen[bytes]],
    pumps: Sequence[threading.Thread],
    *,
    grace_s: float,
    out: IO[str],
    lock: threading.Lock,
    relay: bool = False,
) -> LaunchResult:
    """Pass the launcher's signal on to every group, wait the grace period, report."""
    sig = signals.received
    assert sig is not None
    start = time.monotonic()
    killed = _end(procs, grace_s=grace_s, sig=sig, signals=signals)
    stopped = time.monotonic() - start
    _drain(pumps)
    codes = {_code(p.returncode) for p in procs}
    # Processes that stopped cleanly on the signal with one code (4: preempted, saved)
    # speak for the job; otherwise report the signal, as a shell would.
    code = codes.pop() if not killed and len(codes) == 1 and 0 not in codes else 128 + sig
    if relay:
        return LaunchResult(code, None, stopped, signal=sig)
    name = signal.Signals(sig).name
    how = (f"killed what was left after {grace_s:g} s" if killed
           else f"all ended in {stopped:.1f} s")
    with lock:
        out.write(f"meshkit launch: got {name}; forwarded it to {len(procs)} processes, "
                  f"{how} (exit code {code})\n")
        out.flush()
    return LaunchResult(code, None, stopped, signal=sig)
