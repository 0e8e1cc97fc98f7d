"""``benchmarks/bench_plan_memory.py --markdown``: the README's memory-fit table, a row per
stored case of ``tests/plan/xla_memory.json`` with its compiled layer counts, and a last
row of each column's range over every point. Nothing is compiled; the refits are stubbed
with ``FIT`` (the real ones take minutes), so the held-out columns equal the in-sample
one here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_plan_memory  # noqa: E402  (a script, found on the path set above)

from meshkit.plan.memory_fit import FIT, Case, stored_points  # noqa: E402


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
