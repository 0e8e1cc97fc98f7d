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

import errno
import os
import socket
from collections.abc import Mapping, MutableMapping

from meshkit.errors import UsageError

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "MAX_SIMULATED_DEVICES",
    "check_coordinator_port",
    "initialize",
    "launcher_env",
    "num_processes_from_env",
    "set_cpu_device_count",
]

MAX_SIMULATED_DEVICES = 1024
"""The most CPU devices meshkit asks XLA to simulate in one process: 1024 start in about
a second, 16384 take minutes and gigabytes."""
ENV_COORDINATOR = "MESHKIT_COORDINATOR"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"

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

    Example:
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


def launcher_env(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """The launcher's ``(coordinator, num_processes, process_id)``, if set.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The triple, or ``None`` when the launcher's variables are absent.

    Raises:
        UsageError: variables present but incomplete or malformed (the variable named).

    Example:
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
    return env[ENV_COORDINATOR], num, pid


def num_processes_from_env(env: Mapping[str, str] | None = None) -> int:
    """How many processes the job will have, read before JAX starts.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The launcher's or the cluster's process count; 1 if neither is known.

    Raises:
        UsageError: malformed launcher variables, or a cluster's process count that is
            not a positive integer (e.g. ``SLURM_NTASKS=0``).

    Example:
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

    Example:
        >>> try:
        ...     check_coordinator_port("127.0.0.1:0")
        ... except ValueError as e:
        ...     print(e)
        MESHKIT_COORDINATOR='127.0.0.1:0': the port must be a number in 1..65535
    """
    port_text = coordinator.rsplit(":", 1)[-1]
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else 0
    if not 1 <= port <= 65535:
        raise UsageError(f"{ENV_COORDINATOR}={coordinator!r}: the port must be a number in "
                         "1..65535")
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


def initialize() -> int:
    """Join the multi-process job this process belongs to, if any (idempotent).

    Returns:
        The number of processes in the job.

    Raises:
        UsageError: malformed launcher or cluster variables, or (process 0) a
            coordinator port already in use here.
        RuntimeError: from ``jax.distributed.initialize`` when the coordinator cannot be
            reached within its timeout.

    Example:
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
    if launched:
        coordinator, num, pid = launched
        if pid == 0:  # the coordinator's process: its port must be free
            check_coordinator_port(coordinator)
        # A short heartbeat timeout: if a peer dies the others fail instead of hanging.
        jax.distributed.initialize(
            coordinator, num, pid, initialization_timeout=120, heartbeat_timeout_seconds=20
        )
    else:
        jax.distributed.initialize()
    return jax.process_count()
