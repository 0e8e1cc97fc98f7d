"""``meshkit bench memory_block --only context``: the rows it compiles and the table it
prints, without compiling (the figures themselves belong to the bench).

The comparison is only fair if each context program gives a device the same tokens as
its baseline: one sequence per batch device, ``T/c`` of its tokens on each of the ``c``
context devices. The compile is replaced by a stand-in that reports the config it got.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from meshkit.benchmarks import bench_memory_block as bench
from meshkit.benchmarks._report import Report
from meshkit.config import Config

MiB = bench.MiB


def _fake_compile(seen: list[Config]) -> Any:
    """A stand-in for ``_compile_step``: records the config; temp = its tokens per device."""

    def compile_step(config: Config) -> tuple[Any, float, None]:
        seen.append(config)
        t = config.train
        tokens = t.batch_size * t.seq_len // config.num_devices
        mem = types.SimpleNamespace(argument_size_in_bytes=0, temp_size_in_bytes=tokens * MiB,
                                    output_size_in_bytes=0)
        compiled = types.SimpleNamespace(memory_analysis=lambda: mem, cost_analysis=lambda: {})
        return compiled, 0.0, None

    return compile_step


def test_each_context_program_gives_a_device_its_baselines_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Config] = []
    monkeypatch.setattr(bench, "_compile_step", _fake_compile(seen))
    # 4 heads: Ulysses cannot split them over 8 devices, so that row is listed, not run.
    rows = bench._context([*bench.MODEL, *bench.CONTEXT_MODEL, "model.num_heads=4"])
    by = {r.label: r for r in rows}
    assert [r.label for r in rows if r.skipped] == ["ulysses c=8 T=8192"]
    assert "model.num_heads" in (by["ulysses c=8 T=8192"].skipped or "")
    ran = {c.parallel.context_method: c for c in seen if c.context_devices == 8}
    assert ran["hierarchical"].context_devices == 8
    assert list(ran["hierarchical"].parallel.context) == ["cpn", "cpd"]
    for config in seen:  # one sequence per batch device; the whole of it on the context ones
        assert config.train.batch_size == config.batch_devices
        if config.context_devices > 1:
            assert config.train.seq_len == bench.CONTEXT_T
    tokens = {r.label: r.temp // MiB for r in rows if not r.skipped}
    assert set(tokens.values()) == {bench.CONTEXT_T // 4, bench.CONTEXT_T // 8}
    for c in bench.CONTEXT_DEVICES:
        base = tokens[bench._context_label(None, c)]
        assert base == bench.CONTEXT_T // c
        assert all(tokens[label] == base for label in tokens if label.endswith(
            f"c={c} T={bench.CONTEXT_T}"))


def test_the_table_states_each_ratio_and_whether_it_meets_the_target() -> None:
    def row(label: str, temp_mib: float, skipped: str | None = None) -> bench.Row:
        return bench.Row("context", label, 0, int(temp_mib * MiB), 0, None, 0.0,
                         skipped=skipped)

    label = bench._context_label
    rows = [row(label(None, 4), 100), row(label("ring", 4), 120),
            row(label("all_gather", 4), 150), row(label("ulysses", 4), 0, "heads")]
    report = Report("memory_block", [], None, devices=False)
    lines = bench._context_table(rows, report)
    table = report.tables[-1]
    assert table.rows == [["all_gather", 4, 150.0, 100.0, 1.5, False],
                          ["ring", 4, 120.0, 100.0, 1.2, True],
                          ["ulysses", 4, None, 100.0, None, None]]
    assert [(t.measured, t.met) for t in report.targets] == [(1.5, False), (1.2, True),
                                                             (None, None)]
    assert any("missed" in line for line in lines)
    assert any(line.startswith("ulysses") and "not run: heads" in line for line in lines)
    other = bench.Row("seq", "dp8 chunked T=512", 0, MiB, 0, None, 0.0)
    assert bench._context_table([other], report) == []  # no context rows, no table
