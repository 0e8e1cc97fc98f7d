"""``meshkit bench NAME --json FILE``: one report envelope for every benchmark (issue 33;
:mod:`meshkit.benchmarks._report`). The envelope is checked on the cheapest benchmark
(groups, 2^12 ranks, one run a query), without timing assertions; the helpers' error
paths each fire once.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

import meshkit
from meshkit.benchmarks import _report, bench_groups
from meshkit.benchmarks._report import Report, dumps, json_file, met, source_commit

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["benchmark", "command", "commit", "dirty", "version", "date", "machine", "wall_s",
        "tables", "targets"]


def _git(*args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def test_groups_writes_the_envelope_and_prints_its_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "groups.json"
    argv = ["--quick", "--repeats", "1", "--json", str(path)]
    assert bench_groups.main(argv) == 0
    out, err = capsys.readouterr()
    assert "loop/vec" in out and err == f"wrote {path}\n"
    doc = json.loads(path.read_text())
    assert list(doc) == KEYS
    assert doc["benchmark"] == "groups"
    assert doc["command"] == f"meshkit bench groups --quick --repeats 1 --json {path}"
    assert doc["version"] == meshkit.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    if _git("rev-parse", "--show-toplevel") == str(ROOT):  # a checkout: its commit
        assert doc["commit"] == _git("rev-parse", "--short", "HEAD")
        assert isinstance(doc["dirty"], bool)
    else:
        assert doc["commit"] is doc["dirty"] is None
    machine = doc["machine"]
    assert list(machine) == ["system", "cpu", "cores", "memory_gib", "python", "jax",
                             "backend", "devices"]
    assert machine["cores"] >= 1 and machine["python"].count(".") == 2
    assert machine["backend"] is machine["devices"] is None  # numpy only: JAX not asked
    assert doc["wall_s"] >= 0
    [table] = doc["tables"]
    assert list(table) == ["title", "columns", "rows", "notes"]
    assert table["columns"] == ["axes", "groups", "size", "vectorised ms", "loop ms",
                                "loop/vec"]
    assert [row[0] for row in table["rows"]] == ["dp", "pp", "ep", "cp", "tp", "dp+ep",
                                                 "cp+tp"]
    for name, groups, size, *times in table["rows"]:
        assert f"{name:<8} {groups:>9,} {size:>6}" in out  # the printed row's
        assert all(isinstance(t, float) and t > 0 for t in times)
    assert doc["targets"] == []  # groups checks none


def test_json_to_stdout_sends_the_table_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_groups.main(["--quick", "--repeats", "1", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["benchmark"] == "groups" and "loop/vec" in err


def test_an_unwritable_json_path_is_refused_before_measuring(tmp_path: Path) -> None:
    assert json_file("-") == "-"
    for bad, why in ((tmp_path, "it is a directory"),
                     (tmp_path / "no" / "x.json", "no directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            json_file(str(bad))


@pytest.mark.parametrize(("measured", "limit", "expect"), [
    (0.48, "<= 0.5", True), (0.52, "<= 0.5", False), (0.9, ">= 0.85 in the median", True),
    (0.5, "< 0.5", False), (2.0, "> 1", True), (0.2, "≤ 0.25", True),
    (1.04, "within 1 ± 0.05", True), (0.94, "within 1 ± 0.05", False),
    (3.0, "(report)", None), (None, "<= 1", None), (float("nan"), "<= 1", None),
])
def test_met_reads_the_limit(measured: float | None, limit: str, expect: bool | None) -> None:
    assert met(measured, limit) is expect


def test_a_target_and_a_table_row_go_into_the_report() -> None:
    report = Report("memory", ["--rows", "dp8"], None, devices=False)
    assert report.target("ratio", 0.7, "<= 0.5").met is False
    assert report.target("given", 0.7, "growth <= bound", True).met is True
    table = report.table("t", ["a", "b"])
    with pytest.raises(ValueError, match="a row of 1 cells, 2 columns"):
        table.add("x")
    table.add("x", float("inf"))
    report.data["rows"] = {"x": (1.0, float("nan"))}
    doc = report.to_dict()
    assert doc["tables"][0]["rows"] == [["x", None]]  # JSON has no infinity
    assert doc["data"] == {"rows": {"x": [1.0, None]}}
    assert [t["met"] for t in doc["targets"]] == [False, True]
    assert json.loads(dumps(doc)) == doc


def test_no_commit_outside_a_checkout_or_below_another_repositorys_top(
        tmp_path: Path) -> None:
    assert source_commit(tmp_path) == (None, None)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "site-packages").mkdir()  # a virtualenv inside some repository's folder
    assert source_commit(tmp_path / "site-packages") == (None, None)


def test_the_reports_folder_does_not_make_a_checkout_dirty() -> None:
    if _git("rev-parse", "--show-toplevel") != str(ROOT):
        pytest.skip("not a git checkout")
    assert _report.REPORTS_DIR == "docs/benchmarks"
    status = _git("status", "--porcelain", "--", ".", ":(exclude)docs/benchmarks")
    assert source_commit(ROOT)[1] is (status != "")
