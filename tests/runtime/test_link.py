"""``meshkit launch --link-rate``: a shaped loopback between the processes.

The error paths run everywhere (fake ``unshare``/``tc`` on a private ``PATH`` play a
machine without them); the shaped path runs where this machine can make a user and
network namespace with a ``tbf`` qdisc, and is skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from meshkit.cli import main
from meshkit.errors import UsageError
from meshkit.runtime.link import (
    LinkUnavailable,
    check_available,
    link_shape,
    parse_burst,
    parse_rate,
)

PY = sys.executable


def _shaping_unavailable() -> str | None:
    try:
        check_available()
    except LinkUnavailable as e:
        return str(e)
    return None


_WHY_NOT = _shaping_unavailable()
needs_shaping = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no shaped link here: {_WHY_NOT}")


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--link-rate", "1gbt"], "--link-rate: '1gbt' is not a number and a unit of kbit, mbit"),
        (["--link-rate", "fast"], "--link-rate: 'fast' is not a number"),
        (["--link-rate=-1gbit"], "--link-rate: '-1gbit' is not a number"),
        (["--link-rate", "5kbit"], "--link-rate: '5kbit' is outside 1mbit .. 1tbit"),
        (["--link-rate", "1gbit", "--link-burst", "1kb"], "--link-burst: '1kb' is outside"),
        (["--link-rate", "1gbit", "--link-burst", "lots"], "--link-burst: 'lots' is not a"),
        (["--link-burst", "1mb"], "--link-burst needs --link-rate"),
    ],
)
def test_malformed_link_flags_are_one_line_exit_2(capsys, flags, message):
    err = _one_line_error(capsys, ["launch", "-n", "2", *flags, "--", PY, "-c", "pass"])
    assert message in err


def test_a_rate_with_one_process_is_refused(capsys):
    err = _one_line_error(capsys, ["launch", "-n", "1", "--link-rate", "1gbit", "--", "true"])
    assert "--link-rate shapes the link between processes; it needs -n 2 or more" in err


def _fake_bin(tmp_path, **scripts: str) -> str:
    """A PATH of one folder holding the given shell scripts (nothing else)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(folder)


_OK = "exit 0"


@pytest.mark.parametrize(
    ("scripts", "message"),
    [
        ({"ip": _OK, "tc": _OK}, "--link-rate needs unshare to make a network namespace"),
        ({"unshare": _OK, "ip": _OK}, "--link-rate needs tc to shape the loopback"),
        # As on a kernel with user namespaces off (unshare's own message).
        ({"unshare": "echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1",
          "ip": _OK, "tc": _OK},
         "no permission for network namespaces here (unshare -rn: unshare: unshare failed: "
         "Operation not permitted)"),
        ({"unshare": "[ \"$1\" = -rn ] && [ \"$2\" = true ] && exit 0; "
                     "echo 'Error: Specified qdisc kind is unknown.' >&2; exit 2",
          "ip": _OK, "tc": _OK},
         "tc cannot add a tbf qdisc in a network namespace here (Error: Specified qdisc kind"),
    ],
    ids=["no-unshare", "no-tc", "no-namespaces", "no-tbf"],
)
def test_a_machine_that_cannot_shape_says_which_part_is_missing(
        capsys, monkeypatch, tmp_path, scripts, message):
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, **scripts))
    err = _one_line_error(capsys, ["launch", "-n", "2", "--link-rate", "1gbit", "--", PY,
                                   "-c", "pass"])
    assert message in err


def test_rates_and_bursts_parse_as_tc_spells_them():
    assert parse_rate("250mbit") == 250e6 and parse_rate("1GBIT") == 1e9
    assert parse_burst("256kb") == 256 * 1024
    assert link_shape("1gbit").burst == "256kb"  # the default bucket
    assert link_shape("8gbit", "2mb").burst_bytes == 2 * 1024**2
    with pytest.raises(UsageError):
        parse_rate(None)  # type: ignore[arg-type]


# Each process reports its network namespace and the loopback's qdisc; process 0 then
# sends 4 MiB to process 1 over TCP, and process 1 reports the qdisc's byte counter.
_SHAPED = r"""
import os, socket, subprocess, time
me = int(os.environ["MESHKIT_PROCESS_ID"])
port = int(os.environ["MESHKIT_COORDINATOR"].rsplit(":", 1)[1])
print("ns", os.readlink("/proc/self/ns/net"), os.environ["MESHKIT_LINK_RATE"], flush=True)
print("qdisc", subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
      text=True).stdout.strip(), flush=True)
if me == 1:
    server = socket.create_server(("127.0.0.1", port))
    conn, _ = server.accept()
    got = 0
    while chunk := conn.recv(1 << 16):
        got += len(chunk)
    stats = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True,
                           text=True).stdout.split()
    print("received", got, "qdisc sent", stats[stats.index("Sent") + 1], flush=True)
else:
    for _ in range(200):
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.05)
    conn.sendall(b"x" * (4 << 20))
    conn.close()
"""


@needs_shaping
def test_the_processes_share_one_shaped_namespace_and_their_bytes_cross_it(capfd):
    assert main(["launch", "-n", "2", "--link-rate", "2gbit", "--", PY, "-c", _SHAPED]) == 0
    out = capfd.readouterr().out.splitlines()
    namespaces = {line.split()[2] for line in out if " ns " in line}
    assert len(namespaces) == 1 and os.readlink("/proc/self/ns/net") not in namespaces, out
    assert all("2gbit" in line for line in out if " ns " in line)
    qdiscs = [line for line in out if line.split()[1] == "qdisc"]
    assert len(qdiscs) == 2 and all("tbf" in q and "rate 2Gbit" in q for q in qdiscs), out
    [received] = [line.split() for line in out if " received " in line]
    assert int(received[2]) == 4 << 20
    assert int(received[5]) >= 4 << 20, "the bytes did not go through the shaped qdisc"
    # Nothing left behind: the namespace died with its processes.
    assert not _processes_in(namespaces.pop())


def _processes_in(namespace: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") == namespace:
                found.append(int(pid))
        except OSError:  # gone, or not ours
            pass
    return found


_SLEEPER = r"""
import os, time
print("ns", os.readlink("/proc/self/ns/net"), os.getpid(), flush=True)
time.sleep(120)
"""


@needs_shaping
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_shaped_launch_leaves_no_process_and_no_namespace(sig):
    launcher = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "launch", "-n", "2", "--link-rate", "1gbit", "--grace", "1",
         "--", PY, "-c", _SLEEPER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout], daemon=True).start()
    seen = []
    while len([line for line in seen if " ns " in line]) < 2:
        seen.append(lines.get(timeout=30))
    namespace = seen[-1].split()[2]
    assert _processes_in(namespace)
    launcher.send_signal(sig)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _processes_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_in(namespace), f"left running in the namespace: {seen}"
