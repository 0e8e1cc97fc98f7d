"""Issue 13: no traceback reaches a command-line user.

One test (or parametrised group) per row of the issue's table, each through
``meshkit.cli.main`` (the console script's entry point) asserting the exit code and that
stderr is one line naming the culprit; and the boundary itself: meshkit's errors become
exit codes, anything else is a bug that keeps its traceback.

Errors must fire before anything compiles: the ``no_compile`` fixture makes building the
jitted programs fail the test.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _configs import SMALL
from _env import drop_device_count

import meshkit.training.loop as train_module
from meshkit.cli import main
from meshkit.config import load_config
from meshkit.errors import (
    EXIT_CODES,
    EXIT_PIPE_CLOSED,
    Preempted,
    TrainingDiverged,
    format_exit_codes,
)
from meshkit.plan.memory import estimate_memory
from meshkit.training import build_model
from meshkit.training.preflight import check_memory, check_workdir

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY = ["model.d_model=16", "model.num_heads=2", "model.d_ff=16", "model.num_layers=1",
        "train.batch_size=8", "train.seq_len=8", "train.eval_batches=1", "train.steps=5",
        "train.warmup_steps=0", "--no-progress"]


def one_line(capsys, command: str = "train") -> str:
    """The single line on stderr, which must be a meshkit error (no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"meshkit {command}: error: "), err
    return lines[0]


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the run could not work")

    monkeypatch.setattr(train_module, "Programs", refuse)


def train_cli(workdir, *extra):
    return main(["train", *TINY, f"train.workdir={workdir}", *extra])


# Compiles as test_train's CLI run does (the same programs: a persistent-cache hit).
FINISHED = ["train.steps=2", "train.checkpoint_every=1", "train.log_every=1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real 2-step run with checkpoints at steps 1 and 2 (copied by each test)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    config = load_config(None, [*SMALL, *FINISHED, f"train.workdir={workdir}"])
    train_module.train(config, verbose=False)
    return config, workdir


def copy_of(finished_run, tmp_path):
    _, workdir = finished_run
    target = tmp_path / "run"
    shutil.copytree(workdir, target)
    items = [*SMALL, *FINISHED, f"train.workdir={target}", "--no-progress"]
    return target, items


# ---------------------------------------------------------------- row 1, 9: launch
# (in test_launch.py: signals are forwarded and no PID survives; 127/126; --timeout)


# ------------------------------------------------------------------ row 2: workdir


@pytest.mark.parametrize(
    ("make", "workdir", "message"),
    [
        (lambda d: (d / "wk").mkdir() or (d / "wk" / "checkpoints").write_text("x"), "wk",
         r"train.workdir: {d}/wk/checkpoints is not a directory: move it away"),
        (lambda d: (d / "afile").write_text("x"), "afile",
         r"train.workdir: {d}/afile exists and is not a directory"),
        (lambda d: (d / "afile").write_text("x"), "afile/sub",
         r"train.workdir: cannot create {d}/afile/sub: {d}/afile is not a directory"),
        (lambda d: None, "/sys/kernel",  # not writable, even for root
         r"train.workdir: /sys/kernel is not writable \(Permission denied\)"),
        (lambda d: None, "/sys/kernel/meshkit-run",
         r"train.workdir: cannot create /sys/kernel/meshkit-run: /sys/kernel is not writable"),
        (lambda d: (d / "wk").mkdir() or (d / "wk" / "metrics.jsonl").mkdir(), "wk",
         r"train.workdir: {d}/wk/metrics.jsonl is not a file"),
        (lambda d: (d / "wk").mkdir() or (d / "wk" / "tensorboard").write_text(""), "wk",
         r"train.workdir: {d}/wk/tensorboard is not a directory"),
    ],
)
def test_row2_a_workdir_that_cannot_hold_the_run_fails_before_compiling(
    make, workdir, message, tmp_path, capsys, no_compile, monkeypatch
):
    import re

    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    assert train_cli(workdir) == 2
    assert re.search(message.format(d=tmp_path), one_line(capsys))


# -------------------------------------------------------------- row 3: processes


@pytest.mark.parametrize(
    ("devices", "override", "message"),
    [
        (None, "mesh.ranks=[[0,2,4,6],[1,3,5,7]]", "spans processes"),
        (8, "mesh.ranks=null", "without a device in the mesh"),
    ],
)
def test_row3_a_mesh_that_does_not_fit_the_processes_exits_2(devices, override, message,
                                                             tmp_path, monkeypatch):
    import jax

    from meshkit.runtime.launch import launch

    jax.devices()  # this process keeps its 8 devices; the launched ones choose their own
    drop_device_count(monkeypatch)
    args = [*TINY, override, f"train.workdir={tmp_path}"]
    code = f"import sys\nfrom meshkit.cli import main\nsys.exit(main(['train', *{args!r}]))"
    out = io.StringIO()
    result = launch([PY, "-c", code], 2, devices_per_process=devices, timeout_s=30, out=out)
    text = out.getvalue()
    assert result.returncode == 2 and "Traceback" not in text, text
    # The first process to fail ends the other, which may go before it says anything.
    errors = [line for line in text.splitlines() if "error" in line]
    assert errors and all(e[4:].startswith("meshkit train: error: mesh: ") for e in errors)
    assert message in errors[0], text


# ---------------------------------------------------------- rows 4, 5, 6: old runs


def test_row4_checkpoints_without_their_config_are_refused(finished_run, tmp_path, capsys,
                                                           no_compile):
    workdir, items = copy_of(finished_run, tmp_path)
    (workdir / "config.yaml").unlink()
    assert main(["train", *items, "model.d_model=32"]) == 2
    line = one_line(capsys)
    assert f"{workdir}/checkpoints holds checkpoints [1, 2] but {workdir}/config.yaml is " \
           "missing" in line


def test_row4_an_unfinished_checkpoint_is_moved_aside_and_the_run_resumes(finished_run,
                                                                         tmp_path, capsys):
    # preflight refused these once; now they are damage like any other (recovery.py).
    workdir, items = copy_of(finished_run, tmp_path)
    (workdir / "checkpoints" / "9").mkdir()
    (workdir / "checkpoints" / "2" / "_CHECKPOINT_METADATA").unlink()
    assert main(["train", *items]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert [w.split(" is damaged (")[0] for w in warnings] == [
        f"meshkit train: warning: checkpoint {workdir}/checkpoints/{step}" for step in (9, 2)]
    assert "(it is an empty folder" in warnings[0] and "(no _CHECKPOINT_METADATA" in warnings[1]
    assert "resuming from step 1" in err and "Traceback" not in err
    assert sorted(p.name[:10] for p in (workdir / "checkpoints").glob("corrupt-*")) == [
        "corrupt-2-", "corrupt-9-"]


def test_resuming_a_finished_run_says_nothing_was_left_and_prints_the_eval(finished_run,
                                                                          tmp_path, capsys):
    _, items = copy_of(finished_run, tmp_path)
    assert main(["train", *items]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^step 2: nothing left to train \(the checkpoint is at "
                     r"step 2; raise train.steps to train further\); eval loss \d+\.\d{4} "
                     r"nats/token$", err, re.M), err
    assert "tokens/s" not in err and "TFLOP/s" not in err and "source entropy rate" in err


def test_a_full_disk_while_checkpointing_exits_2_in_one_line_and_keeps_the_others(
    finished_run, tmp_path, capsys, monkeypatch
):
    import errno

    from orbax.checkpoint._src.handlers import standard_checkpoint_handler as handler

    workdir, items = copy_of(finished_run, tmp_path)

    async def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(handler.StandardCheckpointHandler, "async_save", disk_full)
    assert main(["train", *items, "train.steps=3"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err, err
    assert line.startswith(f"meshkit train: error: no space left on device while saving "
                           f"checkpoint 3 in {workdir}/checkpoints: "), line
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]


def test_xla_out_of_memory_exits_2_naming_what_to_reduce(tmp_path, capsys, monkeypatch):
    import jax

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96.00GiB.\nmore")

    monkeypatch.setattr(train_module, "Programs", out_of_memory)
    assert train_cli(tmp_path) == 2
    assert one_line(capsys) == (
        "meshkit train: error: train.batch_size: the devices ran out of memory "
        "(RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96.00GiB.): reduce "
        "train.batch_size or train.seq_len, or the model (model.d_model, model.d_ff, "
        "model.num_layers, model.num_experts), or spread it over more devices (mesh.axes)")
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: p.write_text("- 1\n- 2\n"), "(a list, not a mapping of sections)"),
        (lambda p: p.write_text(p.read_text() + "extra:\n  a: 1\n"),
         "(unknown config key 'extra'"),
        (lambda p: p.write_text(p.read_text().split("model:")[0] + "model:\n"),
         "(section 'model' is missing or empty)"),
        (lambda p: p.write_text(p.read_text().split("model:")[0]),
         "(section 'model' is missing or empty)"),
        (lambda p: p.write_text(p.read_text().replace("data:\n", "data: 5\nx:\n")),
         "(section 'data' is missing or empty)"),
        (lambda p: p.write_text("train: {steps: 1\n"), "invalid YAML: "),
        (lambda p: p.write_bytes(b"mesh: \xff\n"), "cannot decode config file"),
        (lambda p: p.unlink() or p.mkdir(), "is not a file"),
    ],
)
def test_row5_a_damaged_saved_config_is_named(damage, problem, finished_run, tmp_path, capsys,
                                              no_compile):
    workdir, items = copy_of(finished_run, tmp_path)
    damage(workdir / "config.yaml")
    assert main(["train", *items]) == 2
    line = one_line(capsys)
    assert str(workdir / "config.yaml") in line and problem in line


class _Compiling(BaseException):
    """Raised where compiling starts: every check before it passed."""


def test_a_saved_config_without_a_section_newer_meshkit_added_still_resumes(
    finished_run, tmp_path, monkeypatch
):
    import yaml

    workdir, items = copy_of(finished_run, tmp_path)
    saved = yaml.safe_load((workdir / "config.yaml").read_text())
    del saved["exchange"]  # as if written before the section existed
    (workdir / "config.yaml").write_text(yaml.safe_dump(saved))

    def compiling(*args, **kwargs):
        raise _Compiling

    monkeypatch.setattr(train_module, "Programs", compiling)
    with pytest.raises(_Compiling):
        main(["train", *items])


def test_row6_a_line_cut_in_the_middle_of_metrics_is_dropped_with_a_warning(
    finished_run, tmp_path, capsys
):
    workdir, items = copy_of(finished_run, tmp_path)
    metrics = workdir / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    assert len(rows) == 2
    metrics.write_text(rows[0][:17] + "\n" + rows[1] + "\n")  # a cut line, then a whole one
    assert main(["train", *items]) == 0  # finished: restores and evaluates only
    err = capsys.readouterr().err
    assert f"warning: {metrics}:1: not JSON" in err and "Traceback" not in err
    assert [json.loads(r)["step"] for r in metrics.read_text().splitlines()] == [2]


def test_row6_a_metrics_file_that_is_a_directory_fails_before_compiling(
    finished_run, tmp_path, capsys, no_compile
):
    workdir, items = copy_of(finished_run, tmp_path)
    (workdir / "metrics.jsonl").unlink()
    (workdir / "metrics.jsonl").mkdir()
    assert main(["train", *items]) == 2
    assert one_line(capsys).endswith(f"{workdir}/metrics.jsonl is not a file: move it away, "
                                     "or use another train.workdir")


# --------------------------------------------------------------- row 7: ranges


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.seed=99999999999999999999999",
         "train.seed: input should be less than or equal to 4294967295, got "
         "99999999999999999999999"),
        ("data.seed=4294967296",
         "data.seed: input should be less than or equal to 4294967295, got 4294967296"),
        ("train.warmup_steps=99999999999999999999",
         "train.warmup_steps: input should be less than or equal to 2147483647, got "
         "99999999999999999999"),
        ("train.steps=1e300",
         "train.steps: input should be less than or equal to 2147483647, got 1e+300"),
        ("train.batch_size=800000000000",
         "train.batch_size: input should be less than or equal to 2147483647"),
        ("train.seq_len=2000000000", "train.batch_size: the run needs at least"),
        ("parallel.schedule=1f1b",
         "parallel.schedule: '1f1b' needs a pipeline axis (parallel.pipeline is null)"),
        ("parallel.stage_layers=[3, 1]", "parallel.stage_layers: 2 entries for no pipeline"),
    ],
)
def test_row7_out_of_range_numbers_fail_before_compiling(override, message, tmp_path, capsys,
                                                         no_compile):
    assert train_cli(tmp_path, override) == 2
    assert message in one_line(capsys)
    assert not (tmp_path / "checkpoints").exists()


def test_row7_the_memory_message_names_the_largest_part(capsys, tmp_path, no_compile):
    assert train_cli(tmp_path, "train.batch_size=1073741824", "train.seq_len=4096") == 2
    line = one_line(capsys)
    assert "of memory on this host, which has" in line
    assert "the largest part is attention weights" in line


@pytest.mark.parametrize("strategy", [
    [],
    ["mesh.axes={fsdp: 2, node: 2, device: 2}", "parallel.fsdp=fsdp"],
    ["mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp", "parallel.tensor=tp",
     "exchange.device_axis=[]", "parallel.microbatches=2"],
    ["model.num_experts=0", "model.num_heads=4", "model.num_kv_heads=2",
     "exchange.node_axis=[]", "exchange.device_axis=[]"],
    ["model.num_experts=8", "model.dense_layers=1", "model.mlp=gelu"],
], ids=["experts", "fsdp", "pp-tp", "dense-gqa", "mixed"])
def test_memory_estimate_counts_the_models_parameters_exactly(strategy):
    """The parameter term is the real per-device parameter count x 16 bytes x devices,
    whatever splits the parameters (experts, fsdp, tensor, pipeline)."""
    import jax
    import numpy as np
    from flax import nnx

    config = load_config(None, [*SMALL, "model.num_layers=2", *strategy])
    abstract = nnx.eval_shape(lambda: build_model(config))
    state = nnx.state(abstract, nnx.Param)
    specs = nnx.get_partition_spec(state)
    shape = config.strategy().shape
    per_device = 0
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        split = 1
        for axes in spec:
            for a in (axes,) if isinstance(axes, str) else (axes or ()):
                split *= shape[a]
        per_device += int(np.prod(leaf.shape)) // split
    terms = {what: size for what, _, size in
             estimate_memory(config, platform="cpu", local_devices=8).terms}
    assert terms["parameters, gradients and AdamW moments"] == per_device * 16 * 8


def test_memory_check_uses_the_host_size_it_is_given():
    config = load_config(None, SMALL)
    need = estimate_memory(config, platform="cpu", local_devices=8).total
    check_memory(config, platform="cpu", local_devices=8, host_bytes=need)
    with pytest.raises(ValueError, match=r"^model\.d_model: the run needs at least"):
        check_memory(config, platform="cpu", local_devices=8, host_bytes=need - 1)


# -------------------------------------------------- rows 8 and 13: one config loader


BAD_FILES = [
    (b"mesh:\n  axes: {node: 2, device: 4}\n\xff\xfe\n",
     "cannot decode config file {p} as UTF-8: byte 0xff at line 3 (offset 35)"),
    (b"mesh:\n\taxes: {node: 2}\n",
     "{p}: invalid YAML: found character '\\t' that cannot start any token (line 2, column 1)"),
    (b"train: {steps: 1\n", "{p}: invalid YAML: expected ',' or '}', but got '<stream end>' "
                            "(line 2, column 1)"),
    (b"train:\n  steps: 1\n  steps: 2\n", "{p}: invalid YAML: duplicate key 'steps' (line 3"),
    (b"train:\n  stepz: 1\n", "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    (b"train: {lr: 2024-13-01}\n", "{p}: invalid YAML: month must be in 1..12"),
]


@pytest.mark.parametrize("command", ["train", "mesh"])
@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_row8_train_and_mesh_reject_the_same_files_in_one_line(
    command, content, message, tmp_path, capsys, no_compile
):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    argv = [command, str(path)] + ([f"train.workdir={tmp_path}", "--no-progress"]
                                   if command == "train" else [])
    assert main(argv) == 2
    line = one_line(capsys, command)
    assert line.startswith(f"meshkit {command}: error: " + message.replace("{p}", str(path)))


@pytest.mark.parametrize("command", ["train", "mesh"])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=1", "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        ("mesh.ranks=[[0, 1, 2, 3], [4, 5, 6, 7.0]]",
         "mesh.ranks: rank ids must be integers, got 7.0"),
        ("mesh.ranks=[[0, 1, 2, 3], [4, 5, 6, 18446744073709551615]]",
         "mesh: rank ids out of range 0..7: [18446744073709551615]"),
        ("mesh.ranks=[[0, 1, 2, 3], [4, 5, 6]]", "mesh: rank ids must form a rectangular array"),
        ("mesh.axes={node: 4294967296, device: 4}", "ranks, more than the 16,777,216"),
    ],
)
def test_row13_train_and_mesh_judge_ranks_and_keys_alike(command, override, message, tmp_path,
                                                         capsys, no_compile):
    argv = [command, override] + ([f"train.workdir={tmp_path}", "--no-progress"]
                                  if command == "train" else [])
    assert main(argv) == 2
    assert message in one_line(capsys, command)


def test_mesh_takes_overrides_like_train(capsys):
    assert main(["mesh", "mesh.axes={node: 4, device: 2}", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "Strategy(node=4, device=2)" in out and "rank 3: node=1, device=1" in out


# --------------------------------------------------------- row 10: flags anywhere


def test_row10_flags_may_stand_anywhere_among_the_overrides(monkeypatch, tmp_path):
    seen = {}

    def fake_train(config, progress=None):
        seen["steps"], seen["progress"] = config.train.steps, progress

    monkeypatch.setattr(train_module, "train", fake_train)
    argv = ["train", str(ROOT / "configs/default.yaml"), "--no-progress", "train.steps=5",
            f"train.workdir={tmp_path}", "train.steps=6"]
    assert main(argv) == 0
    assert seen == {"steps": 6, "progress": False}  # in order: the last override wins


def test_row10_an_unknown_flag_is_still_one_line_exit_2(capsys):
    assert main(["train", "train.steps=5", "--no-such-flag", "-x"]) == 2
    assert one_line(capsys).endswith("unrecognized arguments: --no-such-flag -x "
                                     "(see meshkit train --help)")


# ---------------------------------------------------------------- row 11: bench


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["groups", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["groups", "--repeats", "-1"], "argument --repeats: must be >= 1, got -1"),
        (["train", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["train", "--loop-steps", "0"], "argument --loop-steps: must be >= 1, got 0"),
        (["train", "--loop-repeats", "-2"], "argument --loop-repeats: must be >= 1, got -2"),
        (["train", "train.stepz=1"], "meshkit bench train: error: unknown config key "
         "'train.stepz'"),
    ],
)
def test_row11_bench_usage_errors_exit_2_before_measuring(args, message):
    done = subprocess.run([PY, "-m", "meshkit.cli", "bench", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    assert done.stdout == ""  # nothing measured


# ---------------------------------------------------------- rows 12, 13: pictures


def test_row12_mesh_plot_into_a_missing_directory_fails_before_printing(capsys, tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["mesh", "--plot", "missing_dir/m.png"]) == 2
    assert one_line(capsys, "mesh").endswith("cannot write missing_dir/m.png: no directory "
                                             "missing_dir")
    assert capsys.readouterr().out == ""


def _metrics(workdir: Path, rows: list[dict]) -> None:
    workdir.mkdir(exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_row12_plot_reports_the_file_it_really_wrote(tmp_path, capsys):
    _metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "myplot")]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {tmp_path / 'myplot.png'}"
    assert (tmp_path / "myplot.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"step": "5", "loss": 1.0}, "metrics row 1 (step '5'): step is not a number: '5'"),
        ({"step": 5, "loss": "low"}, "metrics row 1 (step 5): loss is not a number: 'low'"),
        ({"step": 5, "loss": 1.0, "expert_load": "x"}, "expert_load is not a [layers, experts]"),
    ],
)
def test_row13_plot_rejects_rows_that_are_not_numbers(row, message, tmp_path, capsys):
    _metrics(tmp_path / "run", [row])
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert message in one_line(capsys, "plot")


def test_row13_a_home_relative_workdir_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["train.workdir=~/run", "data.kind=text", "data.path=~/b.txt",
                                "model.vocab_size=256"])
    assert config.train.workdir == f"{tmp_path}/run" and config.data.path == f"{tmp_path}/b.txt"
    assert check_workdir(config) == f"{tmp_path}/run" and (tmp_path / "run").is_dir()


def test_row13_a_huge_markov_order_is_reported_in_one_short_line(tmp_path, capsys,
                                                                  no_compile):
    assert train_cli(tmp_path, "data.order=1000") == 2
    line = one_line(capsys)
    assert "16**1000 = about 10^1,204 contexts exceeds the cap of 1048576" in line
    assert len(line) < 200


def test_row13_a_zero_slurm_task_count_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "0")
    assert train_cli(tmp_path) == 2
    assert one_line(capsys).endswith(
        "SLURM_NTASKS='0' (with SLURM_JOB_ID set) is not a positive process count")


# --------------------------------------------------------------- the boundary


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (TrainingDiverged("loss became nan at step 3"), 3,
         "meshkit train: error: loss became nan at step 3"),
        (Preempted("stopped by SIGTERM after saving step 7"), 4,
         "meshkit train: error: stopped by SIGTERM after saving step 7"),
        (KeyboardInterrupt(), 130, "meshkit train: interrupted"),
    ],
)
def test_meshkit_errors_become_their_exit_codes(error, code, line, monkeypatch, capsys):
    def fail(config, progress=None):
        raise error

    monkeypatch.setattr(train_module, "train", fail)
    assert main(["train", "--no-progress"]) == code
    assert capsys.readouterr().err.strip() == line


def test_any_other_exception_is_a_bug_with_its_traceback(monkeypatch, capsys):
    def fail(config, progress=None):
        raise RuntimeError("an index went wrong")

    monkeypatch.setattr(train_module, "train", fail)
    assert main(["train", "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("meshkit train: internal error: this is a bug in meshkit; please report "
                      "it with the command line and the traceback below")
    assert err[1] == "Traceback (most recent call last):"
    assert err[-1] == "RuntimeError: an index went wrong"


def test_console_script_exit_codes():
    """The installed `meshkit` script gives main's codes to the shell."""
    script = Path(PY).parent / "meshkit"
    done = subprocess.run([script, "train", "train.steps=0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("meshkit train: error: train.steps: input should be greater "
                                   "than or equal to 1, got 0")


def test_the_exit_codes_page_lists_every_exit_code():
    table = format_exit_codes()
    assert all(f"| {code} | " in table for code in EXIT_CODES)
    page = ROOT / "docs" / "guides" / "exit-codes.md"
    assert table in page.read_text(), f"paste format_exit_codes() into {page}"


def test_a_mesh_too_large_to_simulate_fails_before_jax_starts():
    """meshkit train runs at most MAX_RUN_SIMULATED_DEVICES devices in one process (XLA:CPU
    aborts a collective over more): refuse them up front, before JAX starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    done = subprocess.run(
        [Path(PY).parent / "meshkit", "train", "mesh.axes={node: 4096, device: 1}",
         "model.num_experts=4096", "train.batch_size=4096"],
        capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(
        "meshkit train: error: mesh.axes: 4,096 devices in one process are more than the 256 "
        "that meshkit train runs")


def test_a_reader_that_closes_the_pipe_early_is_not_a_bug():
    # `meshkit plan ... | head`: the reader is gone before the output is written (`true`
    # exits at once), so the writer certainly gets EPIPE.
    cmd = f"{sys.executable} -m meshkit.cli plan --devices 8 | true"
    run = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         timeout=120)
    assert "internal error" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.returncode == EXIT_PIPE_CLOSED, run.stderr


@pytest.mark.parametrize(("signal_name", "after_s", "code", "line"), [
    ("SIGINT", 0.8, 130, "meshkit train: interrupted"),
    ("SIGTERM", 0.3, 143, "meshkit train: stopped by SIGTERM"),
    ("SIGHUP", 0.3, 129, "meshkit train: stopped by SIGHUP"),
])
def test_a_signal_during_start_up_ends_the_command_in_one_line(
        signal_name, after_s, code, line, tmp_path):
    # Well within the command's start-up (importing JAX, starting it). Before, Python's
    # own handling gave for Ctrl-C a traceback, a crash (139) or nothing at all (the run
    # went on), and SIGTERM ended the process without a word.
    child = ("import os, signal, sys, threading\n"
             "from meshkit.cli import main\n"
             f"threading.Timer({after_s}, os.kill, (os.getpid(), signal.{signal_name})).start()\n"
             f"sys.exit(main(['train', 'train.steps=1000', 'train.workdir={tmp_path}', "
             "'--no-progress']))\n")
    done = subprocess.run([PY, "-c", child], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (code, line + "\n"), done.stdout


def test_ctrl_c_while_training_starts_exits_130_without_a_crash(tmp_path):
    # A second into train() (building and starting the model): the clean-up runs, then
    # the interpreter's teardown used to crash in what the interrupt cut short (139).
    child = ("import os, signal, sys, threading\n"
             "import meshkit.cli.main\n"
             "import meshkit.training.loop as loop\n"
             "cli, train = sys.modules['meshkit.cli.main'], loop.train\n"
             "def interrupted(*args, **kwargs):\n"
             "    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
             "    return train(*args, **kwargs)\n"
             "loop.train = interrupted\n"
             f"sys.argv[1:] = ['train', 'train.steps=1000', 'train.workdir={tmp_path}', "
             "'--no-progress']\n"
             "cli.run()\n")
    done = subprocess.run([PY, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "meshkit train: interrupted", done.stderr[-2000:]
