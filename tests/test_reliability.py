"""Issue 11, reliability: a damaged newest checkpoint and SIGTERM do not cost the run.

Every run here trains the same small model with the same schedule (``train.steps`` far
beyond what any test runs, so every run compiles one program: persistent-cache hits) and
stops itself with SIGTERM from its ``on_log`` hook, or is signalled from outside. The
reference is one uninterrupted run, extended by resuming it when a test needs more steps
(resuming is exact, which test_train checks).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _configs import SMALL

from meshkit.checkpoint import Checkpointer
from meshkit.cli import main
from meshkit.config import Config, load_config
from meshkit.errors import Preempted
from meshkit.launch import launch
from meshkit.metrics import read_metrics
from meshkit.train import train

PY = sys.executable
RUN = [*SMALL, "train.steps=10000", "train.checkpoint_every=10", "train.log_every=1"]


def _config(workdir: Path) -> Config:
    return load_config(None, [*RUN, f"train.workdir={workdir}"])


def _run_until(config: Config, stop_after: int) -> dict[int, float]:
    """Train (resuming), SIGTERM itself after step ``stop_after``; every step's loss."""
    losses: dict[int, float] = {}

    def on_log(row):
        losses[row["step"]] = row["loss"]
        if row["step"] == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted, match=rf"stopped by SIGTERM after step {stop_after}; "):
        train(config, verbose=False, on_log=on_log)
    return losses


class Reference:
    """One run's losses: steps 1-35 uninterrupted (it then crashes, after checkpoint 30),
    extended on demand by resuming it (resuming is exact, which test_train checks)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.config = _config(workdir)
        self.losses: dict[int, float] = {}

        def crash(row):
            self.losses[row["step"]] = row["loss"]
            if row["step"] == 35:
                raise KeyboardInterrupt("simulated crash after the step-30 checkpoint")

        with pytest.raises(KeyboardInterrupt):
            train(self.config, verbose=False, on_log=crash)
        self.crashed = workdir.parent / f"{workdir.name}-crashed"
        shutil.copytree(workdir, self.crashed)  # checkpoints 20 and 30, as the crash left

    def upto(self, step: int) -> dict[int, float]:
        if step > max(self.losses):
            self.losses |= _run_until(self.config, step)
        return self.losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("reference"))


def _assert_same(losses: dict[int, float], reference: Reference, rtol: float = 1e-6) -> None:
    expected = reference.upto(max(losses))
    steps = sorted(losses)
    np.testing.assert_allclose([losses[s] for s in steps], [expected[s] for s in steps],
                               rtol=rtol)


def test_sigterm_in_process_stops_after_the_step_in_flight_with_its_checkpoint(reference):
    losses = reference.upto(40)  # resumes from 30 and SIGTERMs itself after step 40
    assert sorted(losses) == list(range(1, 41))
    # A checkpoint at 40 beside the regular one at 30, and nothing later.
    assert Checkpointer(reference.workdir / "checkpoints").all_steps() == [30, 40]


# ------------------------------------------------------------ damaged checkpoints


def _damage_every_data_file(step_dir: Path, how: str) -> list[Path]:
    files = sorted((step_dir / "default" / "ocdbt.process_0" / "d").iterdir())
    for f in files:
        if how == "overwrite":  # in the middle: orbax alone would read wrong numbers
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                fh.write(b"\xde\xad\xbe\xef")
        elif how == "truncate":
            os.truncate(f, f.stat().st_size // 2)
        else:
            f.unlink()
    return files


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes_exactly(
    reference, tmp_path, capsys
):
    workdir = tmp_path / "run"
    shutil.copytree(reference.crashed, workdir)
    damaged = _damage_every_data_file(workdir / "checkpoints" / "30", "overwrite")
    capsys.readouterr()
    losses = _run_until(_config(workdir), 40)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    aside = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("corrupt-")]
    assert len(aside) == 1 and aside[0].name.startswith("corrupt-30-")
    assert warnings[0].startswith(
        f"meshkit train: warning: checkpoint {workdir}/checkpoints/30 is damaged "
        f"(default/ocdbt.process_0/d/")
    assert f"its CRC-32 differs from the recorded one); moved it to {aside[0]}" in warnings[0]
    # Moved, not deleted: the damaged files are all there.
    assert sorted(p.name for p in (aside[0] / "default/ocdbt.process_0/d").iterdir()) == [
        p.name for p in damaged]
    assert sorted(losses) == list(range(21, 41))  # resumed from step 20
    _assert_same(losses, reference)
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 41))


def test_no_intact_checkpoint_exits_2_in_one_line(reference, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(reference.crashed, workdir)
    for step in (20, 30):
        _damage_every_data_file(workdir / "checkpoints" / str(step), "truncate")
    capsys.readouterr()
    assert main(["train", *RUN, f"train.workdir={workdir}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert [line.split(" is damaged")[0] for line in lines[:2]] == [
        f"meshkit train: warning: checkpoint {workdir}/checkpoints/{s}" for s in (30, 20)]
    assert len(lines) == 3 and lines[2].startswith(
        f"meshkit train: error: no intact checkpoint in {workdir}/checkpoints: every one "
        "was damaged and moved aside (")
    assert lines[2].endswith("rerun to start from step 0, or move one back")
    assert len([p for p in (workdir / "checkpoints").iterdir()
                if p.name.startswith("corrupt-")]) == 2


# ------------------------------------------------------------------ preemption


def _wait_for_training(workdir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the run has logged a step (so it is in its loop)."""
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.stat().st_size):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.02)


def _stopped_step(output: str, prefix: str = "") -> int:
    lines = [line for line in output.splitlines()
             if line.startswith(f"{prefix}meshkit train: error: stopped by ")]
    assert lines, output[-3000:]
    return int(lines[0].split(" after step ")[1].split(";")[0])


def test_sigterm_to_meshkit_train_checkpoints_exits_4_and_resumes_exactly(
    reference, tmp_path
):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "train", *RUN, f"train.workdir={workdir}", "--no-progress"],
        stderr=subprocess.PIPE, text=True)
    _wait_for_training(workdir, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert "Traceback" not in err
    step = _stopped_step(err)
    assert err.strip().splitlines()[-1] == (
        f"meshkit train: error: stopped by SIGTERM after step {step}; checkpoint "
        f"{workdir}/checkpoints/{step} is saved: run the same command again to resume")
    assert Checkpointer(workdir / "checkpoints").latest_step() == step
    losses = _run_until(_config(workdir), step + 3)
    assert sorted(losses) == [step + 1, step + 2, step + 3]
    _assert_same(losses, reference)


def test_sigterm_to_meshkit_launch_stops_both_processes_at_one_step(reference, tmp_path):
    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # train sets 4 each
    proc = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "launch", "-n", "2", "--", PY, "-m", "meshkit.cli", "train",
         *RUN, f"train.workdir={workdir}", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _wait_for_training(workdir, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 4, out[-3000:]
    step = _stopped_step(out, "[0] ")
    assert _stopped_step(out, "[1] ") == step
    assert "meshkit launch: got SIGTERM; forwarded it to 2 processes, all ended in" in out
    step_dir = workdir / "checkpoints" / str(step)
    assert Checkpointer(workdir / "checkpoints").all_steps() == [step]
    assert sorted(p.name for p in step_dir.glob("meshkit-checksums-*")) == [
        "meshkit-checksums-0-of-2.json", "meshkit-checksums-1-of-2.json"]
    # Resumed in one process: equal to the uninterrupted run up to cross-process float
    # differences (the 2-process parity test's tolerance).
    losses = _run_until(_config(workdir), step + 3)
    _assert_same(losses, reference, rtol=1e-5)


AGREE = """
import os, signal, sys, time
from meshkit.distributed import initialize
initialize()
from meshkit.agree import agree_max
from meshkit.preemption import Preemption
me = int(os.environ["MESHKIT_PROCESS_ID"])
with Preemption(agree_max, every=5) as stop:
    for step in range(1, 1000):
        time.sleep(0.01)
        if me == 1 and step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # only process 1 is signalled
        if stop.should_stop(step):
            print("stop", step, stop.describe(), flush=True)
            sys.exit(4)
"""


def test_sigterm_to_one_process_stops_every_process_at_the_same_step():
    out = io.StringIO()
    result = launch([PY, "-c", AGREE], 2, devices_per_process=1, timeout_s=30, out=out)
    lines = sorted(x for x in out.getvalue().splitlines() if " stop " in x)
    # The next agreement point after step 7 is step 10, on both.
    assert lines == ["[0] stop 10 a stop signal to another process", "[1] stop 10 SIGTERM"], (
        out.getvalue()[-3000:])
    assert result.returncode == 4
