"""A multi-process job that cannot form, or loses a process (issue 23).

Each ends in one line with a documented code, within a bound: a coordinator nobody
listens at (exit 2, not JAX's abort, 134), and a peer killed with SIGKILL in the middle
of a collective (exit 5 for the survivor, not "internal error: this is a bug"). Real
processes, real gloo collectives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from meshkit.errors import EXIT_PEER_LOST, EXIT_USAGE, UsageError
from meshkit.runtime.distributed import connect_timeout
from meshkit.runtime.launch import free_port

PY = sys.executable

# Joins the job, then all-reduces across the 2 processes until it fails, through the
# scripts' command-line boundary (meshkit.cli.script), as a benchmark would.
COLLECTIVES = """
import os, sys
from meshkit.cli import script
def main(argv):
    from meshkit.runtime.distributed import initialize
    initialize(prog="meshkit bench peers")
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(jax.devices(), ("p",))
    total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "p"), mesh=mesh,
                                  in_specs=P("p"), out_specs=P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), jnp.ones((1,)))
    for i in range(10**9):
        total(x).block_until_ready()
        if i == 2:
            print("ready", flush=True)
    return 0
raise SystemExit(script.run(main, "peers"))
"""


def _env(coordinator: str, process: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "MESHKIT_COORDINATOR": coordinator, "MESHKIT_NUM_PROCESSES": "2",
            "MESHKIT_PROCESS_ID": str(process), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **extra}


def test_an_unreachable_coordinator_is_one_line_and_exit_2_not_an_abort():
    coordinator = f"127.0.0.1:{free_port()}"  # free: nobody listens there
    done = subprocess.run(
        [PY, "-c", "from meshkit.runtime.distributed import initialize\n"
                   "initialize(prog='meshkit train')"],
        env=_env(coordinator, 1, MESHKIT_CONNECT_TIMEOUT="1"), capture_output=True,
        text=True, timeout=60)
    assert done.returncode == EXIT_USAGE, done.stderr[-3000:]
    assert done.stderr == (
        "meshkit train: error: process 1 could not join the 2-process job within 1 s "
        "(MESHKIT_CONNECT_TIMEOUT): nothing answers at the coordinator "
        f"MESHKIT_COORDINATOR={coordinator}\n")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x", "1e9"])
def test_a_connect_timeout_that_is_not_a_positive_number_is_named(value):
    with pytest.raises(UsageError, match=f"MESHKIT_CONNECT_TIMEOUT='{value}': must be a "
                       r"number of seconds in \(0, 86400\]"):
        connect_timeout({"MESHKIT_CONNECT_TIMEOUT": value})
    assert connect_timeout({}) == 120.0


def test_a_peer_killed_mid_collective_is_one_line_and_exit_5_for_the_survivor(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([PY, "-c", COLLECTIVES], env=_env(coordinator, i),
                              stdout=(tmp_path / f"{i}.out").open("w"),
                              stderr=(tmp_path / f"{i}.err").open("w"))
             for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not all("ready" in (tmp_path / f"{i}.out").read_text() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                (tmp_path / f"{i}.err").read_text()[-2000:] for i in range(2)]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        code = procs[0].wait(timeout=15)  # well before the 20 s heartbeat abort
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    err = (tmp_path / "0.err").read_text()
    lines = [x for x in err.splitlines() if "[Gloo]" not in x]  # gloo's own start-up chatter
    assert code == EXIT_PEER_LOST, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        "meshkit bench peers: error: process 0 of 2 lost another process of the job ("), err
    assert "by peer" in lines[0] and "launcher's or the scheduler's log" in lines[0]


def test_the_command_line_maps_a_lost_peer_in_a_chained_error(monkeypatch, capsys):
    import jax

    import meshkit.cli  # noqa: F401  (meshkit.cli.main is the module; the name is a function)

    cli = sys.modules["meshkit.cli.main"]

    def fails(args):
        try:
            raise ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error "
                             "[127.0.0.1]:18311: Connection reset by peer")
        except ValueError:
            raise RuntimeError("closing the checkpointer failed") from None

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(cli, "_cmd_mesh", fails)
    assert cli.main(["mesh"]) == EXIT_PEER_LOST
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lost another process of the job (UNKNOWN: Gloo " in err
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)  # one process: a bug
    assert cli.main(["mesh"]) == 1
