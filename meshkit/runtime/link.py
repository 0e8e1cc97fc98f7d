"""A cluster's inter-node link on one machine: each process a node with its own network
namespace and a rate-shaped NIC.

``meshkit launch --link-rate 1gbit`` starts its whole job inside a private network
namespace made by ``unshare -rn`` (a user namespace: no root needed), the "switch": a
bridge. Each process then becomes a node (:func:`node_main`, before it runs the command):
a network namespace of its own, whose loopback carries the traffic inside the process,
and a virtual NIC (a ``veth`` pair, its other end on the bridge) with the address
``10.77.0.<process id + 1>`` and a token-bucket qdisc (``tc`` ``tbf``) at the rate on its
way out. The host name of the node is its address, so JAX's CPU collectives (gloo, which
binds the host name's address) send between processes through the shaped NICs and
between the devices of one process over its own, unshaped loopback. (With one shared
loopback they cannot be told apart: gloo moves even a process's own devices' pieces
over TCP, so every byte would be shaped.) The namespaces end with their last process:
nothing is left behind, however the launch ends.

What to expect of the link (measure it with ``meshkit calibrate --link-rate``):

* the NIC is full-duplex, as a real one: each node sends at the rate and receives at
  the rate; the M devices of a node share it, ``rate / M`` each when all send at once;
* the bucket lets ``burst`` bytes through at once after an idle spell, so small
  messages barely see the rate;
* ``netem`` (added delay) is not on every kernel: the link's latency is TCP's through
  the bridge plus the collectives' own, not a chosen one.

Examples:
    >>> shape = link_shape("1gbit")
    >>> shape.rate_bps, shape.burst
    (1000000000.0, '256kb')
    >>> wrap(["python", "job.py"], shape)[:2]
    ['unshare', '-rn']
    >>> node_address(1)
    '10.77.0.2'
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from meshkit.choices import LINK_BURST_UNITS, LINK_RATE_UNITS
from meshkit.errors import UsageError

__all__ = [
    "ENV_LINK_BURST",
    "ENV_LINK_RATE",
    "LinkShape",
    "LinkUnavailable",
    "check_available",
    "link_shape",
    "node_address",
    "node_main",
    "parse_burst",
    "parse_rate",
    "reshape",
    "wrap",
]

#: Set in the shaped job's environment: the link's rate and burst as ``tc`` spells them.
ENV_LINK_RATE = "MESHKIT_LINK_RATE"
ENV_LINK_BURST = "MESHKIT_LINK_BURST"
#: Set in each node's environment: its shaped NIC (for :func:`reshape` and byte counts).
ENV_LINK_DEVICE = "MESHKIT_LINK_DEVICE"
_BRIDGE = "mkbr0"
_SUBNET = "10.77.0"
_MAX_NODES = 250  # addresses .1 .. .250 of the subnet
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000

_RATE_FACTORS = dict(zip(LINK_RATE_UNITS, (1e3, 1e6, 1e9, 1e12), strict=True))
_BURST_FACTORS = dict(zip(LINK_BURST_UNITS, (1, 1024, 1024**2), strict=True))
_MIN_RATE_BPS, _MAX_RATE_BPS = 1e6, 1e12
# tbf drops a packet larger than its bucket, and loopback packets reach 64 KiB (its
# MTU) plus headers: a smaller burst would drop every large segment.
_MIN_BURST, _MAX_BURST = 128 * 1024, 1024**3
_DEFAULT_BURST = 256 * 1024
# The queue tbf keeps before it drops (tc's `latency`): long, so that a burst of
# all-to-all traffic waits instead of being dropped and retransmitted.
_QUEUE_LATENCY = "100ms"
_NUMBER = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([a-z]+)")


class LinkUnavailable(UsageError):
    """This machine cannot shape a link: no namespaces for this user, or no ``tc``/``tbf``."""


def _parse(text: object, flag: str, factors: Mapping[str, float], example: str) -> float:
    match = _NUMBER.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None or match.group(2) not in factors:
        raise UsageError(f"{flag}: {text!r} is not a number and a unit of "
                         f"{', '.join(factors)} (e.g. {example})")
    return float(match.group(1)) * factors[match.group(2)]


def parse_rate(text: str) -> float:
    """A link rate as ``tc`` writes it (``250mbit``, ``1gbit``), in bits per second.

    Args:
        text: a number and a unit of :data:`meshkit.choices.LINK_RATE_UNITS`.

    Returns:
        Bits per second.

    Raises:
        UsageError: not a number and a known unit, or outside 1 Mbit/s .. 1 Tbit/s.

    Examples:
        >>> parse_rate("2.5gbit")
        2500000000.0
    """
    bps = _parse(text, "--link-rate", _RATE_FACTORS, "1gbit, 250mbit")
    if not _MIN_RATE_BPS <= bps <= _MAX_RATE_BPS:
        raise UsageError(f"--link-rate: {text!r} is outside 1mbit .. 1tbit")
    return bps


def parse_burst(text: str) -> int:
    """A bucket size as ``tc`` writes it (``256kb``, ``1mb``), in bytes.

    Args:
        text: a number and a unit of :data:`meshkit.choices.LINK_BURST_UNITS`.

    Returns:
        Bytes.

    Raises:
        UsageError: not a number and a known unit, or outside 128kb .. 1024mb (a bucket
            smaller than a loopback packet drops every large one).

    Examples:
        >>> parse_burst("1mb")
        1048576
    """
    size = int(_parse(text, "--link-burst", _BURST_FACTORS, "256kb, 1mb"))
    if not _MIN_BURST <= size <= _MAX_BURST:
        raise UsageError(f"--link-burst: {text!r} is outside 128kb .. 1024mb (tbf drops a "
                         "loopback packet larger than its bucket)")
    return size


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """A shaped loopback: its rate and bucket, as given and in numbers.

    Attributes:
        rate: the rate as ``tc`` spells it (``1gbit``).
        burst: the bucket as ``tc`` spells it (``256kb``).
        rate_bps: bits per second.
        burst_bytes: bytes.
    """

    rate: str
    burst: str
    rate_bps: float
    burst_bytes: int

    @property
    def bytes_per_s(self) -> float:
        """The rate in bytes per second (all directions together)."""
        return self.rate_bps / 8


def link_shape(rate: str, burst: str | None = None) -> LinkShape:
    """Check a rate (and burst) and pair them.

    Args:
        rate: e.g. ``1gbit`` (:func:`parse_rate`).
        burst: e.g. ``512kb`` (:func:`parse_burst`); default 256 KiB, or one millisecond
            of the rate where that is more (a bucket drained in well under tbf's timer
            tick would cap the rate below the one asked for).

    Returns:
        The shape.

    Raises:
        UsageError: a malformed or out-of-range rate or burst (the message names which).

    Examples:
        >>> link_shape("10gbit").burst
        '1221kb'
    """
    rate_bps = parse_rate(rate)
    if burst is None:
        size = max(_DEFAULT_BURST, int(rate_bps / 8 * 1e-3))
        burst = f"{-(-size // 1024)}kb"
    burst_bytes = parse_burst(burst)
    return LinkShape(rate=rate.strip().lower(), burst=burst.strip().lower(), rate_bps=rate_bps,
                     burst_bytes=burst_bytes)


def _tbf(shape: LinkShape) -> str:
    return f"tbf rate {shape.rate} burst {shape.burst} latency {_QUEUE_LATENCY}"


def wrap(command: Sequence[str], shape: LinkShape) -> list[str]:
    """``command`` run inside a new network namespace holding the nodes' bridge.

    The shell brings the namespace's loopback and bridge up and ``exec``\\ s the command
    (same process: signals reach it, and its exit is the namespace's end). The command
    (the launcher) runs each process through :func:`node_main`, which adds the node.

    Args:
        command: the program and its arguments.
        shape: the link.

    Returns:
        The wrapped command line.

    Examples:
        >>> wrap(["true"], link_shape("1gbit"))[7]
        'ip link set lo up && ip link add mkbr0 type bridge && ip link set mkbr0 up && exec "$@"'
    """
    script = (f"ip link set lo up && ip link add {_BRIDGE} type bridge && "
              f'ip link set {_BRIDGE} up && exec "$@"')
    return ["unshare", "-rn", "env", f"{ENV_LINK_RATE}={shape.rate}",
            f"{ENV_LINK_BURST}={shape.burst}", "sh", "-c", script, "meshkit-link", *command]


def reshape(shape: LinkShape | None) -> None:
    """Change the running namespace's link to ``shape`` (``None``: unshaped).

    For benchmarks that time one compiled program at several rates: call it in every
    process of a shaped launch (each node shapes what it sends), between timings.

    Args:
        shape: the new link, or ``None`` to remove the qdisc.

    Raises:
        LinkUnavailable: ``tc`` refused (e.g. not inside a shaped namespace).
    """
    device = os.environ.get(ENV_LINK_DEVICE, "lo")
    if shape is None:
        args = ["tc", "qdisc", "del", "dev", device, "root"]
    else:
        args = ["tc", "qdisc", "replace", "dev", device, "root", *_tbf(shape).split()]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    # Removing a qdisc that is not there is no error; a refusal is.
    if done.returncode and (shape is not None or "not permitted" in done.stderr):
        raise LinkUnavailable(f"tc could not change the link: {_first_line(done.stderr)}")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def check_available(env: Mapping[str, str] | None = None) -> None:
    """Fail in one line unless this machine can run :func:`wrap`'s command.

    Checks, in order: ``unshare``, ``ip`` and ``tc`` on the ``PATH``; that this user may
    make a user and network namespace (``unshare -rn``); that ``tc`` can add a ``tbf``
    qdisc there. The probe's namespace ends with it.

    Args:
        env: the environment whose ``PATH`` is searched (default ``os.environ``).

    Raises:
        LinkUnavailable: naming what is missing (exit code 2 from the CLI).
    """
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    for program, why in (("unshare", "to make a network namespace (util-linux)"),
                         ("ip", "to bring the namespace's loopback up (iproute2)"),
                         ("tc", "to shape the loopback (iproute2)")):
        if shutil.which(program, path=path) is None:
            raise LinkUnavailable(f"--link-rate needs {program} {why}; it is not on the PATH")

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["unshare", "-rn", *args], capture_output=True, text=True,
                              env=dict(env), timeout=30, check=False)

    done = probe("true")
    if done.returncode:
        raise LinkUnavailable("--link-rate: no permission for network namespaces here "
                              f"(unshare -rn: {_first_line(done.stderr)}); user namespaces "
                              "may be disabled (sysctl user.max_user_namespaces, or "
                              "kernel.unprivileged_userns_clone)")
    done = probe("sh", "-c", f"ip link add {_BRIDGE} type bridge && ip link add mkn0 type "
                 "veth peer name mkh0")
    if done.returncode:
        raise LinkUnavailable("--link-rate: ip cannot add a bridge and a veth pair in a "
                              f"network namespace here ({_first_line(done.stderr)}); the "
                              "kernel may lack the bridge or veth driver")
    done = probe("sh", "-c", f"ip link set lo up && tc qdisc add dev lo root "
                 f"{_tbf(link_shape('1gbit'))}")
    if done.returncode:
        raise LinkUnavailable("--link-rate: tc cannot add a tbf qdisc in a network namespace "
                              f"here ({_first_line(done.stderr)}); the kernel may lack "
                              "sch_tbf")


def node_address(process_id: int) -> str:
    """The address of process ``process_id``'s node on the shaped network.

    Examples:
        >>> node_address(0)
        '10.77.0.1'
    """
    return f"{_SUBNET}.{process_id + 1}"


def _ip(*args: str, preexec: Callable[[], object] | None = None) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False,
                          preexec_fn=preexec)
    if done.returncode:
        raise LinkUnavailable(f"ip {' '.join(args)}: {_first_line(done.stderr)}")


def _libc_call(libc: ctypes.CDLL, name: str, *args: object) -> None:
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise LinkUnavailable(f"{name}: {os.strerror(err)}")


def node_main(command: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Make this process a node of the shaped network, then ``exec`` ``command``.

    Run by each launched process inside :func:`wrap`'s namespace (the launcher puts
    ``python -m meshkit.runtime.link --node --`` before the command). It adds a veth pair
    whose one end is on the bridge, moves into new network and UTS namespaces, takes
    the other end there as its NIC (address :func:`node_address`, MTU 9000, a ``tbf``
    qdisc at the rate), sets the host name to that address (gloo binds the host name's
    address), points the coordinator address at process 0's node, and execs.

    Args:
        command: what to run.
        env: the environment (default ``os.environ``): the launcher's process id and
            coordinator, and :data:`ENV_LINK_RATE`/:data:`ENV_LINK_BURST`.

    Raises:
        LinkUnavailable: a step failed (the message names it).
    """
    from meshkit.runtime.distributed import ENV_COORDINATOR, ENV_PROCESS_ID

    env = dict(os.environ if env is None else env)
    me = int(env[ENV_PROCESS_ID])
    if me >= _MAX_NODES:
        raise LinkUnavailable(f"--link-rate: at most {_MAX_NODES} processes, got id {me}")
    shape = link_shape(env[ENV_LINK_RATE], env[ENV_LINK_BURST])
    nic, hub_end = f"mkn{me}", f"mkh{me}"
    _ip("link", "add", nic, "type", "veth", "peer", "name", hub_end)
    _ip("link", "set", hub_end, "master", _BRIDGE, "mtu", "9000", "up")
    libc = ctypes.CDLL(None, use_errno=True)
    hub = os.open("/proc/self/ns/net", os.O_RDONLY)
    _libc_call(libc, "unshare", _CLONE_NEWNET | _CLONE_NEWUTS)

    def in_hub() -> None:  # in the forked `ip`: back in the bridge's namespace
        libc.setns(hub, _CLONE_NEWNET)

    _ip("link", "set", nic, "netns", str(os.getpid()), preexec=in_hub)
    os.close(hub)
    address = node_address(me)
    _ip("link", "set", "lo", "up")
    _ip("addr", "add", f"{address}/24", "dev", nic)
    _ip("link", "set", nic, "mtu", "9000", "up")
    done = subprocess.run(["tc", "qdisc", "add", "dev", nic, "root", *_tbf(shape).split()],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise LinkUnavailable(f"tc qdisc add dev {nic}: {_first_line(done.stderr)}")
    name = address.encode()
    _libc_call(libc, "sethostname", name, len(name))
    port = env[ENV_COORDINATOR].rsplit(":", 1)[1]
    env.update({ENV_COORDINATOR: f"{node_address(0)}:{port}", ENV_LINK_DEVICE: nic})
    os.execvpe(command[0], list(command), env)


def _main(argv: Sequence[str]) -> int:
    if argv[:2] != ["--node", "--"] or len(argv) < 3:
        sys.stderr.write("usage: python -m meshkit.runtime.link --node -- COMMAND ...\n")
        return 2
    try:
        node_main(argv[2:])
    except LinkUnavailable as e:
        # A process entry point of the launcher's own, not a library call: it ends here.
        sys.stderr.write(f"meshkit launch: error: shaped node: {e}\n")
        return 2
    return 0  # not reached: node_main execs


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
