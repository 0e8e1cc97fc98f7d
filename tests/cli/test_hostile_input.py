"""Hostile input ends quickly in one line and exit 2 (issue 23, second adversarial round).

Alias bombs, astronomically large device counts and hostile topology files: each must be
refused in well under a second, naming the file, key or flag, never hang or print a
traceback. Every subprocess has a timeout so that a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshkit._fs import MAX_TEXT_FILE_BYTES
from meshkit._yamlfile import MAX_ALIAS_EXPANSION, YAMLFileError, load_yaml
from meshkit.cli import main

SCRIPT = Path(sys.executable).parent / "meshkit"  # the installed console script
# Each level repeats the one before nine times: 9**9 (387 million) values at the end.
BOMB = "\n".join(
    ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
) + "\n"
LINK = "{latency_s: 1.0e-6, bandwidth_Bps: 1.0e9}"
TOPOLOGY = (f"devices_per_node: 8\ninter: {LINK}\nintra: {LINK}\n"
            "memory_bandwidth_Bps: 1.0e12\nflops_per_s: 1.0e12\n")


def run_cli(*args: str, timeout: float = 20) -> tuple[subprocess.CompletedProcess[str], float]:
    """The console script, bounded: a hang fails the test after ``timeout`` seconds."""
    start = time.perf_counter()
    done = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
    return done, time.perf_counter() - start


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ alias bombs


def test_a_topology_file_alias_bomb_is_refused_quickly_naming_the_file(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"measured:\n  {BOMB.replace(chr(10), chr(10) + '  ')}inter: *a8\n")
    done, seconds = run_cli("plan", "--topology", str(bomb), "--devices", "8")
    line = one_line(done.stderr)
    assert done.returncode == 2, line
    assert f"topology file {bomb}: invalid YAML: aliases expand" in line
    assert seconds < 10  # it hung past 40 s before


def test_a_config_file_alias_bomb_is_refused_naming_the_file(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    # All in one value, as a section's keys must be known (it hung past 15 s before).
    value = "[&a0 [x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)) + "]"
    bomb.write_text(f"model:\n  num_experts: {value}\n")
    assert main(["config", str(bomb)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{bomb}: invalid YAML: aliases expand the document by more than" in line


def test_an_override_alias_bomb_is_refused_naming_the_key(capsys):
    levels = "[&a [1, 1, 1, 1, 1, 1, 1, 1, 1], " + ", ".join(
        [f"&b{i} [" + ", ".join([f"*{'a' if i == 0 else f'b{i - 1}'}"] * 9) + "]"
         for i in range(7)]) + "]"
    assert main(["config", f"model.num_experts={levels}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("meshkit config: error: model.num_experts: invalid YAML: aliases")


def test_a_recursive_alias_is_refused():
    with pytest.raises(YAMLFileError, match=r"^x: invalid YAML: an alias refers to its own"):
        load_yaml("a: &a {b: 1, c: *a}", where="x")


def test_aliases_that_stay_small_still_load():
    text = "a: &a [1, 2]\nb: *a\nc: &c {x: *a}\nd: *c"
    assert load_yaml(text, where="x") == {"a": [1, 2], "b": [1, 2], "c": {"x": [1, 2]},
                                          "d": {"x": [1, 2]}}

    def wide(aliases: int) -> str:  # each alias adds 101 values: the list and its 100
        return ("a: &a [" + ", ".join(["0"] * 100) + "]\nb: ["
                + ", ".join(["*a"] * aliases) + "]")

    assert len(load_yaml(wide(99), where="x")["b"]) == 99  # 9,999 values added: allowed
    with pytest.raises(YAMLFileError, match=f"more than {MAX_ALIAS_EXPANSION:,} values"):
        load_yaml(wide(100), where="x")


def test_a_long_value_is_shortened_while_its_text_is_built(capsys):
    values = "&a [" + ", ".join(["123456789"] * 90) + "]"
    many = "[" + values + ", " + ", ".join(["*a"] * 100) + "]"
    assert main(["config", f"model.num_experts={many}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert len(line) < 400, line


# ------------------------------------------------------------------ device counts


@pytest.mark.parametrize(("args", "line"), [
    (["--devices", "1099511627776"], "meshkit plan: error: --devices: 1099511627776 devices "
     "are more than the planner's limit of 1,048,576 (2**20)"),
    (["--preset", "h100-8x400g", "--nodes", "1" + "0" * 20], "meshkit plan: error: --nodes: "
     "100000000000000000000 nodes are more than the planner's limit of 1,048,576 (2**20) "
     "devices"),
])
def test_an_astronomical_device_count_is_refused_at_once(args, line):
    done, seconds = run_cli("plan", *args)
    assert (done.returncode, one_line(done.stderr)) == (2, line)
    assert seconds < 10  # both ran past 60 s before


@pytest.mark.parametrize(("args", "message"), [
    (["--preset", "h100-8x400g", "--nodes", str(2**17 + 1)], "--nodes: 1048584 devices are "
     "more than"),
    (["--devices", "720720"], "--devices: 720720 devices split into the five roles in "
     "656,250 ways, more than the planner's limit of 20,000"),
])
def test_device_counts_past_the_limits_name_the_flag(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in one_line(capsys.readouterr().err)


def test_the_divisor_enumeration_matches_the_count():
    from meshkit.plan.planner import _factorisation_count, _factorisations

    for n in (1, 2, 7, 12, 360, 1024, 2 * 3 * 5 * 7):
        tuples = list(_factorisations(n, 5))
        assert len(tuples) == len(set(tuples)) == _factorisation_count(n, 5)
        assert all(a * b * c * d * e == n for a, b, c, d, e in tuples)


# ------------------------------------------------------------------ topology files

BIG = str(10**400)


@pytest.mark.parametrize(("text", "message"), [
    (TOPOLOGY.replace("latency_s: 1.0e-6", f"latency_s: {BIG}", 1),
     "inter.latency_s must be finite and >= 0, got an integer of 401 digits"),
    (TOPOLOGY.replace("1.0e12\nflops", f"{BIG}\nflops"),
     "memory_bandwidth_Bps must be finite and > 0, got an integer of 401 digits"),
    (TOPOLOGY.replace("devices_per_node: 8", f"devices_per_node: {BIG}"),
     "devices_per_node must be between 1 and 1,048,576, got an integer of 401 digits"),
    (TOPOLOGY + f"memory_bytes: {BIG}\n", "memory_bytes must be between 1,048,576 and"),
    (TOPOLOGY + "1: 3\nx: 3\n", "key 1 is not a string (keys: devices_per_node,"),
    (TOPOLOGY.replace("1.0e9}", "1.0e9, 3: 4}", 1), "inter: key 3 is not a string"),
    (TOPOLOGY.replace("flops_per_s: 1.0e12", "flops_per_s: 1.0e-300"),
     "flops_per_s must be between 1e+06 and 1e+18, got 1e-300"),
    (TOPOLOGY.replace("flops_per_s: 1.0e12", "flops_per_s: .nan"),
     "flops_per_s must be finite and > 0, got nan"),
    (TOPOLOGY.replace("bandwidth_Bps: 1.0e9", "bandwidth_Bps: 1.0e-300", 1),
     "inter.bandwidth_Bps must be between 1000 and 1e+15, got 1e-300"),
    (TOPOLOGY.replace("latency_s: 1.0e-6", "latency_s: 3600", 1),
     "inter.latency_s must be between 0 and 1, got 3600"),
    (TOPOLOGY + "memory_bytes: 1\n", "memory_bytes must be between 1,048,576 and"),
])
def test_a_topology_value_out_of_range_is_one_line_naming_file_and_key(text, message,
                                                                       tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    assert main(["plan", "--topology", str(path), "--devices", "8"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"meshkit plan: error: --topology: topology file {path}: "), line
    assert message in line


def test_a_topology_with_huge_ints_and_mixed_keys_is_one_line_from_the_shell(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(TOPOLOGY.replace("flops_per_s: 1.0e12", f"flops_per_s: {BIG}")
                    + "1: 3\nx: 3\n")
    done, _ = run_cli("plan", "--topology", str(path), "--devices", "8")
    assert done.returncode == 2
    assert "key 1 is not a string" in one_line(done.stderr)  # was a TypeError traceback
    path.write_text(TOPOLOGY.replace("flops_per_s: 1.0e12", f"flops_per_s: {BIG}"))
    done, _ = run_cli("plan", "--topology", str(path), "--devices", "8")
    assert done.returncode == 2  # was an OverflowError traceback
    assert "flops_per_s must be finite and > 0" in one_line(done.stderr)


def test_a_valid_topology_file_still_plans(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(TOPOLOGY + "memory_bytes: 85899345920\n")
    assert main(["plan", "--topology", str(path), "--devices", "16", "--top", "1"]) == 0
    assert "2 node(s) × 8 devices" in capsys.readouterr().out


def test_a_topology_whose_predictions_are_not_finite_is_refused():
    from meshkit.config import load_config
    from meshkit.exchange.cost import Link, Topology
    from meshkit.plan.config_plan import plan
    from meshkit.plan.planner import PlanError

    tiny = Topology(1, 8, Link(0.0, 1e9), Link(0.0, 1e9), 1e12, flops_per_s=1e-320)
    with pytest.raises(PlanError, match="not finite"):
        plan(load_config(None), devices=8, topology=tiny)


# ------------------------------------------------------------------ the mesh plan replaces


def test_plan_ignores_the_mesh_it_replaces_from_the_shell():
    # The default mesh has 8 expert devices, which 3 experts do not divide: irrelevant,
    # since the planner lays the devices out itself.
    done, _ = run_cli("plan", "model.num_experts=3", "--devices", "8", "--top", "1")
    assert done.returncode == 0, done.stderr
    assert "layouts fit on 1 node(s) × 8 devices" in done.stdout


def test_plan_keeps_max_nodes_and_judges_it_per_layout(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    assert main(["plan", "model.num_experts=16", "model.max_nodes=2", "--devices", "16",
                 "--top", "1", "--write", str(out)]) == 0
    from meshkit.config import load_config

    assert load_config(out).model.max_nodes == 2
    capsys.readouterr()
    assert main(["plan", "model.max_nodes=0", "--devices", "8"]) == 2  # a section rule
    assert "model.max_nodes: input should be greater than or equal to 1" in one_line(
        capsys.readouterr().err)
    assert main(["plan", "model.max_nodes=9", "--devices", "8"]) == 2  # every layout
    assert one_line(capsys.readouterr().err).startswith(
        "meshkit plan: error: model.max_nodes: no layout of 8 devices")


# ------------------------------------------------------------------ outputs


@pytest.mark.parametrize("command", [["plan", "--devices", "8"], ["mesh"], ["config"]])
def test_stdout_on_a_full_disk_is_one_line_exit_2(command):
    with open("/dev/full", "w") as full:
        done = subprocess.run([SCRIPT, *command], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=20)
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr) == (f"meshkit {command[0]}: error: cannot write to standard "
                                     "output (/dev/full): No space left on device")


@pytest.mark.parametrize(("command", "flag"), [
    (["plan", "--devices", "8", "--write"], "--write"),
    (["calibrate", "--processes", "1", "--quick", "-o"], "--output"),
])
def test_an_output_file_that_cannot_be_written_is_named_before_the_work(command, flag,
                                                                       tmp_path, capsys):
    folder = tmp_path / "out.yaml"
    folder.mkdir()
    assert main([*command, str(folder)]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        f"error: {flag}: cannot write {folder}: it is a directory")
    # /proc takes no new files, even from root (a chmod'ed directory would not stop root).
    assert main([*command, "/proc/meshkit-out.yaml"]) == 2
    assert f"error: {flag}: cannot write /proc/meshkit-out.yaml: " in one_line(
        capsys.readouterr().err)



# ------------------------------------------------------------------ files that are not files


@pytest.fixture
def fifo(tmp_path):
    """A named pipe, and a watchdog that writes to it after 10 s: a reader that blocks on
    it fails its test instead of hanging the suite."""
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(10):  # a reader or a writer blocked in open: let it through
            with contextlib.suppress(OSError):
                reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                os.close(reader)

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    yield path
    done.set()
    watchdog.join()


@pytest.mark.parametrize(("args", "what"), [
    (["config"], "config file"),
    (["plan", "--model"], "--model file"),
    (["plan", "--devices", "8", "--topology"], "topology file"),
])
def test_a_named_pipe_is_refused_at_once_naming_it(args, what, fifo, capsys):
    start = time.perf_counter()
    assert main([*args, str(fifo)]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        f" {what} {fifo} is a named pipe (FIFO), not a regular file")
    assert time.perf_counter() - start < 5  # it waited for a writer before


def test_a_device_is_refused_without_reading_it(capsys):
    # /dev/zero was read until MemoryError, then reported as a bug.
    assert main(["config", "/dev/zero"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "meshkit config: error: config file /dev/zero is a character device, not a regular "
        "file")


def test_a_file_over_the_size_limit_is_refused_naming_the_limit(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_TEXT_FILE_BYTES + "\n")
    assert main(["plan", "--model", str(big)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"meshkit plan: error: --model file {big} is larger than 1 MiB, the most meshkit "
        "reads as a --model file")
    big.write_text("# " + "x" * (MAX_TEXT_FILE_BYTES - 10) + "\n")  # just under: read
    assert main(["config", str(big)]) == 0  # only a comment: the defaults


def _full(tmp_path, name):
    """A link to /dev/full, which takes no byte: the file a write must not report done."""
    link = tmp_path / name
    link.symlink_to("/dev/full")
    return link


def _still_full(link):
    assert link.is_symlink() and os.readlink(link) == "/dev/full"  # neither replaced


@pytest.mark.parametrize(("command", "flag"), [
    (["plan", "--devices", "8", "--write"], "--write"),
    (["calibrate", "--processes", "1", "--quick", "-o"], "--output"),
])
def test_an_output_file_that_takes_no_bytes_is_one_line_exit_2(command, flag, tmp_path,
                                                              monkeypatch, capsys):
    import meshkit.plan.calibrate as calibrate_module

    link = _full(tmp_path, "out.yaml")
    intra = {"latency_s": 1e-6, "bandwidth_Bps": 1e9}
    measured = {"devices_per_node": 8, "intra": intra, "memory_bandwidth_Bps": 1e12,
                "flops_per_s": 1e12, "memory_bytes": None, "measured": {}}
    monkeypatch.setattr(calibrate_module, "calibrate", lambda **kw: measured)  # no minutes
    assert main([*command, str(link)]) == 2  # calibrate exited 0 before
    assert one_line(capsys.readouterr().err).endswith(
        f"error: {flag}: cannot write {link}: No space left on device")
    _still_full(link)


def test_a_figure_and_a_benchmark_report_that_cannot_be_written_are_named(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from meshkit.benchmarks._report import Report
    from meshkit.errors import UsageError

    link = _full(tmp_path, "mesh.png")
    assert main(["mesh", "--plot", str(link)]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        f"error: cannot write {link}: No space left on device")
    _still_full(link)
    report = Report("groups", [], str(_full(tmp_path, "report.json")))
    with pytest.raises(UsageError, match=r"^--json: cannot write .*report\.json: No space"):
        report.write()


def test_an_output_to_a_device_or_pipe_is_written_in_place(fifo, tmp_path, capsys):
    null = tmp_path / "null.yaml"
    null.symlink_to("/dev/null")
    assert main(["plan", "--devices", "8", "--write", str(null)]) == 0
    assert null.is_symlink() and Path("/dev/null").is_char_device()
    capsys.readouterr()
    # A named pipe that no process reads: refused at once, not waited on.
    assert main(["plan", "--devices", "8", "--write", str(fifo)]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        f"error: --write: cannot write {fifo}: no process reads the named pipe")
