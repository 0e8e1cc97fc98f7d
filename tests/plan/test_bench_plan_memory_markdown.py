"""``meshkit bench plan_memory --markdown``: the README's memory-fit table, a row per
stored case of ``tests/plan/xla_memory.json`` with its compiled layer counts, and a last
row of each column's range over every point. Nothing is compiled; the refits are stubbed
with ``FIT`` (the real ones take minutes), so the held-out columns equal the in-sample
one here. ``--held-out`` fills its report's table likewise, a row per stored point.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from meshkit.benchmarks import bench_plan_memory
from meshkit.benchmarks._report import Report
from meshkit.plan.memory_fit import FIT, Case, stored_points


def _fit_stub(cases: Sequence[Case], measured: Sequence[int]) -> dict[str, float]:
    return dict(FIT)


def test_markdown_prints_a_row_per_stored_case() -> None:
    stored = json.loads(bench_plan_memory.STORED.read_text())
    lines = bench_plan_memory.markdown(stored, fitter=_fit_stub).splitlines()
    header, rule, *rows, summary = lines
    assert header.count("|") == rule.count("|") == 8
    assert len(rows) == len(stored)
    for name, line in zip(stored, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 7 and cells[0].startswith(name), line
        layers = stored[name]["layers"]
        if layers:  # "a, b; whole" in every numeric column
            assert cells[0].endswith(f"({layers[0]}, {layers[1]}; "
                                     f"{stored[name]['model']['num_layers']})")
            assert all(c.count(";") == 1 and c.count(",") == 1 for c in cells[2:]), line
        # The stub refits with FIT: the held-out columns are the in-sample one.
        assert cells[4] == cells[5] == cells[6], line
    points = len(stored_points(stored))
    assert summary.startswith(f"| all {points} points"), summary
    assert summary.count("/" + str(points)) == 3


def test_held_out_fills_the_report_table_a_row_per_point() -> None:
    points = stored_points(json.loads(bench_plan_memory.STORED.read_text()))
    table = Report("plan_memory", ["--held-out"], None, devices=False).table("held out", [])
    text = bench_plan_memory.held_out(points, table, fitter=_fit_stub)
    assert table.columns == ["point", "in-sample", "without case", "without model"]
    assert [row[0] for row in table.rows] == [c.name for c, _ in points]
    assert all(row[1] == row[2] == row[3] for row in table.rows)  # the stub refits with FIT
    assert f"{points[0][0].name:<52}" in text
