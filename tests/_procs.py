"""Helpers for tests that stop a command with a signal and check it left no process.

Processes are found in /proc (no dependency), named by pid, and ended by pid.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

# The signals a command must end cleanly on, with the exit code and the words of its one
# line (meshkit.cli.ending.signal_ending).
STOPS = [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 143, "stopped by SIGTERM"),
    (signal.SIGHUP, 129, "stopped by SIGHUP"),
]
STOP_IDS = ["SIGINT", "SIGTERM", "SIGHUP"]


def children(parent: int, marker: bytes) -> list[int]:
    """The live processes whose parent is ``parent`` and whose command line has ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and marker in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status waits to be read)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def left_running(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still running after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` and its group (a test's clean-up, whatever happened)."""
    for pid in pids:
        for end in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                end(pid, signal.SIGKILL)


def lines_of(stream: object) -> queue.Queue[str]:
    """A queue that a daemon thread fills with ``stream``'s lines, then ``""`` at its end."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue[str], prefix: str, seen: list[str],
             timeout_s: float = 60.0) -> None:
    """Wait for a line that starts with ``prefix`` (each line read goes into ``seen``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        seen.append(line)
        if line.startswith(prefix):
            return
        assert line, f"ended before {prefix!r}: {''.join(seen)[-3000:]}"


def rest(lines: queue.Queue[str], seen: list[str], timeout_s: float = 10.0) -> str:
    """Everything read so far and up to the stream's end."""
    deadline = time.monotonic() + timeout_s
    while not seen or seen[-1]:
        seen.append(lines.get(timeout=max(0.01, deadline - time.monotonic())))
    return "".join(seen)


def end(p: subprocess.Popen[str]) -> None:
    """Kill ``p``'s group and reap it, if it still runs."""
    if p.poll() is None:
        kill([p.pid])
        p.wait()
