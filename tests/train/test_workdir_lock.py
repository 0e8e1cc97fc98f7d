"""One run per workdir: the lock refuses a second live run, and a dead run's is taken over."""

import fcntl
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.cli import main
from meshkit.training.workdir_lock import WorkdirLocked, lock_workdir


def test_a_live_holder_is_refused_naming_its_pid_and_the_lock_is_released_after(tmp_path):
    with lock_workdir(str(tmp_path)) as path:
        assert Path(path).read_text() == f"{os.getpid()} {socket.gethostname()}\n"
        with (pytest.raises(WorkdirLocked, match=rf"^train.workdir: {tmp_path} is in use by "
                            rf"another run \(PID {os.getpid()} on host "),
              lock_workdir(str(tmp_path))):
            pass
    assert not os.path.exists(path)
    with lock_workdir(str(tmp_path)):  # free again
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / ".lock").write_text(f"{dead} otherhost\n")
    with lock_workdir(str(tmp_path)) as path:
        assert Path(path).read_text().startswith(f"{os.getpid()} ")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"meshkit: warning: taking over the lock {tmp_path}/.lock left by "
                        f"PID {dead} on host otherhost, which no longer holds it (that run "
                        "ended without removing it)"]


def test_meshkit_train_on_a_workdir_in_use_exits_2_naming_the_pid(tmp_path, capsys,
                                                                  monkeypatch):
    from meshkit.training import loop

    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the workdir is in use")

    monkeypatch.setattr(loop, "Programs", refuse)
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242 node7\n")  # as another live run would have written
    try:
        code = main(["train", "model.d_model=16", "model.num_heads=2", "model.d_ff=16",
                     "model.num_layers=1", "train.batch_size=8", "train.seq_len=8",
                     f"train.workdir={tmp_path}", "--no-progress"])
    finally:
        os.close(fd)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"meshkit train: error: train.workdir: {tmp_path} is in use by another "
                      f"run (PID 4242 on host node7, lock {tmp_path}/.lock); wait for it to "
                      "end, or use another train.workdir")
