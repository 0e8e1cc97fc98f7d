"""``meshkit bench moe --link-rate``: the rows, their prediction and the table, from a
made-up measurement (no processes, no compile); a signal the 2-process run forwarded."""

from __future__ import annotations

import signal

import pytest

from meshkit.benchmarks import bench_moe
from meshkit.benchmarks._report import Report
from meshkit.exchange import cost


def _measured() -> list[dict]:
    keys = [repr((what, 4, None, plan)) for what in ("exchange", "layer")
            for plan in bench_moe.PLANS]
    shaped = {"flat": [300.0, 310.0, 500.0], "two-stage": [330.0, 340.0, 350.0],
              "dedup": [150.0, 160.0, 170.0]}
    return [{
        "rate": "1gbit", "alpha_s": 1e-4, "beta_Bps": 3e7, "unshaped": [1e-4, 2e8],
        "intra": [5e-5, 4e8], "memory_Bps": 2e9,
        "ms": {key: shaped[eval(key)[3]] for key in keys},
        "base_ms": {key: [100.0, 90.0, 120.0] for key in keys},
        "wire": dict.fromkeys(keys, 2.0**20),
    }]


def test_rows_report_the_fastest_round_and_predict_from_the_exchange_model() -> None:
    rows = bench_moe.link_rows(_measured())
    assert len(rows) == 6
    flat = next(r for r in rows if (r["program"], r["plan"]) == ("exchange", "flat"))
    assert (flat["ms_measured"], flat["ms_median"], flat["ms_unshaped"]) == (300, 310, 90)
    assert flat["spread"] == pytest.approx((500 - 300) / 310, abs=1e-3)
    size = bench_moe._exchange_bytes(4)
    intra = cost.Link(5e-5, 4e8)

    def topology(inter: cost.Link) -> cost.Topology:
        return cost.Topology(2, 4, inter, intra, 2e9)

    # Dedup's node rows, 256 (the tokens: its capacity is capped there), against flat's
    # 640 for the same node: 4 · 256 / 640 nodes per token, not the bound 2.
    routing = {"top_k": 4, "nodes_per_token": 1.6}
    unshaped = topology(cost.Link(1e-4, 2e8))
    # As set: 1 Gbit/s shared by 4 devices; as calibrated: 3e7 B/s.
    for field, inter in (("ms_predicted", cost.Link(1e-4, 1e9 / 8 / 4)),
                         ("ms_predicted_calibrated", cost.Link(1e-4, 3e7))):
        for plan, method in bench_moe.PLAN_METHOD.items():
            row = next(r for r in rows if (r["program"], r["plan"]) == ("exchange", plan))
            link = 4e3 * cost.predict(method, size, topology(inter), **routing)
            rest = 90 - 4e3 * cost.predict(method, size, unshaped, **routing)
            # The longer whole, the shorter by OVERLAP (not the plain sum).
            expect = max(rest, link) + bench_moe.OVERLAP * min(rest, link)
            assert bench_moe.OVERLAP < 1 and min(rest, link) > 1
            assert row[field] == pytest.approx(expect, abs=0.01), (field, plan)
    assert {r["auto"] for r in rows} == {"dedup"}  # half the bytes across a slow link


def test_table_prints_both_programs_and_the_targets_lines(capsys) -> None:
    report = Report("moe", [], None, devices=False)
    bench_moe._print_link_table(bench_moe.link_rows(_measured()), report)
    out = capsys.readouterr().out
    assert "the exchange alone" in out and "the whole layer" in out
    assert "exchange 1gbit top_k=4 max_nodes=None: dedup/flat 0.50, auto 1.00×" in out
    assert "with the calibrated link" in out
    # The report: a table a program, a row a plan and rate, the printed lines as notes.
    exchange, layer = report.tables
    for table, title in ((exchange, "the exchange alone"), (layer, "the whole layer")):
        assert table.title.startswith("MoE over a shaped link: E=16") and title in table.title
        assert len(table.rows) == 3  # one per plan: one routing, one rate
    flat = next(r for r in exchange.rows if r[2] == "flat")
    assert flat[3:6] == ["1gbit", 90, 300] and flat[9] is False and flat[10] == 1.0
    assert any("dedup/flat 0.50" in note for note in exchange.notes)
    assert len(report.data["rows"]) == 6


class _Stopped(Exception):
    pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_the_two_process_run_forwarded_acts_on_the_benchmark(monkeypatch, sig):
    # The launcher ended the workers and returned 128 + N: that is the signal's ending
    # (one line, meshkit.cli.script's handler), not "the 2-process run failed".
    from meshkit.runtime import launch as launch_mod

    def launched(*args, **kwargs):  # type: ignore[no-untyped-def]
        return launch_mod.LaunchResult(128 + sig, None, 0.1, signal=sig)

    def handler(signum, frame):  # type: ignore[no-untyped-def]
        raise _Stopped(signum)

    monkeypatch.setattr(launch_mod, "launch", launched)
    previous = signal.signal(sig, handler)
    try:
        with pytest.raises(_Stopped, match=str(int(sig))):
            bench_moe._two_processes(True, 1)
    finally:
        signal.signal(sig, previous)
