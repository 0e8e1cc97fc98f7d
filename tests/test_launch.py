"""The local launcher and distributed start-up: environment, output, failure handling."""

import io
import sys
import time

import pytest

from meshkit.distributed import launcher_env, num_processes_from_env
from meshkit.launch import launch, process_env

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
    assert "process 1 failed first (exit code 7)" in out.getvalue()


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
    from meshkit.distributed import _in_cluster

    assert _in_cluster({"JOBSET_NAME": "train"})
    assert _in_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"})
    assert not _in_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"})
    assert not _in_cluster({})


def test_set_cpu_device_count_respects_the_user():
    from meshkit.distributed import set_cpu_device_count

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
