"""``--verify``'s compiling subprocesses: several at once, results in the jobs' order,
nothing left running after Ctrl-C, and the fast-compile flags that leave XLA's bytes as
they are."""

from __future__ import annotations

import os
import subprocess

import pytest

from meshkit.plan import verify as verify_mod

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
