"""``meshkit bench memory``: usage errors exit 2 in one line before anything compiles,
``--rows`` picks rows, rows whose config keys this build lacks are skipped with the keys
named, and ``--json`` is one document of rows, skipped rows and targets.

The benchmark's own ``main`` runs in-process on the ``--quick`` shape, one layer, one
timed step (one small compile); the CLI wiring is checked once, through a usage error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_memory  # noqa: E402  (a script, found on the path set above)


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
    assert bench_memory.main(["--quick", "--json", "--steps", "1", "--rows", rows,
                              "model.num_layers=1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["rows", "skipped", "targets"]
    assert list(doc["rows"]) == ["dp8-zero1"]
    assert set(doc["skipped"]) == {"future"}
    assert "model.not_built_yet" in doc["skipped"]["future"]
    row = doc["rows"]["dp8-zero1"]
    for key in ("argument_bytes", "temp_bytes", "output_bytes", "flops", "compile_s",
                "step_ms", "params_bytes", "optimizer_bytes"):
        assert row[key] is not None and row[key] > 0, key
    assert row["optimizer_bytes"] < row["params_bytes"] / 2  # two moments, ÷ 8
    # A target whose rows were not both measured names the missing one.
    zero1 = next(t for t in doc["targets"] if t["target"].startswith("zero1"))
    assert zero1["value"] is None and zero1["missing"] == ["dp8"]
    assert all({"target", "limit", "value"} <= set(t) for t in doc["targets"])
