"""``meshkit bench peer``: meshkit against MaxText on one matched model (issue 36).

MaxText needs Python >= 3.12 and is not installed where the tests run, so its side is
tested up to the process boundary: the layout table says the same layout to both sides,
the shape maps to both sides' keys, the pairs alternate and their ratio's median is
taken, a stand-in interpreter's result is read (and its failure reported), and without
MaxText the benchmark prints meshkit's columns and how to install it. The one compile is
meshkit's quick model on one layout.
"""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path

import pytest
import yaml

from meshkit.benchmarks import bench_peer
from meshkit.benchmarks.bench_peer import (
    FULL,
    LAYOUTS,
    QUICK,
    maxtext_model,
    maxtext_overrides,
    maxtext_python,
    maxtext_step_s,
    meshkit_model,
    paired_ratio,
    run_maxtext,
    run_pairs,
)
from meshkit.cli.script import run
from meshkit.config import load_config
from meshkit.training import config_dataset

HAS_MAXTEXT = bench_peer.importlib.util.find_spec("maxtext") is not None


def _items(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def _meshkit_roles(layout: bench_peer.Layout) -> dict[str, int]:
    """meshkit's mesh as MaxText's axes: the expert axes, fsdp, tensor, the rest data."""
    items = _items(list(layout.meshkit))
    axes = yaml.safe_load(items["mesh.axes"])

    def named(key: str) -> set[str]:
        value = yaml.safe_load(items.get(key, "[]"))
        return {value} if isinstance(value, str) else set(value)

    roles: dict[str, int] = {}
    for axis, size in axes.items():
        role = ("expert" if axis in named("exchange.device_axis") | named("exchange.node_axis")
                else "fsdp" if axis in named("parallel.fsdp")
                else "tensor" if axis in named("parallel.tensor") else "data")
        roles[role] = roles.get(role, 1) * size
    return roles


def _maxtext_roles(layout: bench_peer.Layout) -> dict[str, int]:
    items = _items(maxtext_overrides(layout, steps=1, workdir="w"))  # the last value wins
    return {key.removeprefix("ici_").removesuffix("_parallelism"): int(value)
            for key, value in items.items()
            if key.startswith("ici_") and int(value) != 1}


def test_every_layout_is_the_same_mesh_on_both_sides() -> None:
    names = [layout.name for layout in LAYOUTS]
    assert len(names) == 7 and len(set(names)) == 7
    assert sum(layout.moe for layout in LAYOUTS) == 4
    for layout in LAYOUTS:
        ours, theirs = _meshkit_roles(layout), _maxtext_roles(layout)
        assert ours == theirs, layout.name
        assert math.prod(ours.values()) == bench_peer.DEVICES, layout.name
    # The expert axis also shards the other parameters, as MaxText's rules do.
    ep8 = _items(list(LAYOUTS[-1].meshkit))
    assert ep8["parallel.fsdp"] == "[ep]" and ep8["exchange.device_axis"] == "[ep]"
    assert "parallel.moe_tensor=ffn" in LAYOUTS[names.index("moe-dp2tp4")].meshkit


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("shape", [FULL, QUICK], ids=["full", "quick"])
def test_the_shape_is_the_same_model_on_both_sides(shape: bench_peer.Shape, moe: bool) -> None:
    ours, theirs = _items(meshkit_model(shape, moe=moe)), _items(maxtext_model(shape, moe=moe))
    pairs = [("model.d_model", "base_emb_dim"), ("model.num_layers", "base_num_decoder_layers"),
             ("model.num_heads", "base_num_query_heads"), ("model.num_heads", "base_num_kv_heads"),
             ("model.d_ff", "base_mlp_dim"), ("model.vocab_size", "vocab_size"),
             ("train.seq_len", "max_target_length"), ("model.dtype", "dtype"),
             ("model.dtype", "weight_dtype"), ("model.remat", "remat_policy"),
             ("train.lr", "learning_rate"), ("train.weight_decay", "adam_weight_decay"),
             ("train.grad_clip", "gradient_clipping_threshold")]
    for key, their_key in pairs:
        assert ours[key] == theirs[their_key], (key, their_key)
    heads = int(theirs["base_num_query_heads"])
    assert int(ours["model.d_model"]) == int(theirs["head_dim"]) * heads
    assert float(theirs["per_device_batch_size"]) * bench_peer.DEVICES == int(
        ours["train.batch_size"])
    assert theirs["scan_layers"] == "false"  # scanned layers are checkpointed whatever
    if moe:
        assert (ours["model.num_experts"], ours["model.top_k"]) == (
            theirs["num_experts"], theirs["num_experts_per_tok"])
        assert ours["model.capacity_factor"] == theirs["capacity_factor"]
        assert theirs["base_moe_mlp_dim"] == ours["model.d_ff"]
        assert theirs["sparse_matmul"] == "false"  # the capacity-bounded path
    else:
        assert (ours["model.num_experts"], theirs["num_experts"]) == ("0", "1")


def test_each_row_loads_or_names_what_this_build_lacks() -> None:
    configs, skipped = bench_peer._configs(LAYOUTS, QUICK)
    assert set(configs) | set(skipped) == {layout.name for layout in LAYOUTS}
    assert all(r.startswith(("not in this build: ", "this build refuses the layout: "))
               for r in skipped.values())
    for name, config in configs.items():
        assert config.model.d_model == QUICK.d_model and config.train.seq_len == QUICK.seq_len
        assert math.prod(config.strategy().shape.values()) == bench_peer.DEVICES, name
    # The full shape's data source can be built (its table grows as vocab^(order+1)).
    config_dataset(load_config(None, meshkit_model(FULL, moe=True)))


def test_the_pairs_alternate_and_the_ratio_is_their_median() -> None:
    order: list[str] = []
    ours, theirs = run_pairs(3, lambda: order.append("m") or 2.0,
                             lambda: order.append("x") or 4.0)
    assert order == ["m", "x"] * 3 and paired_ratio(ours, theirs) == 0.5
    # A slow pair moves the median of the ratios by one rank, not by its size.
    assert paired_ratio([1.0, 1.0, 9.0], [2.0, 2.0, 1.0]) == 0.5
    assert run_pairs(2, lambda: 1.0, None) == ([1.0, 1.0], [])
    with pytest.raises(ValueError, match="2 meshkit runs against 1 MaxText"):
        paired_ratio([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="no pairs"):
        paired_ratio([], [])
    assert maxtext_step_s({"step_s": [9.0, 9.0, 1.0, 3.0, 2.0]}, 3) == 2.0
    with pytest.raises(RuntimeError, match="timed 4 steps, expected 5"):
        maxtext_step_s({"step_s": [9.0, 9.0, 1.0, 3.0]}, 3)


def test_an_interpreter_without_maxtext_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--maxtext-python .*: no such file"):
        maxtext_python(str(tmp_path / "python"))
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(ValueError, match=r"--maxtext-python .*plain: not executable"):
        maxtext_python(str(plain))
    if not HAS_MAXTEXT:
        with pytest.raises(ValueError, match="MaxText is not installed there"):
            maxtext_python(sys.executable)
        assert maxtext_python(None) == (None, None)


def _stand_in(tmp_path: Path, body: str) -> str:
    """An executable that takes MaxText's interpreter's place: ``$1`` is the worker's
    path, ``$2`` the result's."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_maxtext_run_is_read_from_its_result_or_its_failure_shown(tmp_path: Path) -> None:
    result = {"step_s": [0.5, 0.2, 0.1], "memory": {"argument": 1, "output": 2, "temp": 3,
                                                    "alias": 1},
              "params": 7, "devices": 8, "jax": "x", "maxtext": "0.2.5"}
    overrides = maxtext_overrides(LAYOUTS[0], QUICK, steps=3, workdir=str(tmp_path / "o"))
    python = _stand_in(tmp_path, f"echo \"$XLA_FLAGS $DECOUPLE_GCLOUD $3\"\n"
                                 f"echo '{json.dumps(result)}' > \"$2\"")
    (tmp_path / "ok").mkdir()
    assert run_maxtext(python, overrides, tmp_path / "ok") == result
    log = (tmp_path / "ok" / "maxtext.log").read_text()
    flags, gcloud, first = log.split()[:-2], *log.split()[-2:]
    assert flags[-1] == f"--xla_force_host_platform_device_count={bench_peer.DEVICES}"
    assert (gcloud, first) == ("TRUE", "steps=3")
    failing = _stand_in(tmp_path, "echo 'ValueError: moe_mlp_dim must be positive'; exit 3")
    (tmp_path / "bad").mkdir()
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*moe_mlp_dim must be positive"):
        run_maxtext(failing, overrides, tmp_path / "bad")


def test_the_worker_runs_in_an_interpreter_without_meshkit() -> None:
    source = Path(bench_peer._peer_maxtext.__file__).read_text()
    top = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert all(line.split()[1] in ("__future__", "json", "sys", "time", "collections.abc",
                                   "typing") for line in top), top


def test_usage_errors_come_before_anything_compiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(bench_peer.main, "peer", ["--layouts", "dense-dp8,nope"]) == 2
    assert "--layouts: unknown rows ['nope']" in capsys.readouterr().err
    assert run(bench_peer.main, "peer", ["--maxtext-python", "/no/such/python"]) == 2
    assert "--maxtext-python /no/such/python: no such file" in capsys.readouterr().err
    assert run(bench_peer.main, "peer", ["--pairs", "0"]) == 2
    assert "--pairs: must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(HAS_MAXTEXT, reason="MaxText is installed here")
def test_without_maxtext_it_prints_meshkits_columns_and_how_to_install_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "peer.json"
    argv = ["--quick", "--layouts", "moe-dp8", "--pairs", "1", "--steps", "1",
            "--json", str(path)]
    assert bench_peer.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("MaxText is not installed: meshkit's columns only. To compare: "
                          "pip install 'meshkit[peer]'")
    row = next(line for line in out.splitlines() if line.startswith("moe-dp8"))
    assert row.split()[2:4] == ["n/a", "n/a"]  # MaxText's parameters, the ratio
    table = json.loads(path.read_text())["tables"][0]
    (cells,) = table["rows"]
    ours = bench_peer.meshkit_overrides(LAYOUTS[3], QUICK)
    assert cells[0] == "moe-dp8" and _items(ours)["model.num_experts"] == "8"
    assert cells[1] > 0 and cells[4] > 0 and cells[5] > cells[7] > 0  # meshkit's columns
    assert [cells[i] for i in (2, 3, 6, 8)] == [None] * 4  # MaxText's
    assert any(n.startswith("MaxText is not installed") for n in table["notes"])
