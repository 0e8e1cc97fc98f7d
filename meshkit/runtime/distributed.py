"""Multi-process start-up over ``jax.distributed``.

``initialize()`` is what ``meshkit train`` calls first and what scripts should call
before touching devices. It picks, in order:

1. **meshkit's launcher** (``meshkit launch``): ``MESHKIT_COORDINATOR``,
   ``MESHKIT_NUM_PROCESSES`` and ``MESHKIT_PROCESS_ID`` in the environment;
2. **a cluster JAX detects itself** (SLURM, Open MPI, Kubernetes with JobSet, ...):
   ``jax.distributed.initialize()`` with no arguments, when such variables are present;
3. **one process**: nothing to do.

On CPU, cross-process collectives go through gloo, which this module selects.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping, MutableMapping

from meshkit.errors import EXIT_USAGE, PeerLost, UsageError

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "ENV_CONNECT_TIMEOUT",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "MAX_RUN_SIMULATED_DEVICES",
    "MAX_SIMULATED_DEVICES",
    "check_coordinator_port",
    "connect_timeout",
    "initialize",
    "launcher_env",
    "num_processes_from_env",
    "peer_lost",
    "set_cpu_device_count",
    "simulate_cpu_devices",
]

MAX_SIMULATED_DEVICES = 2048
"""The most CPU devices meshkit asks XLA to simulate in one process. XLA:CPU (jax 0.10)
compiles no computation over more than 2,048 devices ("Multiprocess computations aren't
implemented on the CPU backend"), though more start: 8,192 in 5 s and 1 GiB, 16,384 in
39 s and 2 GiB."""
MAX_RUN_SIMULATED_DEVICES = 256
"""The most simulated CPU devices ``meshkit train`` runs in one process. XLA:CPU runs each
device on a thread of its own, and a collective waits for all of them: a thread that has
not arrived within 40 s (XLA's ``xla_cpu_collective_call_terminate_timeout_seconds``)
ends the process with an abort (exit 134) and a C++ stack. How many devices arrive in
time depends on the host's cores and the step's work, not on a fixed count. Found by
running ``meshkit train 'mesh.axes={dp: N}' exchange.node_axis=[] exchange.device_axis=[]
train.batch_size=N train.steps=2`` (the default model) on a 2-core host (jax 0.10.2): N
= 256 trains (29 s, 3 GiB, no collective waited even 20 s); 384, 512, 1,024 and 2,048
abort at the first all-reduce (4 to 14 GiB). Compiling alone (``meshkit plan --verify``)
runs nothing, so :data:`MAX_SIMULATED_DEVICES` bounds it instead."""
ENV_COORDINATOR = "MESHKIT_COORDINATOR"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"
ENV_CONNECT_TIMEOUT = "MESHKIT_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 120.0
"""Seconds a process waits to join a multi-process job (``MESHKIT_CONNECT_TIMEOUT``)
before it gives up with one line and exit code 2."""
# JAX's own start-up timeout comes this much later than meshkit's: JAX's ends the
# process with an abort (exit 134) and a C++ stack, meshkit's with one line.
_JAX_TIMEOUT_MARGIN_S = 30

# Variables whose presence means a multi-process job that JAX's own cluster detection
# understands, with the variable that holds the process count (None: not known before
# JAX asks the cluster, so the job is taken to have several processes).
_CLUSTERS = {
    "SLURM_JOB_ID": "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "JOBSET_NAME": None,
}
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def set_cpu_device_count(
    count: int | None, env: MutableMapping[str, str] | None = None, *, replace: bool = False
) -> bool:
    """Ask for ``count`` simulated CPU devices (must run before JAX starts its backend).

    The XLA flag only affects the CPU platform, so setting it is harmless where an
    accelerator is used.

    Args:
        count: devices per process; ``None`` removes the flag (with ``replace``).
        env: the environment to change (default ``os.environ``).
        replace: replace a count the user set; otherwise a user's count (in ``XLA_FLAGS``
            or ``JAX_NUM_CPU_DEVICES``) wins.

    Returns:
        Whether the environment now holds ``count``.

    Raises:
        UsageError: ``count`` below 1, or above :data:`MAX_SIMULATED_DEVICES` when it
            would be set (both ``ValueError``).

    Examples:
        >>> env = {"XLA_FLAGS": "--xla_foo"}
        >>> set_cpu_device_count(4, env), env["XLA_FLAGS"]
        (True, '--xla_foo --xla_force_host_platform_device_count=4')
    """
    if env is None:
        env = os.environ
    if count is not None and count < 1:
        raise UsageError(f"the CPU device count must be ≥ 1, got {count}")
    flags = env.get("XLA_FLAGS", "")
    user_set = _DEVICE_FLAG in flags or "JAX_NUM_CPU_DEVICES" in env
    if user_set and not replace:
        return False
    if count is not None and count > MAX_SIMULATED_DEVICES:
        raise UsageError(
            f"{count:,} devices per process is more than the {MAX_SIMULATED_DEVICES:,} CPU "
            "devices meshkit simulates in one process"
        )
    kept = " ".join(f for f in flags.split() if not f.startswith(_DEVICE_FLAG))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if count is not None:
        kept = f"{kept} {_DEVICE_FLAG}={count}".strip()
    if kept:
        env["XLA_FLAGS"] = kept
    else:
        env.pop("XLA_FLAGS", None)
    return count is not None


def simulate_cpu_devices(
    count: int = 8, *, platforms: str | None = "cpu",
    env: MutableMapping[str, str] | None = None,
) -> None:
    """Run JAX on ``count`` simulated CPU devices: a notebook's or script's first call.

    It only sets environment variables, so it must run before JAX starts its backend
    (the first ``jax.devices()`` or computation; importing JAX is fine). The other
    ``XLA_FLAGS`` stay, and a device count or platform the user set already wins.

    Args:
        count: the devices to simulate (:func:`set_cpu_device_count`).
        platforms: ``JAX_PLATFORMS`` unless it is set already; the default ``"cpu"``
            keeps JAX off any accelerator the machine has. ``None`` leaves it unset:
            JAX then picks its accelerators when there are some.
        env: the environment to change (default ``os.environ``).

    Raises:
        UsageError: ``count`` below 1 or above :data:`MAX_SIMULATED_DEVICES`.

    Example:
        >>> env = {"XLA_FLAGS": "--xla_foo"}
        >>> simulate_cpu_devices(8, env=env)
        >>> env["JAX_PLATFORMS"], env["XLA_FLAGS"]
        ('cpu', '--xla_foo --xla_force_host_platform_device_count=8')
    """
    if env is None:
        env = os.environ
    set_cpu_device_count(count, env)
    if platforms is not None:
        env.setdefault("JAX_PLATFORMS", platforms)


def launcher_env(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """The launcher's ``(coordinator, num_processes, process_id)``, if set.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The triple, or ``None`` when the launcher's variables are absent.

    Raises:
        UsageError: variables present but incomplete or malformed (the variable named).

    Examples:
        >>> launcher_env({"MESHKIT_COORDINATOR": "127.0.0.1:1234",
        ...               "MESHKIT_NUM_PROCESSES": "2", "MESHKIT_PROCESS_ID": "1"})
        ('127.0.0.1:1234', 2, 1)
    """
    env = os.environ if env is None else env
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [n for n in names if n in env]
    if not present:
        return None
    missing = [n for n in names if n not in env]
    if missing:
        raise UsageError(f"launcher environment incomplete: {missing} unset, {present} set")
    values = []
    for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        try:
            values.append(int(env[name]))
        except ValueError:
            raise UsageError(f"{name}={env[name]!r} is not an integer") from None
    num, pid = values
    if num < 1:
        raise UsageError(f"{ENV_NUM_PROCESSES}={num} must be >= 1")
    if not 0 <= pid < num:
        raise UsageError(f"{ENV_PROCESS_ID}={pid} out of range for {ENV_NUM_PROCESSES}={num}")
    coordinator = env[ENV_COORDINATOR]
    host, colon, _ = coordinator.rpartition(":")
    if not (colon and host.strip("[]")):  # JAX would fail on it with a traceback
        raise UsageError(f"{ENV_COORDINATOR}={coordinator!r}: must be HOST:PORT "
                         "(e.g. 127.0.0.1:1234)")
    _port(coordinator)
    return coordinator, num, pid


def num_processes_from_env(env: Mapping[str, str] | None = None) -> int:
    """How many processes the job will have, read before JAX starts.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The launcher's or the cluster's process count; 1 if neither is known.

    Raises:
        UsageError: malformed launcher variables, or a cluster's process count that is
            not a positive integer (e.g. ``SLURM_NTASKS=0``).

    Examples:
        >>> num_processes_from_env({})
        1
    """
    env = os.environ if env is None else env
    launched = launcher_env(env)
    if launched:
        return launched[1]
    for marker, count in _CLUSTERS.items():
        if marker in env and count and count in env:
            value = env[count].strip()
            if not (value.isascii() and value.isdigit() and int(value) >= 1):
                raise UsageError(
                    f"{count}={env[count]!r} (with {marker} set) is not a positive process count"
                )
            return int(value)
    return 1


def _in_cluster(env: Mapping[str, str]) -> bool:
    """Whether the environment describes a multi-process cluster job."""
    for marker, count in _CLUSTERS.items():
        value = env.get(count, "") if count else ""
        if marker in env and (count is None or (value.isdigit() and int(value) > 1)):
            return True
    return False


def _port(coordinator: str) -> int:
    """The port of ``host:port``; a :class:`UsageError` naming the variable if it is not
    a number in 1..65535."""
    port_text = coordinator.rsplit(":", 1)[-1]
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else 0
    if not 1 <= port <= 65535:
        raise UsageError(f"{ENV_COORDINATOR}={coordinator!r}: the port must be a number in "
                         "1..65535")
    return port


def check_coordinator_port(coordinator: str) -> None:
    """Fail if process 0 cannot start the coordinator: its port is taken here.

    Process 0 runs the coordinator, listening on the port of ``coordinator`` on every
    interface. Started on a port in use, JAX's gRPC server crashes the process (exit
    139, one log line of gRPC's); this check names the port instead.

    Args:
        coordinator: ``host:port`` (``[v6]:port`` too).

    Raises:
        UsageError: the port is not a number in 1..65535, or something on this machine
            already listens on it (exit code 2).

    Examples:
        >>> try:
        ...     check_coordinator_port("127.0.0.1:0")
        ... except ValueError as e:
        ...     print(e)
        MESHKIT_COORDINATOR='127.0.0.1:0': the port must be a number in 1..65535
    """
    port = _port(coordinator)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is free to listen on;
        # a socket listening on it (on any address) still makes the bind fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UsageError(
                f"{ENV_COORDINATOR}={coordinator!r}: port {port} is already in use on this "
                "machine, so process 0 cannot start the coordinator there; choose a free port "
                "(meshkit launch picks one itself)") from None


def connect_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for a multi-process job to form (``MESHKIT_CONNECT_TIMEOUT``).

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The variable's value, or :data:`DEFAULT_CONNECT_TIMEOUT_S` when it is unset.

    Raises:
        UsageError: a value that is not a positive, finite number of seconds.

    Examples:
        >>> connect_timeout({"MESHKIT_CONNECT_TIMEOUT": "15"})
        15.0
    """
    env = os.environ if env is None else env
    text = env.get(ENV_CONNECT_TIMEOUT)
    if text is None:
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise UsageError(f"{ENV_CONNECT_TIMEOUT}={text!r}: must be a number of seconds in "
                         "(0, 86400]")
    return value


def _reachable(coordinator: str) -> bool:
    host, _, port = coordinator.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


class _JoinWatchdog:
    """Ends the process with one line (exit 2) if the job has not formed in time.

    ``jax.distributed.initialize`` blocks in C++ and, at its own timeout, aborts the
    process (exit 134, a C++ stack); it releases the GIL while it waits, so a thread can
    end the process first with a message that says what to check.
    """

    def __init__(self, *, prog: str, coordinator: str | None, num: int | None,
                 pid: int | None, timeout_s: float) -> None:
        self._prog, self._coordinator = prog, coordinator
        self._num, self._pid, self._timeout_s = num, pid, timeout_s
        self._done = threading.Event()

    def __enter__(self) -> _JoinWatchdog:
        threading.Thread(target=self._watch, daemon=True, name="meshkit-join").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self._timeout_s):
            return
        job = f"the {self._num}-process job" if self._num else "the multi-process job"
        me = f"process {self._pid}" if self._pid is not None else "this process"
        if self._coordinator is None:
            why = "the cluster's coordinator did not answer, or not every process started"
        elif self._pid != 0 and not _reachable(self._coordinator):
            why = f"nothing answers at the coordinator {ENV_COORDINATOR}={self._coordinator}"
        else:
            why = (f"the coordinator {ENV_COORDINATOR}={self._coordinator} answers, but not "
                   "every process joined")
        line = (f"{self._prog}: error: {me} could not join {job} within "
                f"{self._timeout_s:g} s ({ENV_CONNECT_TIMEOUT}): {why}\n")
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(EXIT_USAGE)


# What the runtime says when the other end of a cross-process collective has gone: gloo's
# TCP transport ("Connection reset by peer", "Connection closed by peer") and the
# coordination service ("heartbeat", "Socket closed").
_PEER_GONE = re.compile(
    r"(Connection (?:reset|closed) by peer|Broken pipe|Socket closed|heartbeat timeout"
    r"|stopped sending heartbeats|Gloo [\w-]+ failed: .*Timed out)", re.IGNORECASE)


def peer_lost(error: BaseException) -> PeerLost | None:
    """The :class:`~meshkit.errors.PeerLost` that ``error`` means, if it means one.

    Only in a multi-process job (``jax.distributed`` started here): a collective whose
    connection to another process was reset or closed, anywhere in the exception's chain
    (an error in a clean-up keeps the original as its context).

    Args:
        error: an exception that ended a command.

    Returns:
        A one-line error naming this process and the runtime's reason, or ``None``.

    Examples:
        >>> peer_lost(ValueError("Connection reset by peer")) is None  # one process here
        True
    """
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        found = _PEER_GONE.search(text)
        if found:
            first = text.strip().splitlines()[0] if text.strip() else found.group(0)
            what = first if len(first) <= 200 else first[:200] + "…"
            return PeerLost(
                f"process {jax.process_index()} of {jax.process_count()} lost another process "
                f"of the job ({what}); the launcher's or the scheduler's log names the one "
                "that ended first")
        current = current.__cause__ or current.__context__
    return None


def initialize(*, prog: str = "meshkit") -> int:
    """Join the multi-process job this process belongs to, if any (idempotent).

    A job that has not formed within ``MESHKIT_CONNECT_TIMEOUT`` seconds (default
    :data:`DEFAULT_CONNECT_TIMEOUT_S`: a coordinator nobody listens at, a process that
    never started) ends this process with one line naming the coordinator as
    ``MESHKIT_COORDINATOR=HOST:PORT``, exit code 2.

    Args:
        prog: the program named in that line (``meshkit train``).

    Returns:
        The number of processes in the job.

    Raises:
        UsageError: malformed launcher or cluster variables or ``MESHKIT_CONNECT_TIMEOUT``,
            or (process 0) a coordinator port already in use here.

    Examples:
        >>> from meshkit.runtime.distributed import initialize
        >>> initialize()  # one process: a no-op
        1
    """
    import jax

    launched = launcher_env()
    cluster = launched is None and _in_cluster(os.environ)
    single = (launched is None and not cluster) or (launched is not None and launched[1] == 1)
    if single or jax.distributed.is_initialized():
        return jax.process_count()
    # gloo is JAX 0.10's default for CPU collectives; set it so a changed default
    # cannot leave CPU processes unable to reach each other.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout_s = connect_timeout()
    jax_timeout = math.ceil(timeout_s) + _JAX_TIMEOUT_MARGIN_S
    if launched:
        coordinator, num, pid = launched
        if pid == 0:  # the coordinator's process: its port must be free
            check_coordinator_port(coordinator)
        with _JoinWatchdog(prog=prog, coordinator=coordinator, num=num, pid=pid,
                           timeout_s=timeout_s):
            # A short heartbeat timeout: if a peer dies the others fail instead of hanging.
            jax.distributed.initialize(coordinator, num, pid,
                                       initialization_timeout=jax_timeout,
                                       heartbeat_timeout_seconds=20)
    else:
        with _JoinWatchdog(prog=prog, coordinator=None, num=None, pid=None,
                           timeout_s=timeout_s):
            jax.distributed.initialize(initialization_timeout=jax_timeout)
    return jax.process_count()
