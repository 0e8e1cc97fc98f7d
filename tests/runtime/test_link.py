"""``meshkit launch --link-rate``: a shaped loopback between the processes.

The error paths run everywhere (fake ``unshare``/``tc`` on a private ``PATH`` play a
machine without them); the shaped path runs where this machine can make a user and
network namespace with a ``tbf`` qdisc, and is skipped with the reason otherwise.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from _configs import SMALL
from _env import drop_device_count

from meshkit.cli import main
from meshkit.config import load_config
from meshkit.errors import UsageError
from meshkit.runtime.launch import launch
from meshkit.runtime.link import (
    LinkUnavailable,
    check_available,
    link_shape,
    parse_burst,
    parse_rate,
)
from meshkit.training import train
from meshkit.training.metrics import read_metrics

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


def _failing(pattern: str, message: str) -> str:
    """An ``unshare`` whose probe fails where its arguments match ``pattern``."""
    return f'case "$*" in {pattern}) echo \'{message}\' >&2; exit 2;; esac; exit 0'


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
        ({"unshare": _failing("*veth*", "Error: Unknown device type."),
          "ip": _OK, "tc": _OK},
         "ip cannot add a bridge and a veth pair in a network namespace here (Error: Unknown"),
        ({"unshare": _failing("*tbf*", "Error: Specified qdisc kind is unknown."),
          "ip": _OK, "tc": _OK},
         "tc cannot add a tbf qdisc in a network namespace here (Error: Specified qdisc kind"),
    ],
    ids=["no-unshare", "no-tc", "no-namespaces", "no-veth", "no-tbf"],
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


# Each process reports its namespaces (its own, and its launcher's: the bridge's) and its
# NIC; process 0 sends 4 MiB to process 1's node, then 4 MiB to itself (its own
# address), reading its NIC's byte counter after each.
_SHAPED = r"""
import os, socket, subprocess, threading, time
me = int(os.environ["MESHKIT_PROCESS_ID"])
port = int(os.environ["MESHKIT_COORDINATOR"].rsplit(":", 1)[1])
nic = os.environ["MESHKIT_LINK_DEVICE"]
print("ns", os.readlink("/proc/self/ns/net"), os.readlink(f"/proc/{os.getppid()}/ns/net"),
      socket.gethostname(), flush=True)
print("qdisc", subprocess.run(["tc", "qdisc", "show", "dev", nic], capture_output=True,
      text=True).stdout.strip(), flush=True)

def sent():
    words = subprocess.run(["tc", "-s", "qdisc", "show", "dev", nic], capture_output=True,
                           text=True).stdout.split()
    return int(words[words.index("Sent") + 1])

def sink(server, count):
    for _ in range(count):
        conn, _ = server.accept()
        while conn.recv(1 << 16):
            pass

def send(host):
    for _ in range(200):
        try:
            conn = socket.create_connection((host, port))
            break
        except OSError:
            time.sleep(0.05)
    conn.sendall(b"x" * (4 << 20))
    conn.close()

server = socket.create_server(("0.0.0.0", port))
if me == 1:
    sink(server, 1)
else:
    threading.Thread(target=sink, args=(server, 1), daemon=True).start()
    start = sent()
    send("10.77.0.2")
    time.sleep(0.2)
    across = sent() - start
    send(socket.gethostname())
    time.sleep(0.2)
    print("sent across", across, "to itself", sent() - start - across, flush=True)
"""


@needs_shaping
def test_each_process_is_a_node_whose_nic_carries_only_the_bytes_between_nodes(capfd):
    assert main(["launch", "-n", "2", "--link-rate", "2gbit", "--", PY, "-c", _SHAPED]) == 0
    out = capfd.readouterr().out.splitlines()
    nodes = [line.split() for line in out if " ns " in line]
    assert len({n[2] for n in nodes}) == 2, out  # a namespace each
    assert len({n[3] for n in nodes}) == 1, out  # one bridge between them
    assert sorted(n[4] for n in nodes) == ["10.77.0.1", "10.77.0.2"]  # host name: address
    assert os.readlink("/proc/self/ns/net") not in {n[2] for n in nodes} | {nodes[0][3]}
    qdiscs = [line for line in out if line.split()[1] == "qdisc"]
    assert len(qdiscs) == 2 and all("tbf" in q and "rate 2Gbit" in q for q in qdiscs), out
    [counts] = [line.split() for line in out if " sent across " in line]
    assert int(counts[3]) >= 4 << 20, "the bytes to the other node missed the shaped NIC"
    assert int(counts[6]) < 1 << 20, "bytes inside a node went through its shaped NIC"
    # Nothing left behind: the namespaces died with their processes.
    assert not any(_processes_in(ns) for ns in {n[2] for n in nodes} | {nodes[0][3]})


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
print("ns", os.readlink("/proc/self/ns/net"), os.readlink(f"/proc/{os.getppid()}/ns/net"),
      flush=True)
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
    namespaces = {ns for line in seen if " ns " in line for ns in line.split()[2:4]}
    assert len(namespaces) == 3 and all(_processes_in(ns) for ns in namespaces), seen
    launcher.send_signal(sig)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_processes_in(ns) for ns in namespaces) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_processes_in(ns) for ns in namespaces), f"left running: {seen}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--link-rate", "1gigabit"], "--link-rate: '1gigabit' is not a number and a unit"),
        (["--processes", "1", "--link-rate", "1gbit"],
         "--link-rate shapes the link between 2 processes; it needs --processes 2, got 1"),
        (["--link-burst", "1mb"], "--link-burst needs --link-rate"),
    ],
)
def test_calibrate_refuses_a_bad_link_before_measuring(capsys, tmp_path, flags, message):
    err = _one_line_error(capsys, ["calibrate", "-o", str(tmp_path / "t.yaml"), *flags])
    assert message in err and not (tmp_path / "t.yaml").exists()


_PARITY = [*SMALL, "train.steps=6", "train.log_every=1", "train.checkpoint_every=1000",
           "exchange.dedup=true"]


@needs_shaping
def test_training_across_shaped_nodes_equals_one_process(tmp_path, monkeypatch):
    """The deduplicated exchange over a 1 Gbit/s link between 2 processes × 4 devices
    trains step for step as one process of 8 simulated devices."""
    jax.devices()  # this process's 8 devices, before the launched ones choose their own
    one = train(load_config(None, [*_PARITY, f"train.workdir={tmp_path / 'one'}"]),
                verbose=False)
    drop_device_count(monkeypatch)
    args = [*_PARITY, f"train.workdir={tmp_path / 'two'}", "--no-progress"]
    code = f"import sys\nfrom meshkit.cli import main\nsys.exit(main(['train', *{args!r}]))\n"
    out = io.StringIO()
    result = launch([PY, "-c", code], 2, devices_per_process=4, timeout_s=60, out=out,
                    link_rate="1gbit")
    assert result.returncode == 0, out.getvalue()[-3000:]
    rows = read_metrics(tmp_path / "two")
    assert [r["step"] for r in rows] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in rows], [loss for _, loss in one.losses],
                               rtol=2e-5)
