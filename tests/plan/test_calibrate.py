"""``meshkit calibrate``: the link fit, and a topology file that plan and the exchange read."""

from __future__ import annotations

import logging
import re
import types

import pytest

import meshkit.plan.calibrate as calibrate_module
from meshkit.cli import main
from meshkit.config import ConfigError, load_config
from meshkit.errors import UsageError
from meshkit.exchange import cost
from meshkit.model.dispatchers import config_topology
from meshkit.plan.calibrate import OPS, calibrate, fit_link, run_calibrate, to_yaml
from meshkit.plan.config_plan import plan
from meshkit.plan.planner import sized_topology


def test_fit_link_recovers_latency_and_bandwidth_from_all_three_collectives() -> None:
    alpha, beta = 7e-6, 3e9
    rows = []
    for op, formula in OPS.items():
        for g in (2, 8):
            for size in (2**12, 2**20):
                messages, factor = formula(g)
                rows.append({"op": op, "group": g, "bytes": size,
                             "seconds": messages * alpha + factor * size / beta})
    link = fit_link(rows)
    assert link.latency_s == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(beta, rel=1e-6)


def test_fit_link_refuses_what_it_cannot_fit() -> None:
    row = {"op": "all-reduce", "group": 8, "bytes": 4096, "seconds": 1e-4}
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_link([row])
    shrinking = [row, {**row, "bytes": 2**20, "seconds": 1e-5}]
    with pytest.raises(ValueError, match="do not grow with the message size"):
        fit_link(shrinking)


def test_calibration_writes_a_file_plan_and_exchange_topology_accept(tmp_path) -> None:
    measured = calibrate(sizes=(2**12, 2**20), matmul=(64,), repeats=2)
    assert measured["devices_per_node"] == 8 and measured["flops_per_s"] > 0
    assert {r["op"] for r in measured["measured"]["intra"]} == set(OPS)
    measured["inter"] = dict(measured["intra"])
    path = tmp_path / "here.yaml"
    path.write_text(to_yaml(measured))
    topology = cost.load_topology(str(path), nodes=1)
    assert topology.intra == cost.Link(**measured["intra"])
    assert topology.flops_per_s == measured["flops_per_s"]
    assert plan(load_config(None), devices=8, topology=sized_topology(str(path), 8))
    config = load_config(None, [f"exchange.topology={path}"])
    assert config_topology(config).inter == topology.inter


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "expected a mapping"),
    ("{devices_per_node: 8}", "missing keys ['inter', 'intra', 'memory_bandwidth_Bps']"),
    ("{devices_per_node: 8, inter: {latency_s: 1e-6, bandwidth_Bps: 1e9}, intra: "
     "{latency_s: 1e-6, bandwidth_Bps: 1e9}, memory_bandwidth_Bps: 1e9, gpus: 8}",
     "unknown keys ['gpus']"),
    ("{devices_per_node: 8, inter: {latency_s: 1e-6}, intra: "
     "{latency_s: 1e-6, bandwidth_Bps: 1e9}, memory_bandwidth_Bps: 1e9}",
     "inter: missing keys ['bandwidth_Bps'] (keys: latency_s, bandwidth_Bps)"),
    ("{devices_per_node: 8, inter: [1], intra: "
     "{latency_s: 1e-6, bandwidth_Bps: 1e9}, memory_bandwidth_Bps: 1e9}",
     "inter must be a mapping of latency_s and bandwidth_Bps, got [1]"),
    ("{devices_per_node: 8, inter: {latency_s: 1e-6, bandwidth_Bps: -1}, intra: "
     "{latency_s: 1e-6, bandwidth_Bps: 1e9}, memory_bandwidth_Bps: 1e9}",
     "inter.bandwidth_Bps must be finite and > 0"),
    ("{devices_per_node: 0, inter: {latency_s: 1e-6, bandwidth_Bps: 1e9}, intra: "
     "{latency_s: 1e-6, bandwidth_Bps: 1e9}, memory_bandwidth_Bps: 1e9}",
     "devices_per_node must be an int >= 1"),
    ("a: [", "invalid YAML: "),
    ("{devices_per_node: 8, devices_per_node: 4}",  # one YAML reader: configs' rules
     "t.yaml: invalid YAML: duplicate key 'devices_per_node' (line 1, column 23)"),
])
def test_a_bad_topology_file_is_a_clear_error(tmp_path, text, message) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        cost.load_topology(str(path), nodes=1)
    with pytest.raises(ConfigError, match=re.escape("exchange.topology: topology file")):
        load_config(None, [f"exchange.topology={path}"])


def test_calibrate_refuses_bad_arguments(tmp_path) -> None:
    with pytest.raises(UsageError, match=re.escape("--output: 'x.json' must end in .yaml")):
        run_calibrate("x.json")
    with pytest.raises(UsageError, match=r"--output: directory .* does not exist"):
        run_calibrate(str(tmp_path / "no" / "t.yaml"))
    with pytest.raises(UsageError, match="--processes: must be 1 or 2"):
        run_calibrate(str(tmp_path / "t.yaml"), processes=3)


def _measured() -> dict:
    link = {"latency_s": 2e-6, "bandwidth_Bps": 5e10}
    return {"devices_per_node": 8, "intra": dict(link), "memory_bandwidth_Bps": 1e11,
            "flops_per_s": 1e12, "memory_bytes": None, "measured": {"intra": []}}


def test_the_command_prints_the_summary_the_library_returns(tmp_path, monkeypatch,
                                                            capsys) -> None:
    monkeypatch.setattr(calibrate_module, "calibrate", lambda **kwargs: _measured())
    out = tmp_path / "t.yaml"
    assert main(["calibrate", "--processes", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert printed.out.splitlines() == [
        "intra  latency      2.0 µs   bandwidth    50.00 GB/s",
        "inter  latency      2.0 µs   bandwidth    50.00 GB/s",
        "matmul  1000.00 GFLOP/s per device   memory 100.00 GB/s per device",
        f"wrote {out}"]
    assert cost.load_topology(str(out), nodes=1).flops_per_s == 1e12


def test_a_failed_two_process_run_logs_the_workers_output(monkeypatch, caplog) -> None:
    import meshkit.runtime.launch

    def failing(command, n, *, out, **kwargs):
        out.write("[1] worker: no route to host\n")
        return types.SimpleNamespace(returncode=1, signal=None)

    monkeypatch.setattr(meshkit.runtime.launch, "launch", failing)
    with pytest.raises(UsageError, match=r"2-process measurement failed \(exit 1\)"):
        calibrate_module._measure_inter([2**12], 1)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("meshkit.plan.calibrate", logging.ERROR, "[1] worker: no route to host\n")]
