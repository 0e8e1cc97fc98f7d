"""metrics.jsonl: appending, resume truncation, crash tolerance, TensorBoard."""

import json

import pytest

from meshkit.training.metrics import MetricsWriter, read_metrics


def test_write_read_and_resume_truncation(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step in (5, 10, 15):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [5, 10, 15]
    # A run resumed from the step-10 checkpoint drops the rows after it.
    MetricsWriter(str(tmp_path), resume_step=10).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5, 10]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_a_line_cut_off_by_a_crash_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 5, "loss": 2.0}) + "\n" + '{"step": 10, "lo')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        read_metrics(path)
    MetricsWriter(str(tmp_path), resume_step=10).close()
    assert read_metrics(path) == [{"step": 5, "loss": 2.0}]


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "run"), enabled=False)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    assert not (tmp_path / "run").exists()


def test_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: expected a JSON object"):
        read_metrics(tmp_path)
