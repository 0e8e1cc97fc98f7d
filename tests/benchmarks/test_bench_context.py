"""``meshkit bench context``: its rows, predictions, verdicts and balance table, from a
made-up worker record (the 2-process run itself is the benchmark's, not the suite's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshkit.benchmarks import bench_context as bench
from meshkit.benchmarks._report import Report
from meshkit.cli.script import run
from meshkit.config import context_method

SEQ_LENS = (4096, 16384)


def _record(shaped: list[float], ms: dict[str, float]) -> dict[str, Any]:
    """A worker's record: unshaped steps of 100 ms, shaped ones ``ms[method]``."""
    keys = {m: [json.dumps([m, t]) for t in SEQ_LENS] for m in context_method.SIMPLICITY}
    return {"rate": "1gbit", "intra": [1e-5, 2e9], "unshaped": [1e-4, 3e8], "shaped": shaped,
            "compute_ms": {str(t): 50.0 for t in SEQ_LENS},
            "ms": {k: [ms[m] * 1.1, ms[m]] for m, ks in keys.items() for k in ks},
            "base_ms": {k: [100.0, 120.0] for ks in keys.values() for k in ks},
            "temp_bytes": {k: 2**20 for ks in keys.values() for k in ks},
            "wire_bytes": {k: 3 * 2**20 for ks in keys.values() for k in ks},
            "drops": {k: 0.0 for ks in keys.values() for k in ks}}


TIMES = {"all_gather": 200.0, "ring": 300.0, "ulysses": 150.0, "hierarchical": 160.0}


def test_rows_hold_the_issue_fields_and_auto_repeats_its_pick() -> None:
    rows = bench.context_rows(_record([1e-4, 3e7], TIMES))
    assert [(r["method"], r["seq_len"]) for r in rows] == [
        (m, t) for t in SEQ_LENS for m in (*context_method.SIMPLICITY, "auto")]
    for r in rows:
        assert {"method", "seq_len", "link_rate", "ms_measured", "ms_predicted",
                "temp_bytes"} <= set(r)
        assert r["ms_measured"] == TIMES[r.get("picks", r["method"])]  # the fastest round
        assert r["ms_unshaped"] == 100.0 and r["wire_bytes"] == 3 * 2**20
        assert r["ms_predicted"] > r["ms_unshaped"]  # a slower link adds time
    for auto in (r for r in rows if r["method"] == "auto"):
        pick = next(r for r in rows if r["method"] == auto["picks"]
                    and r["seq_len"] == auto["seq_len"])
        assert {**pick, "method": "auto", "picks": auto["picks"]} == auto


def test_the_prediction_is_the_unshaped_step_where_the_link_is_unchanged() -> None:
    rows = bench.context_rows(_record([1e-4, 3e8], TIMES))
    assert all(r["ms_predicted"] == r["ms_unshaped"] for r in rows)


def test_verdicts_and_the_report() -> None:
    report = Report("context", [], None, devices=False)
    rows = bench.print_tables(_record([1e-4, 3e7], TIMES), report)
    doc = report.to_dict()
    assert doc["data"]["rows"] == rows
    v = json.loads(json.dumps(bench.verdicts(rows)))  # as the report holds them
    assert doc["data"]["verdicts"] == v
    # hierarchical at 16K: 160 ms against ring's 300 and Ulysses' 150.
    assert v["hierarchical"] == {"16384": {"over_ring": round(160 / 300, 3),
                                         "over_ulysses": round(160 / 150, 3)}}
    auto = {r["seq_len"]: r["ms_measured"] for r in rows if r["method"] == "auto"}
    assert v["auto_over_fastest"] == {str(t): round(auto[t] / 150, 3) for t in SEQ_LENS}
    worst = max((r for r in rows if r["method"] != "auto"),
                key=lambda r: abs(r["ms_predicted"] / r["ms_measured"] - 1))
    assert v["worst_prediction"]["method"] == worst["method"]
    names = [t["name"] for t in doc["targets"]]
    assert "auto / fastest at T=16384" in names and "worst |predicted / measured - 1|" in names
    balance = doc["tables"][1]["rows"]
    assert [row[0] for row in balance] == list(SEQ_LENS)
    assert all(row[3] == 1.0 and row[6] > 5 for row in balance)  # zigzag even, contiguous not


@pytest.mark.parametrize(("argv", "culprit"), [
    (["--seq-lens", "4000"], "--seq-lens"),
    (["--seq-lens", "4k"], "--seq-lens"),
    (["--link-rate", "fast"], "--link-rate"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv: list[str], culprit: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run(bench.main, "context", argv) == 2
    err = capsys.readouterr().err.strip()
    assert culprit in err and len(err.splitlines()) <= 2  # argparse: usage, then the error
