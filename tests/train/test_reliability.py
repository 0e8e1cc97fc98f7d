"""Issue 11, reliability: a damaged newest checkpoint and SIGTERM do not cost the run.

Every run here is the 20-step run of test_train's reference and test_multiprocess (the
same compiled programs, so persistent-cache hits when the whole suite runs), with a
checkpoint every 5 steps: the issue's scenario (checkpoints 10/20/30, damage 30, resume
from 20) scaled to 5/10/15. The reference is one uninterrupted run; a copy of its workdir
taken after step 17 (checkpoints 10 and 15) is where the other runs start.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _configs import SMALL
from _env import drop_device_count

from meshkit.cli import main
from meshkit.config import Config, load_config
from meshkit.errors import Preempted
from meshkit.runtime.launch import launch
from meshkit.training import Hook, train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.metrics import read_metrics

PY = sys.executable
RUN = [*SMALL, "train.steps=20", "train.log_every=1", "train.checkpoint_every=5",
       "exchange.method=hierarchical"]


def _config(workdir: Path) -> Config:
    return load_config(None, [*RUN, f"train.workdir={workdir}"])


class Reference:
    """One uninterrupted run's losses, and a copy of its workdir as it was after step 17."""

    def __init__(self, workdir: Path) -> None:
        self.snapshot = workdir.parent / f"{workdir.name}-at-17"

        def snapshot(info):
            if info.step == 17:  # as a run killed there left it: its lock is no more
                shutil.copytree(workdir, self.snapshot,
                                ignore=shutil.ignore_patterns(".lock"))

        result = train(_config(workdir), verbose=False, hooks=[Hook(snapshot, every=1)])
        self.losses = dict(result.losses)
        assert sorted(self.losses) == list(range(1, 21))
        assert Checkpointer(self.snapshot / "checkpoints").all_steps() == [10, 15]

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.snapshot, to)
        return to

    def assert_same(self, losses: dict[int, float], rtol: float = 1e-6) -> None:
        steps = sorted(losses)
        np.testing.assert_allclose([losses[s] for s in steps], [self.losses[s] for s in steps],
                                   rtol=rtol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("reference"))


# SIGHUP (a closed terminal) leaves a checkpoint to resume from, as SIGTERM does.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_stops_after_the_step_in_flight_with_its_checkpoint(
        reference, tmp_path, name):
    workdir = reference.copy(tmp_path / "run")
    losses: dict[int, float] = {}

    def on_log(info):
        losses[info.step] = info.loss
        if info.step == 17:
            os.kill(os.getpid(), getattr(signal, name))  # arrives in the loop, after step 17

    with pytest.raises(Preempted, match=rf"^stopped by {name} after step 17; checkpoint "
                       rf"{workdir}/checkpoints/17 is saved: run the same command again"):
        train(_config(workdir), verbose=False, hooks=[Hook(on_log, every=None)])
    assert sorted(losses) == [16, 17]
    reference.assert_same(losses)
    assert Checkpointer(workdir / "checkpoints").all_steps() == [15, 17]
    # Resuming after a SIGTERM: see the meshkit train and meshkit launch tests below.


# ------------------------------------------------------------ damaged checkpoints


def _damage_every_data_file(step_dir: Path, how: str) -> list[str]:
    files = sorted((step_dir / "default" / "ocdbt.process_0" / "d").iterdir())
    for f in files:
        if how == "overwrite":  # in the middle: orbax alone would read wrong numbers
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                fh.write(b"\xde\xad\xbe\xef")
        else:
            os.truncate(f, f.stat().st_size // 2)
    return [f.name for f in files]


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes_exactly(
    reference, tmp_path, caplog
):
    workdir = reference.copy(tmp_path / "run")
    damaged = _damage_every_data_file(workdir / "checkpoints" / "15", "overwrite")
    result = train(_config(workdir), verbose=False)
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("meshkit") and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    aside = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("corrupt-")]
    assert len(aside) == 1 and aside[0].name.startswith("corrupt-15-")
    assert warnings[0].startswith(
        f"meshkit: warning: checkpoint {workdir}/checkpoints/15 is damaged "
        f"(default/ocdbt.process_0/d/")
    assert f"its CRC-32 differs from the recorded one); moved it to {aside[0]}" in warnings[0]
    # Moved, not deleted: the damaged files are all there.
    assert sorted(p.name for p in (aside[0] / "default/ocdbt.process_0/d").iterdir()) == damaged
    assert result.start_step == 10
    reference.assert_same(dict(result.losses))
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 21))


def test_no_intact_checkpoint_exits_2_in_one_line(reference, tmp_path, capsys):
    workdir = reference.copy(tmp_path / "run")
    for step in (10, 15):
        _damage_every_data_file(workdir / "checkpoints" / str(step), "truncate")
    capsys.readouterr()
    assert main(["train", *RUN, f"train.workdir={workdir}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert [line.split(" is damaged")[0] for line in lines[:2]] == [
        f"meshkit train: warning: checkpoint {workdir}/checkpoints/{s}" for s in (15, 10)]
    assert "is truncated (" in lines[0] and "is truncated (" in lines[1]
    assert len(lines) == 3 and lines[2].startswith(
        f"meshkit train: error: no intact checkpoint in {workdir}/checkpoints: every one "
        "was damaged and moved aside (")
    assert lines[2].endswith("rerun to start from step 0, or move one back")
    assert len(list((workdir / "checkpoints").glob("corrupt-*"))) == 2


# ------------------------------------------------------------------ preemption
#
# The signal comes from outside once the run has said it resumes from step 15 (its
# handler is in place by then), while it compiles: it finishes step 16 and stops there.


def _signal_after(proc: subprocess.Popen, marker: str, stream) -> list[str]:
    seen = []
    for line in stream:
        seen.append(line)
        if marker in line:
            proc.send_signal(signal.SIGTERM)
            break
    else:
        raise AssertionError("".join(seen))
    return seen


def test_sigterm_to_meshkit_train_checkpoints_exits_4_and_resumes_exactly(
    reference, tmp_path
):
    workdir = reference.copy(tmp_path / "run")
    proc = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "train", *RUN, f"train.workdir={workdir}", "--no-progress"],
        stderr=subprocess.PIPE, text=True)
    seen = _signal_after(proc, "meshkit train: resuming from step 15", proc.stderr)
    err = "".join(seen) + proc.communicate(timeout=120)[1]
    assert proc.returncode == 4, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"meshkit train: error: stopped by SIGTERM after step 16; checkpoint "
        f"{workdir}/checkpoints/16 is saved: run the same command again to resume")
    assert Checkpointer(workdir / "checkpoints").all_steps() == [15, 16]
    resumed = train(_config(workdir), verbose=False)
    assert resumed.start_step == 16
    reference.assert_same(dict(resumed.losses))


def test_sigterm_to_meshkit_launch_checkpoints_on_both_processes_and_exits_4(
    reference, tmp_path, monkeypatch
):
    workdir = reference.copy(tmp_path / "run")
    drop_device_count(monkeypatch)  # meshkit train gives each process its 4 devices
    proc = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "launch", "-n", "2", "--", PY, "-m", "meshkit.cli", "train",
         *RUN, f"train.workdir={workdir}", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = _signal_after(proc, "[0] meshkit train: resuming from step 15", proc.stdout)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 4, out[-3000:]
    for i in (0, 1):
        assert (f"[{i}] meshkit train: error: stopped by SIGTERM after step 16; checkpoint "
                f"{workdir}/checkpoints/16 is saved") in out
    assert "meshkit launch: got SIGTERM; forwarded it to 2 processes, all ended in" in out
    assert Checkpointer(workdir / "checkpoints").all_steps() == [15, 16]
    assert sorted(p.name for p in (workdir / "checkpoints/16").glob("meshkit-checksums-*")) == [
        "meshkit-checksums-0-of-2.json", "meshkit-checksums-1-of-2.json"]
    # Resumed in this process: equal to the uninterrupted run up to the cross-process
    # float differences test_multiprocess allows.
    resumed = train(_config(workdir), verbose=False)
    assert resumed.start_step == 16
    reference.assert_same(dict(resumed.losses), rtol=2e-5)


AGREE = """
import os, signal, sys, time
from meshkit.runtime.distributed import initialize
initialize()
from meshkit.runtime.agree import agree_max
from meshkit.training.preemption import Preemption
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
