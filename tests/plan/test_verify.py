"""``--verify``'s compiling subprocesses: several at once, results in the jobs' order,
nothing left running after Ctrl-C, SIGTERM, SIGHUP or even SIGKILL of the command, and
the fast-compile flags that leave XLA's bytes as they are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _procs import STOP_IDS, STOPS, children, end, kill, left_running, lines_of, rest, wait_for

from meshkit.plan import verify as verify_mod

PY = sys.executable
WORKER = b"meshkit.training.compile_worker"
TINY = ("name: tiny\nvocab_size: 128\nd_model: 128\nnum_layers: 2\nnum_heads: 4\n"
        "d_ff: 256\nnum_experts: 4\ntop_k: 2\nseq_len: 32\nbatch_size: 16\n"
        "compute_dtype: float32\nremat: none\ngrad_accum: 1\nschedule: gpipe\n")

# Each fails in its config's validation (no compile), each naming its own key.
BAD = [verify_mod.VerifyJob(f"bad{i}", None, (override,)) for i, override in enumerate((
    "train.seq_len=0", "model.num_layers=0", "train.batch_size=0"))]


def _spy(monkeypatch) -> list[subprocess.Popen[str]]:  # type: ignore[no-untyped-def]
    started: list[subprocess.Popen[str]] = []
    real = subprocess.Popen

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        proc = real(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(verify_mod.subprocess, "Popen", spy)
    return started


def test_two_workers_share_the_jobs_and_results_keep_their_order(monkeypatch) -> None:
    started = _spy(monkeypatch)
    lines: list[str] = []
    got = verify_mod.verify(BAD, devices=8, progress=lines.append, workers=2)
    assert len(started) == 2
    assert [r.name for r in got] == ["bad0", "bad1", "bad2"]
    for r, key in zip(got, ("seq_len", "num_layers", "batch_size"), strict=True):
        assert r.bytes is None and r.error is not None and key in r.error
    assert "2 at a time" in lines[0]
    assert sum("compiling bad" in line for line in lines) == 3


@pytest.mark.parametrize("jobs, workers", [(1, None), (3, 2)])
def test_interrupting_verify_leaves_no_process(monkeypatch, jobs, workers) -> None:
    started = _spy(monkeypatch)

    def interrupt(line: str) -> None:
        raise KeyboardInterrupt  # as Ctrl-C would, while the subprocesses compile

    with pytest.raises(KeyboardInterrupt):
        verify_mod.verify(BAD[:jobs], devices=8, progress=interrupt, workers=workers)
    assert len(started) == (workers or 1)
    for proc in started:
        assert proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # the whole group is gone


def test_bad_worker_count_is_one_line() -> None:
    with pytest.raises(verify_mod.VerifyError, match="workers must be a positive integer"):
        verify_mod.verify(BAD, devices=8, workers=0)


def test_one_worker_per_core_at_most_two_and_no_more_than_the_jobs(monkeypatch) -> None:
    monkeypatch.setattr(verify_mod.os, "cpu_count", lambda: 16)
    assert verify_mod._workers(3) == verify_mod.MAX_WORKERS == 2
    assert verify_mod._workers(1) == 1
    monkeypatch.setattr(verify_mod.os, "cpu_count", lambda: 1)
    assert verify_mod._workers(3) == 1


def test_the_workers_compile_with_the_fast_flags() -> None:
    # The same flags as the tests' own processes (conftest.py): XLA's memory_analysis()
    # was byte-identical with and without them (docs/guides/planning.md, --verify).
    assert set(verify_mod.COMPILE_FLAGS) <= set(os.environ.get("XLA_FLAGS", "").split())


def test_a_worker_that_dies_is_one_line_naming_its_last_words(monkeypatch, tmp_path) -> None:
    # More on stderr than a pipe holds, then an error: drained as it comes (not read
    # after the worker ends, which would wait on it forever), its last line reported.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nhead -c 200000 /dev/zero | tr '\\0' x >&2\n"
                    "echo >&2\necho 'boom: out of memory' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(verify_mod.sys, "executable", str(fake))
    with pytest.raises(verify_mod.VerifyError,
                       match="the compiling subprocess failed: boom: out of memory"):
        verify_mod.verify(BAD, devices=8, workers=2)


def test_workers_that_end_without_their_jobs_is_one_line(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(verify_mod.sys, "executable", str(fake))
    with pytest.raises(verify_mod.VerifyError, match="ended before their jobs"):
        verify_mod.verify(BAD, devices=8, workers=2)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "code", "words"),
                         [*STOPS, (signal.SIGKILL, -signal.SIGKILL, None)],
                         ids=[*STOP_IDS, "SIGKILL"])
def test_a_signal_during_plan_verify_leaves_no_worker(tmp_path, sig, code, words) -> None:
    # SIGTERM and SIGHUP end the command without its clean-up (os._exit), and the workers
    # are in sessions of their own, out of a terminal's or a scheduler's reach; SIGKILL
    # runs nothing at all in the command, so the workers must notice it themselves.
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    p = subprocess.Popen([PY, "-m", "meshkit.cli", "plan", "--model", str(model), "--devices",
                          "8", "--verify", "1", "--top", "1"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[int] = []
    try:
        lines, seen = lines_of(p.stderr), []
        # A worker compiling: it reads no more of its stdin until the compile is done.
        wait_for(lines, "verify: compiling #1 ", seen)
        workers = children(p.pid, WORKER)
        assert workers, "no compiling worker found"
        os.killpg(p.pid, sig)  # a terminal's signal reaches the command's group only
        assert p.wait(timeout=30) == code
        err = rest(lines, seen)
    finally:
        end(p)
        left = left_running(workers, within_s=3.0)  # well before the compile would end
        kill(workers)
    assert not left, "compiling workers left running"
    if words is not None:
        assert err.splitlines()[-1] == f"meshkit plan: {words}", err[-3000:]
        assert "Traceback" not in err, err[-3000:]


@pytest.mark.timeout(60)
def test_a_worker_whose_parent_dies_ends_itself_while_its_stdin_stays_open() -> None:
    # The test holds the worker's stdin open, so only the parent's death can end it.
    parent = subprocess.Popen(
        [PY, "-c", "import subprocess, sys, time\n"
         "w = subprocess.Popen([sys.executable, '-m', 'meshkit.training.compile_worker'],\n"
         "                     stdin=sys.stdin, stdout=subprocess.DEVNULL,\n"
         "                     start_new_session=True)\n"
         "print(w.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker = 0
    try:
        assert parent.stdout is not None and parent.stdin is not None
        worker = int(parent.stdout.readline())
        parent.stdin.write(json.dumps({"devices": 1, "parent": parent.pid}) + "\n")
        parent.stdin.flush()
        parent.kill()
        parent.wait(timeout=10)
        assert not left_running([worker]), "the worker outlived its parent"
    finally:
        end(parent)
        kill([worker] if worker else [])
        if parent.stdin is not None:
            parent.stdin.close()
