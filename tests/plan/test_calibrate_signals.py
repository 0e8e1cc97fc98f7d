"""``meshkit calibrate`` stopped part-way: one line, 130, 143 or 129, no file, no worker.

Ctrl-C, SIGTERM and SIGHUP during the 2-process stage end the command with the signal's
own line and code, not the workers' tracebacks, and a signal while the file is written
waits until it is whole.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
from _procs import STOP_IDS, STOPS, children, end, kill, left_running

from meshkit._fs import write_file
from meshkit.errors import UsageError

PY = sys.executable

# The one-process measurement replaced by a fixed result, so the 2-process stage starts
# at once; the workers are real (meshkit launch, jax.distributed).
CHILD = """
import sys
import meshkit.plan.calibrate as c
link = {"latency_s": 2e-6, "bandwidth_Bps": 5e10}
c.calibrate = lambda **kw: {"devices_per_node": 8, "intra": dict(link),
    "memory_bandwidth_Bps": 1e11, "flops_per_s": 1e12, "memory_bytes": None,
    "measured": {"intra": []}}
from meshkit.cli.main import run
sys.argv[1:] = ["calibrate", "--quick", "-o", sys.argv[1]]
run()
"""


def _workers_of(pid: int) -> list[int]:
    """The calibrate workers ``pid`` runs (its launcher's processes, named by their flag)."""
    return children(pid, b"--inter-worker")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sig", "code", "words"), STOPS, ids=STOP_IDS)
def test_a_signal_during_the_two_process_stage_is_one_line_and_no_worker(
        tmp_path, sig, code, words):
    out = tmp_path / "t.yaml"
    p = subprocess.Popen([PY, "-c", CHILD, str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(_workers_of(p.pid)) < 2 and time.monotonic() < deadline:
            assert p.poll() is None, p.communicate()
            time.sleep(0.1)
        workers = _workers_of(p.pid)
        time.sleep(1.0)  # the workers importing JAX, or already measuring
        os.killpg(p.pid, sig)  # as a terminal sends it: calibrate's group
        stdout, stderr = p.communicate(timeout=30)
    finally:
        end(p)
        left = left_running(workers)
        kill(workers)
    assert (p.returncode, stderr) == (code, f"meshkit calibrate: {words}\n"), stderr[-3000:]
    assert stdout == "" and os.listdir(tmp_path) == []
    assert not left, "workers left running"


def test_a_signal_while_the_file_is_written_waits_until_it_is_whole(tmp_path, monkeypatch):
    path = tmp_path / "t.yaml"
    seen: list[str] = []
    fsync = os.fsync

    def fsync_then_signal(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the write
        fsync(fd)

    previous = signal.signal(signal.SIGINT,
                             lambda *a: seen.append(path.read_text() if path.exists() else ""))
    try:
        monkeypatch.setattr(os, "fsync", fsync_then_signal)
        write_file(str(path), "whole: 1\n", flag="--output")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["whole: 1\n"]  # the handler ran only once the file was in place
    assert os.listdir(tmp_path) == ["t.yaml"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


def test_a_full_disk_while_writing_leaves_no_file_behind(tmp_path, monkeypatch):
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UsageError, match=r"--output: cannot write .*t\.yaml: No space left"):
        write_file(str(tmp_path / "t.yaml"), "x: 1\n", flag="--output")
    assert os.listdir(tmp_path) == []
