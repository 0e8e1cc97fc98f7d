"""A shaped inter-node link on one machine: a private network namespace whose loopback
runs at a given rate.

``meshkit launch --link-rate 1gbit`` starts its whole job (the launcher, process 0's
coordinator, every process) inside one network namespace made by ``unshare -rn`` (a user
namespace, so no root is needed), whose loopback device has a token-bucket (``tc``
``tbf``) qdisc at that rate. Every byte between the processes, the node axis, crosses
that loopback, so it travels at the link's rate, while bytes between the devices of one
process stay memory copies. The namespace has no other link, and it ends with the last
of its processes: nothing is left behind, however the launch ends.

What to expect of the link (measure it with ``meshkit calibrate --link-rate``):

* both directions share the loopback's one qdisc, so the rate is the total of all the
  traffic between the processes: with 2 processes of M devices all sending at once, each
  device gets ``rate / (2·M)`` (a real NIC is full-duplex: each direction gets the rate);
* the bucket lets ``burst`` bytes through at memory speed after an idle spell, so small
  messages barely see the rate;
* ``netem`` (added delay) is not on every kernel: the link's latency is loopback TCP's
  plus the collectives' own, not a chosen one.

Example:
    >>> shape = link_shape("1gbit")
    >>> shape.rate_bps, shape.burst
    (1000000000.0, '256kb')
    >>> wrap(["python", "job.py"], shape)[:2]
    ['unshare', '-rn']
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from meshkit.choices import LINK_BURST_UNITS, LINK_RATE_UNITS
from meshkit.errors import UsageError

__all__ = [
    "ENV_LINK_BURST",
    "ENV_LINK_RATE",
    "LinkShape",
    "LinkUnavailable",
    "check_available",
    "link_shape",
    "parse_burst",
    "parse_rate",
    "reshape",
    "wrap",
]

#: Set in the shaped job's environment: the link's rate and burst as ``tc`` spells them.
ENV_LINK_RATE = "MESHKIT_LINK_RATE"
ENV_LINK_BURST = "MESHKIT_LINK_BURST"

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

    Example:
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

    Example:
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

    Example:
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
    """``command`` run inside a new network namespace with a shaped loopback.

    The shell brings the namespace's loopback up, adds the qdisc, and ``exec``\\ s the
    command (same process: signals reach it, and its exit is the namespace's end).

    Args:
        command: the program and its arguments.
        shape: the link.

    Returns:
        The wrapped command line.

    Example:
        >>> wrap(["true"], link_shape("1gbit"))[7]
        'ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 100ms && exec "$@"'
    """  # noqa: E501
    script = f'ip link set lo up && tc qdisc add dev lo root {_tbf(shape)} && exec "$@"'
    return ["unshare", "-rn", "env", f"{ENV_LINK_RATE}={shape.rate}",
            f"{ENV_LINK_BURST}={shape.burst}", "sh", "-c", script, "meshkit-link", *command]


def reshape(shape: LinkShape | None) -> None:
    """Change the running namespace's link to ``shape`` (``None``: unshaped).

    For benchmarks that time one compiled program at several rates: call it from one
    process of a job that :func:`wrap` started (the namespace's owner may change its
    qdisc), between timings.

    Args:
        shape: the new link, or ``None`` to remove the qdisc.

    Raises:
        LinkUnavailable: ``tc`` refused (e.g. not inside a shaped namespace).
    """
    if shape is None:
        args = ["tc", "qdisc", "del", "dev", "lo", "root"]
    else:
        args = ["tc", "qdisc", "replace", "dev", "lo", "root", *_tbf(shape).split()]
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
    done = probe("sh", "-c", f"ip link set lo up && tc qdisc add dev lo root "
                 f"{_tbf(link_shape('1gbit'))}")
    if done.returncode:
        raise LinkUnavailable("--link-rate: tc cannot add a tbf qdisc in a network namespace "
                              f"here ({_first_line(done.stderr)}); the kernel may lack "
                              "sch_tbf")
