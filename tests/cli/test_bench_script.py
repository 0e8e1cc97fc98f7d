"""``meshkit bench NAME`` ends like every meshkit command (issue 23; meshkit.cli.script).

One line and exit 2 for a bad flag, override or file; 141 for a reader gone; 130 for
Ctrl-C, whether the terminal sends it to both processes or ``kill`` to the launcher only.
Each runs the real command line in a subprocess, bounded by a timeout. (Overrides and
topology files go through the same boundary: tests/cli/test_fuzz_scripts.py, in-process.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _procs import STOP_IDS, STOPS

PY = sys.executable
BENCH = [PY, "-m", "meshkit.cli", "bench"]


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "line"), [
    (["groups", "--bogus"], "meshkit bench groups: error: unrecognized arguments: --bogus "
     "(see meshkit bench groups --help)"),
    (["groups", "--repeats", "x"], "meshkit bench groups: error: argument --repeats: must be "
     "an integer >= 1, got 'x' (see meshkit bench groups --help)"),
])
def test_a_bad_flag_or_file_is_one_line_exit_2_without_a_usage_block(args, line):
    done = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and _one_line(done) == line
    assert done.stdout == ""


def test_a_reader_that_closes_the_pipe_early_gives_141():
    cmd = f"{PY} -m meshkit.cli bench groups --quick --repeats 1 | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def _interrupt(after_s: float, *, group: bool,
               sig: int = signal.SIGINT) -> subprocess.CompletedProcess[str]:
    # 2^20 ranks: the benchmark runs for many seconds, so the signal lands mid-way.
    p = subprocess.Popen([*BENCH, "groups", "--repeats", "50"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(after_s)
    # group: a terminal's Ctrl-C, to both processes; else `kill -INT` to meshkit only.
    (os.killpg if group else os.kill)(p.pid, sig)
    try:
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize(("after_s", "group"), [(0.3, True), (0.3, False), (1.2, True)])
def test_ctrl_c_is_130_in_one_line_during_start_up_and_while_measuring(after_s, group):
    done = _interrupt(after_s, group=group)
    assert done.returncode == 130, done.stderr
    assert _one_line(done) == "meshkit bench groups: interrupted"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "code", "words"), STOPS[1:], ids=STOP_IDS[1:])
def test_sigterm_and_sighup_end_a_benchmark_in_one_line(sig, code, words):
    # To meshkit only: it passes the signal on to the benchmark, which reports it.
    done = _interrupt(1.2, group=False, sig=sig)
    assert done.returncode == code, done.stderr
    assert _one_line(done) == f"meshkit bench groups: {words}"
