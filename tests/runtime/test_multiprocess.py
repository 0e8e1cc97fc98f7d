"""Real multi-process runs over jax.distributed (2 processes × 4 CPU devices, loopback).

The node axis follows process boundaries, so the exchange's node stage crosses processes.
"""

import io
import json
import re
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from _configs import SMALL
from _env import drop_device_count

from meshkit.config import load_config
from meshkit.runtime.launch import launch
from meshkit.training import train
from meshkit.training.metrics import read_metrics

HERE = Path(__file__).resolve().parent
STEPS = ["train.steps=20", "train.log_every=1", "train.checkpoint_every=5",
         "train.keep_checkpoints=5", "exchange.method=hierarchical"]


@pytest.fixture(autouse=True)
def _no_inherited_device_count(monkeypatch):
    # This test process simulates 8 devices; launched processes must choose their own.
    jax.devices()  # start this process's backend while its flag is still set
    drop_device_count(monkeypatch)


def _launch(command, **kwargs):
    out = io.StringIO()
    result = launch(command, 2, timeout_s=30, out=out, **kwargs)
    return result, out.getvalue()


def test_hierarchical_equals_flat_across_processes():
    result, out = _launch([sys.executable, str(HERE / "_mp_exchange.py")],
                          devices_per_process=4)
    assert result.returncode == 0, out[-3000:]
    assert "[0] EXCHANGE OK 0" in out and "[1] EXCHANGE OK 1" in out


def _train_command(workdir, *, die_after_step=None, extra=(), record_rows=None):
    args = [*SMALL, *STEPS, *extra, f"train.workdir={workdir}", "--no-progress"]
    code = "import sys\nfrom meshkit.cli import main\n"
    if record_rows is not None:
        # Each process logs every batch it draws: split, step, the rows asked for, and
        # how many rows it got.
        code += textwrap.dedent(f"""
            import json, os
            from meshkit.data.sources import MarkovSource
            _batch = MarkovSource.batch
            def _logged(self, step, batch_size, seq_len, **kwargs):
                out = _batch(self, step, batch_size, seq_len, **kwargs)
                path = os.path.join({str(record_rows)!r},
                                    "rows." + os.environ["MESHKIT_PROCESS_ID"] + ".jsonl")
                with open(path, "a") as f:
                    print(json.dumps([kwargs["split"], step, kwargs.get("rows"), len(out)]),
                          file=f)
                return out
            MarkovSource.batch = _logged
        """)
    if die_after_step is not None:
        # Process 1 kills itself (SIGKILL, no clean-up) once process 0 has logged the step.
        code += textwrap.dedent(f"""
            import os, signal, threading, time
            def _die():
                path = os.path.join({str(workdir)!r}, "metrics.jsonl")
                while True:
                    time.sleep(0.05)
                    if os.path.exists(path) and sum(1 for _ in open(path)) >= {die_after_step}:
                        os.kill(os.getpid(), signal.SIGKILL)
            if os.environ["MESHKIT_PROCESS_ID"] == "1":
                threading.Thread(target=_die, daemon=True).start()
        """)
    code += f"sys.exit(main(['train', *{args!r}]))\n"
    return [sys.executable, "-c", code]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same run in this process, on 8 simulated devices."""
    workdir = tmp_path_factory.mktemp("one")
    return train(load_config(None, [*SMALL, *STEPS, f"train.workdir={workdir}"]), verbose=False)


def _same_losses_as(single, workdir, rtol=2e-5, steps=20):
    """Every step's loss of the run in ``workdir`` equals the single-process run's."""
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], [loss for _, loss in single.losses],
                               rtol=rtol)
    return rows


def test_two_processes_train_like_one_each_loading_only_its_rows(single, tmp_path):
    workdir, logs = tmp_path / "run", tmp_path / "rows"
    logs.mkdir()
    result, out = _launch(_train_command(workdir, record_rows=logs))
    assert result.returncode == 0, out[-3000:]
    assert "(2 processes)" in out
    _same_losses_as(single, workdir)
    # Process i holds devices 4i..4i+3, so rows 8i..8i+7 of the 16: it draws those rows
    # of every train and eval batch, and never a row of the other process.
    for process in (0, 1):
        calls = [json.loads(line) for line in (logs / f"rows.{process}.jsonl").open()]
        own = [8 * process, 8 * process + 8]
        assert sorted((split, step) for split, step, _, _ in calls) == (
            [("eval", 0)] + [("train", step) for step in range(20)]), calls
        assert all(rows == own and n == 8 for _, _, rows, n in calls), calls


def test_a_dead_peer_ends_the_job_and_the_run_resumes(single, tmp_path):
    workdir = tmp_path / "two"
    killed, out = _launch(_train_command(workdir, die_after_step=7))
    assert killed.returncode == 137 and killed.failed == 1, out[-3000:]
    assert re.search(r"process 1 \(pid \d+\) was killed by SIGKILL first \(exit code 137\)",
                     out)
    # The survivor reports the lost peer in one line (exit 5) or ends on the launcher's
    # SIGTERM first; never "internal error: this is a bug".
    assert "internal error" not in out, out[-3000:]
    assert killed.seconds_to_stop < 30
    print(f"launcher ended the job {killed.seconds_to_stop:.2f} s after process 1 died")

    resumed, out = _launch(_train_command(workdir))
    assert resumed.returncode == 0, out[-3000:]
    assert "resuming from step" in out
    rows = _same_losses_as(single, workdir)

    # The 2-process checkpoint restores in this single process with 8 devices.
    restored = train(load_config(None, [*SMALL, *STEPS, f"train.workdir={workdir}"]),
                     verbose=False)
    assert restored.start_step == 20 and restored.losses == []
    assert restored.eval_loss == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)
    assert restored.eval_loss == pytest.approx(single.eval_loss, rel=1e-4)


# Pipeline over the process boundary, tensor and experts inside each process: the way a
# pipeline is deployed over slow links. Activations and their gradients cross processes.
PP_TP = ["mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp", "parallel.tensor=tp",
         "parallel.microbatches=2", "exchange.device_axis=[]", "model.num_layers=2",
         "train.steps=8"]


@pytest.fixture(scope="module")
def single_pp_tp(tmp_path_factory):
    """The pipeline run in this process under GPipe: the reference of every schedule."""
    workdir = tmp_path_factory.mktemp("pp-one")
    return train(load_config(None, [*SMALL, *STEPS, *PP_TP, f"train.workdir={workdir}"]),
                 verbose=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_across_processes_trains_like_one_process(single_pp_tp, schedule, tmp_path):
    extra = [*PP_TP, f"parallel.schedule={schedule}"]
    result, out = _launch(_train_command(tmp_path / "two", extra=extra))
    assert result.returncode == 0, out[-3000:]
    assert "(2 processes); roles pp=2 pipeline, tp=2 tensor, node=2 expert; workdir " in out
    _same_losses_as(single_pp_tp, tmp_path / "two", rtol=1e-5, steps=8)
