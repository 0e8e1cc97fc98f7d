"""The local launcher and distributed start-up: environment, output, failure handling."""

import io
import os
import re
import sys
import time

import pytest
from _procs import kill

from meshkit.runtime.distributed import launcher_env, num_processes_from_env
from meshkit.runtime.launch import launch, process_env

PY = sys.executable


def test_process_env_replaces_the_device_flag():
    base = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8", "A": "b"}
    env = process_env(base, "127.0.0.1:5", 3, 2, 4)
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert (env["MESHKIT_COORDINATOR"], env["MESHKIT_NUM_PROCESSES"],
            env["MESHKIT_PROCESS_ID"], env["A"]) == ("127.0.0.1:5", "3", "2", "b")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MESHKIT_COORDINATOR": "x:1"}, r"incomplete: \['MESHKIT_NUM_PROCESSES', "),
        ({"MESHKIT_COORDINATOR": "x:1", "MESHKIT_NUM_PROCESSES": "two",
          "MESHKIT_PROCESS_ID": "0"}, "MESHKIT_NUM_PROCESSES='two' is not an integer"),
        ({"MESHKIT_COORDINATOR": "x:1", "MESHKIT_NUM_PROCESSES": "2",
          "MESHKIT_PROCESS_ID": "2"}, "MESHKIT_PROCESS_ID=2 out of range"),
        # JAX's own parse of these is a traceback (an IndexError for a missing port).
        ({"MESHKIT_COORDINATOR": "127.0.0.1", "MESHKIT_NUM_PROCESSES": "2",
          "MESHKIT_PROCESS_ID": "1"}, "MESHKIT_COORDINATOR='127.0.0.1': must be HOST:PORT"),
        ({"MESHKIT_COORDINATOR": "127.0.0.1:http", "MESHKIT_NUM_PROCESSES": "2",
          "MESHKIT_PROCESS_ID": "1"}, "MESHKIT_COORDINATOR='127.0.0.1:http': the port must"),
    ],
)
def test_bad_launcher_env(env, message):
    with pytest.raises(ValueError, match=message):
        launcher_env(env)


def test_num_processes_from_env():
    assert num_processes_from_env({}) == 1
    assert num_processes_from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == 4
    assert num_processes_from_env({"MESHKIT_COORDINATOR": "h:1", "MESHKIT_NUM_PROCESSES": "3",
                                   "MESHKIT_PROCESS_ID": "0"}) == 3


def test_output_is_prefixed_and_success_is_zero():
    out = io.StringIO()
    code = "import os; print('hello from', os.environ['MESHKIT_PROCESS_ID'])"
    result = launch([PY, "-c", code], 3, out=out)
    assert result.returncode == 0 and result.failed is None
    lines = sorted(out.getvalue().splitlines())
    assert lines == ["[0] hello from 0", "[1] hello from 1", "[2] hello from 2"]


def test_first_failure_ends_the_others_quickly():
    out = io.StringIO()
    code = ("import os, sys, time\n"
            "if os.environ['MESHKIT_PROCESS_ID'] == '1':\n"
            "    time.sleep(0.5); sys.exit(7)\n"
            "time.sleep(120)\n")
    start = time.monotonic()
    result = launch([PY, "-c", code], 3, timeout_s=10, out=out)
    assert (result.returncode, result.failed) == (7, 1)
    assert time.monotonic() - start < 15 and result.seconds_to_stop < 5
    assert re.search(r"process 1 \(pid \d+\) failed first \(exit code 7\)", out.getvalue())


def test_a_process_that_ignores_sigterm_is_killed_within_the_bound():
    code = ("import os, signal, sys, time\n"
            "if os.environ['MESHKIT_PROCESS_ID'] == '0':\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True)\n"
            "    time.sleep(120)\n"
            "time.sleep(1); os.kill(os.getpid(), 9)\n")
    result = launch([PY, "-c", code], 2, timeout_s=4, out=io.StringIO())
    assert (result.returncode, result.failed) == (137, 1)
    assert 1.5 < result.seconds_to_stop < 4


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [([], {}, "no command given"), ([PY], {"num_processes": 0}, "-n must be ≥ 1"),
     ([PY], {"num_processes": 1, "devices_per_process": 0}, "--devices-per-process")],
)
def test_launch_errors(args, kwargs, message):
    kwargs.setdefault("num_processes", 1)
    with pytest.raises(ValueError, match=message):
        launch(args, **kwargs)


def test_process_env_drops_an_inherited_count_when_the_command_chooses():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"}
    assert process_env(base, "c", 2, 0, None)["XLA_FLAGS"] == "--xla_foo=1"
    assert "XLA_FLAGS" not in process_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, "c", 2, 0, None)


def test_the_earliest_death_is_blamed_not_the_lowest_id():
    code = ("import os, sys, time\n"
            "i = int(os.environ['MESHKIT_PROCESS_ID'])\n"
            "time.sleep({0: 1.5, 1: 120, 2: 0.3}[i]); sys.exit(10 + i)\n")
    result = launch([PY, "-c", code], 3, timeout_s=10, out=io.StringIO())
    assert (result.returncode, result.failed) == (12, 2)


def test_kubernetes_jobset_counts_as_a_cluster(monkeypatch):
    from meshkit.runtime.distributed import _in_cluster

    assert _in_cluster({"JOBSET_NAME": "train"})
    assert _in_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"})
    assert not _in_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"})
    assert not _in_cluster({})


def test_set_cpu_device_count_respects_the_user():
    from meshkit.runtime.distributed import set_cpu_device_count

    env = {"JAX_NUM_CPU_DEVICES": "2"}
    assert not set_cpu_device_count(8, env) and env == {"JAX_NUM_CPU_DEVICES": "2"}
    assert set_cpu_device_count(8, env, replace=True)
    assert env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    with pytest.raises(ValueError, match="must be ≥ 1, got 0"):
        set_cpu_device_count(0, {})


def test_meshkit_launch_cli_runs_the_command_after_double_dash(capfd):
    from meshkit.cli import main

    code = "import os; print('id', os.environ['MESHKIT_PROCESS_ID'])"
    assert main(["launch", "-n", "2", "--", PY, "-c", code]) == 0
    out = capfd.readouterr().out
    assert "[0] id 0" in out and "[1] id 1" in out
    assert main(["launch", "-n", "2", "--", PY, "-c", "import sys; sys.exit(4)"]) == 4


# ------------------------------------------------------------- signals and orphans
#
# The launcher runs as the console script would (python -m meshkit.cli), its processes
# each start a grandchild in their process group, and every PID must be gone at the end.

CHILD = """
import os, signal, subprocess, sys, time
me = os.environ["MESHKIT_PROCESS_ID"]
grandchild = subprocess.Popen(["sleep", "120"])
{setup}
print("pids", os.getpid(), grandchild.pid, flush=True)
{then}
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be read


def _start(tmp_path, setup="", then="", *flags):
    import queue
    import subprocess
    import threading

    code = CHILD.format(setup=setup.replace("MARK", repr(str(tmp_path / "got"))), then=then)
    launcher = subprocess.Popen(
        [PY, "-m", "meshkit.cli", "launch", "-n", "2", *flags, "--", PY, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout], daemon=True).start()
    pids, seen = [], []
    while len(pids) < 4:
        line = lines.get(timeout=30)
        seen.append(line)
        if " pids " in line:
            pids += [int(x) for x in line.split()[2:]]
    return launcher, pids, lines, seen


def _finish(launcher, pids, lines, seen, timeout=30):
    code = launcher.wait(timeout=timeout)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "orphans left running"
    while not lines.empty():
        seen.append(lines.get())
    return code, "".join(seen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_is_forwarded_with_a_grace_period_and_nothing_survives(tmp_path, name):
    import signal

    # Each process saves (here: touches a file) on the signal and exits 4, "preempted".
    setup = ("def stop(signum, frame):\n"
             "    open(MARK + me, 'w').close(); sys.exit(4)\n"
             f"signal.signal(signal.{name}, stop)")
    launcher, pids, lines, seen = _start(tmp_path, setup)
    try:
        assert all(_alive(p) for p in pids)
        launcher.send_signal(getattr(signal, name))
        code, out = _finish(launcher, pids, lines, seen)
    finally:
        kill([launcher.pid, *pids])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got0", "got1"]
    assert code == 4, out
    assert f"got {name}; forwarded it to 2 processes, all ended in" in out


def test_sigint_escalates_to_sigkill_after_the_grace_period(tmp_path):
    import signal

    launcher, pids, lines, seen = _start(
        tmp_path, "signal.signal(signal.SIGINT, signal.SIG_IGN)", "", "--grace", "1")
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    code, out = _finish(launcher, pids, lines, seen)
    assert code == 130, out
    assert 1 <= time.monotonic() - start < 10
    assert "got SIGINT; forwarded it to 2 processes, killed what was left after 1 s" in out


def test_a_second_signal_ends_the_grace_period_at_once(tmp_path):
    import signal

    launcher, pids, lines, seen = _start(
        tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)", "", "--grace", "120")
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    code, out = _finish(launcher, pids, lines, seen)
    assert code == 143 and time.monotonic() - start < 10, out


def test_a_dead_child_takes_every_group_down(tmp_path):
    launcher, pids, lines, seen = _start(
        tmp_path, "", "if me == '1':\n    time.sleep(0.5); sys.exit(3)")
    code, out = _finish(launcher, pids, lines, seen)
    process_1 = next(int(x.split()[2]) for x in seen if x.startswith("[1] pids "))
    assert code == 3 and f"process 1 (pid {process_1}) failed first (exit code 3)" in out


def test_a_child_killed_with_sigkill_is_named_with_its_signal(tmp_path):
    import signal

    launcher, pids, lines, seen = _start(tmp_path)
    process_1 = next(int(x.split()[2]) for x in seen if x.startswith("[1] pids "))
    os.kill(process_1, signal.SIGKILL)
    code, out = _finish(launcher, pids, lines, seen)
    assert code == 137, out
    assert (f"meshkit launch: process 1 (pid {process_1}) was killed by SIGKILL first "
            "(exit code 137)") in out
    assert "internal error" not in out and "Traceback" not in out


def test_what_successful_processes_leave_behind_is_ended(tmp_path):
    launcher, pids, lines, seen = _start(tmp_path, "", "sys.exit(0)")
    code, out = _finish(launcher, pids, lines, seen)
    assert code == 0, out


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path):
    import signal

    # SIGKILL: the launcher runs no clean-up; its reaper must end both groups.
    launcher, pids, lines, seen = _start(tmp_path)
    start = time.monotonic()
    launcher.send_signal(signal.SIGKILL)
    code, out = _finish(launcher, pids, lines, seen)  # every pid gone within 5 s
    assert code == -signal.SIGKILL and time.monotonic() - start < 5, out


@pytest.mark.parametrize(
    ("command", "code", "message"),
    [
        (["/nonexistent/cmd"], 127, "command not found: /nonexistent/cmd"),
        (["meshkit-no-such-command-anywhere"], 127,
         "command not found: meshkit-no-such-command-anywhere"),
        (["NOT_EXECUTABLE"], 126, "NOT_EXECUTABLE is not executable"),
        (["DIRECTORY"], 126, "DIRECTORY is a directory"),
    ],
)
def test_a_command_that_cannot_run_exits_like_a_shell(command, code, message, tmp_path, capsys):
    from meshkit.cli import main

    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    paths = {"NOT_EXECUTABLE": str(script), "DIRECTORY": str(tmp_path)}
    command = [paths.get(c, c) for c in command]
    message = message.replace("NOT_EXECUTABLE", str(script)).replace("DIRECTORY", str(tmp_path))
    assert main(["launch", "-n", "2", "--", *command]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshkit launch: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("flag", ["--timeout", "--grace"])
@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_timeouts_must_be_positive_and_finite(flag, value, capsys):
    from meshkit.cli import main

    assert main(["launch", "-n", "1", flag, value, "--", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"meshkit launch: error: launch: {flag} must be a positive number of "
                   f"seconds, got {float(value)!r}")


# ------------------------------------------------------------- processes that disagree


def test_first_disagreement_names_the_first_differing_key():
    from meshkit.runtime.agree import _digest, first_disagreement

    mine = [("train.steps", 2), ("train.lr", 0.01), ("mesh.axes", {"a": 2})]
    theirs = [("train.steps", 2), ("train.lr", 0.02), ("mesh.axes", {"a": 4})]

    def two_processes(values):  # the other process's values, maximum taken elementwise
        other = [v for _, v in theirs]
        hashes = [_digest(v) for v in other]
        return [max(a, b) for a, b in zip(values, [*hashes, *(-h for h in hashes)])]

    assert first_disagreement(mine, agree=two_processes) == "train.lr"
    assert first_disagreement(mine, agree=lambda values: list(values)) is None


def test_processes_with_different_configs_stop_at_once_naming_the_key(tmp_path):
    import subprocess

    from _configs import SMALL

    # Each process gets another train.steps through its own command line: without the
    # start-up check, the one with fewer steps finishes and the other waits for a peer
    # in its next step's collective (for minutes).
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"exec {PY} -m meshkit.cli train {' '.join(SMALL)} train.log_every=1 "
        f"train.steps=$((2 + MESHKIT_PROCESS_ID)) train.workdir={tmp_path / 'run'} "
        "--no-progress\n")
    script.chmod(0o755)
    start = time.monotonic()
    done = subprocess.run([PY, "-m", "meshkit.cli", "launch", "-n", "2", "--", str(script)],
                          capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert time.monotonic() - start < 60
    for i, steps in ((0, 2), (1, 3)):
        assert (f"[{i}] meshkit train: error: train.steps differs between the processes "
                f"(process {i} of 2 has {steps}); every process must run the same config"
                ) in out


def test_a_coordinator_port_in_use_is_named_before_jax_starts(tmp_path):
    import socket
    import subprocess

    # Before: process 0's gRPC server crashed on the taken port (exit 139, a gRPC log).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "MESHKIT_COORDINATOR": f"127.0.0.1:{port}",
               "MESHKIT_NUM_PROCESSES": "2", "MESHKIT_PROCESS_ID": "0"}
        done = subprocess.run(
            [PY, "-m", "meshkit.cli", "train", f"train.workdir={tmp_path}", "--no-progress"],
            env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"meshkit train: error: MESHKIT_COORDINATOR='127.0.0.1:{port}': port {port} is "
        "already in use on this machine, so process 0 cannot start the coordinator there; "
        "choose a free port (meshkit launch picks one itself)\n")


def test_sigterm_after_jax_distributed_starts_is_not_swallowed(tmp_path):
    import subprocess

    from _configs import SMALL

    # jax.distributed.initialize puts JAX's preemption handler on SIGTERM, which records
    # it and carries on: process 1 used to train to the end (exit 0) as if never signalled.
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        "import meshkit.training.loop as loop\n"
        "train = loop.train\n"
        "def signalled(*args, **kwargs):\n"
        "    if os.environ['MESHKIT_PROCESS_ID'] == '1':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(5)\n"
        "    return train(*args, **kwargs)\n"
        "loop.train = signalled\n"
        "import meshkit.cli.main\n"
        "sys.modules['meshkit.cli.main'].run()\n")
    command = [PY, str(child), "train", *SMALL, "train.steps=3",
               f"train.workdir={tmp_path / 'run'}", "--no-progress"]
    done = subprocess.run([PY, "-m", "meshkit.cli", "launch", "-n", "2", "--", *command],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stdout[-3000:]
    assert "[1] meshkit train: stopped by SIGTERM\n" in done.stdout
    assert re.search(r"process 1 \(pid \d+\) failed first \(exit code 143\)", done.stdout)
