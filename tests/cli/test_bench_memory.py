"""``meshkit bench memory``: usage errors exit 2 in one line before anything compiles,
``--rows`` picks rows, rows whose config keys this build lacks are skipped with the keys
named, and ``--json -`` is the report on stdout: its tables and targets, and every row's
fields and the skipped rows in ``data``.

The benchmark's own ``main`` runs in-process on the ``--quick`` shape, one layer, one
timed step (one small compile); the CLI wiring is checked once, through a usage error.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshkit.benchmarks import bench_memory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--rows", "dp8,nope"], "--rows: unknown rows ['nope']; valid: dp8, dp8-zero1,"),
        (["train.stepz=1"], "unknown config key 'train.stepz'"),
        (["model.d_model=36", "model.num_heads=2"],
         "row fsdp8: model.d_model: 36 cannot be sharded over the 8 fsdp devices"),
    ],
)
def test_usage_errors_exit_2_in_one_line(args: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_memory.main(["--quick", *args])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err.strip().splitlines()[-1], err


def test_the_cli_runs_the_benchmark_and_keeps_its_exit_code() -> None:
    done = subprocess.run([sys.executable, "-m", "meshkit.cli", "bench", "memory", "--steps",
                           "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "--steps must be >= 1, got 0" in done.stderr and "Traceback" not in done.stderr


def test_json_holds_the_chosen_rows_skipped_rows_and_targets(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # A row whose key this build lacks, as the rows of a not-yet-built option are.
    monkeypatch.setattr(bench_memory, "ROWS",
                        [*bench_memory.ROWS, ("future", ["model.not_built_yet=1"])])
    rows = "dp8-zero1,future"  # one compile; test_zero1 checks the ÷ data size
    assert bench_memory.main(["--quick", "--json", "-", "--steps", "1", "--rows", rows,
                              "model.num_layers=1"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)  # the report alone on stdout; the table went to stderr
    assert "dp8-zero1" in err and "future" in err
    assert doc["benchmark"] == "memory" and list(doc["data"]) == ["rows", "skipped"]
    data = doc["data"]
    assert list(data["rows"]) == ["dp8-zero1"]
    assert set(data["skipped"]) == {"future"}
    assert "model.not_built_yet" in data["skipped"]["future"]
    rows_table, targets_table = doc["tables"]
    assert [r[0] for r in rows_table["rows"]] == ["dp8-zero1"]
    assert any("future skipped" in note for note in rows_table["notes"])
    row = data["rows"]["dp8-zero1"]
    for key in ("argument_bytes", "temp_bytes", "output_bytes", "flops", "compile_s",
                "step_ms", "params_bytes", "optimizer_bytes"):
        assert row[key] is not None and row[key] > 0, key
    assert row["optimizer_bytes"] < row["params_bytes"] / 2  # two moments, ÷ 8
    # A target whose rows were not both measured: nothing measured, nothing met, and the
    # targets table names the missing row.
    zero1 = next(t for t in doc["targets"] if t["name"].startswith("zero1"))
    assert zero1["measured"] is None and zero1["met"] is None
    assert next(r for r in targets_table["rows"] if r[0].startswith("zero1"))[3] == "dp8"
    assert all(list(t) == ["name", "measured", "limit", "met"] for t in doc["targets"])
