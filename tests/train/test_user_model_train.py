"""Issue 19: the trainer trains any NNX model (a user's GPT built from meshkit's parallel
layers), restores every leaf onto the mesh, and reports its FLOPs from XLA's count.

Tiny shapes and 6 steps; the runs share their compiled programs (a persistent-cache hit
for each layout after the first run under it).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from _user_gpt import LOGICAL, loss, make

import meshkit.training.builtin_hooks as hooks_module
import meshkit.training.preflight as preflight_module
from meshkit.cli import main
from meshkit.config import load_config
from meshkit.sharding.rules import ShardingRules
from meshkit.training import Hook, train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.metrics import read_metrics

NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
RUN = ["train.batch_size=8", "train.seq_len=8", "train.steps=6", "train.warmup_steps=0",
       "train.log_every=1", "train.checkpoint_every=3", "train.eval_every=1000",
       "train.eval_batches=1", *NO_EXPERTS,
       "parallel.logical_axes={" + ", ".join(f"{k}: {v}" for k, v in LOGICAL.items()) + "}"]
ONE = ["mesh.axes={dp: 1}"]
DP2_TP4 = ["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp"]
FSDP8 = ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp"]


def _train(workdir: Path, layout: list[str], **kwargs):
    config = load_config(None, [*RUN, *layout, f"train.workdir={workdir}"])
    # A plain optax optimizer: its state holds bare counters, restored onto the mesh too.
    return train(config, model=_small, loss=loss, optimizer=optax.adam(1e-2), verbose=False,
                 progress=False, **kwargs)


def _small(rngs):
    """The user GPT at the config's vocabulary (16), one block of width 16."""
    return make(rngs, vocab=16, width=16, layers=1)


def _losses(result) -> list[float]:
    return [value for _, value in result.losses]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> list[float]:
    return _losses(_train(tmp_path_factory.mktemp("one"), ONE))


@pytest.fixture(scope="module")
def dp2_tp4(tmp_path_factory):
    """An uninterrupted run under dp2×tp4 (heads, mlp columns and vocabulary split 4 ways),
    and a copy of its workdir as it was after step 4 (the step-3 checkpoint saved): a run
    stopped there."""
    workdir = tmp_path_factory.mktemp("dp2_tp4") / "run"
    stopped = workdir.parent / "stopped-at-4"

    def snapshot(info):
        if info.step == 4:  # as a run killed there left it: its lock is no more
            shutil.copytree(workdir, stopped, ignore=shutil.ignore_patterns(".lock"))

    result = _train(workdir, DP2_TP4, hooks=[Hook(snapshot, every=1)])
    assert Checkpointer(stopped / "checkpoints").all_steps() == [3]
    return result, workdir, stopped


def test_a_user_model_under_dp2_tp4_matches_one_device_and_logs_its_metrics(
    one_device, dp2_tp4
):
    result, workdir, _ = dp2_tp4
    np.testing.assert_allclose(_losses(result), one_device, rtol=1e-5)
    assert one_device[-1] < one_device[0] - 0.1  # it learns
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # The loss's own metrics, next to the step's; no router, so no dropped fraction.
    for r in rows:
        assert r["ce_loss"] == pytest.approx(r["loss"]) and r["logit_ms"] > 0
        assert {"grad_norm", "tokens_per_s", "tflops_per_device"} <= r.keys()
        assert "dropped_fraction" not in r and "expert_load" not in r
        assert "lr" not in r  # the optimizer is the caller's: its schedule is unknown here
    assert result.dropped_fraction is None
    assert result.eval_loss == pytest.approx(rows[-1]["eval_loss"])
    # FLOPs from XLA's cost analysis of the compiled step: positive, finite; no MFU on CPU.
    assert result.flops_per_token == result.xla_flops_per_token
    assert 0 < result.flops_per_token < math.inf
    assert 0 < result.tflops_per_device < math.inf and result.mfu is None
    assert result.tflops_per_device == pytest.approx(
        result.tokens_per_s * result.flops_per_token / 8 / 1e12)


def test_a_stopped_run_resumes_under_the_same_and_another_layout(one_device, dp2_tp4,
                                                                 tmp_path):
    _, _, stopped = dp2_tp4
    # The same layout with the rules passed in instead (the config maps no name), and
    # fsdp8: every parameter and Adam moment split on the width, counters replicated.
    same = {"rules": ShardingRules(data="dp", tensor="tp").extend(**LOGICAL)}
    for name, layout, kwargs in (("same", [*DP2_TP4, "parallel.logical_axes={}"], same),
                                 ("other", FSDP8, {})):
        workdir = tmp_path / name
        shutil.copytree(stopped, workdir)
        resumed = _train(workdir, layout, **kwargs)
        assert resumed.start_step == 3, name
        np.testing.assert_allclose(_losses(resumed), one_device[3:], rtol=1e-5, err_msg=name)
        assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 7))


def test_mfu_is_reported_on_a_device_of_known_peak():
    config = load_config(None, [*RUN, *FSDP8])
    rate = hooks_module._Rate(config, hooks_module.Flops(per_token=1e6, xla_per_token=1e6))
    rate._kind = "NVIDIA H100 80GB HBM3"  # no GPU here
    use = rate(8e5)
    assert use is not None and use.mfu == pytest.approx(8e5 * 1e6 / 8 / 989e12)
    assert hooks_module._Rate(config, hooks_module.Flops(per_token=None))(8e5) is None


# ------------------------------------------------------------------ the command line

MODULE = """
from _user_gpt import loss, make as make_gpt

def make(rngs, *, d=16, heads=4):
    return make_gpt(rngs, vocab=16, width=d, heads=heads, layers=1)

def no_rngs():
    return None

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``usergpt_cli``, a user's module in a directory on sys.path."""
    (tmp_path / "usergpt_cli.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usergpt_cli"
    sys.modules.pop("usergpt_cli", None)


def test_cli_trains_a_model_named_by_import_path(user_module, tmp_path, capsys):
    workdir = tmp_path / "run"
    argv = ["train", *RUN, *ONE, "train.steps=2", f"train.workdir={workdir}",
            f"model.factory={user_module}:make", "model.factory_kwargs={d: 16}",
            f"model.loss={user_module}:loss", "--no-progress",
            # The transformer's sizes do not apply: its memory estimate would refuse this.
            "model.d_ff=2000000000"]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "meshkit train: starting" in err and "TFLOP/s per device by XLA's count" in err, err
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "logit_ms" in rows[-1] and "lr" in rows[-1]
    assert load_config(workdir / "config.yaml").model.factory == f"{user_module}:make"


def test_cli_memory_check_counts_the_user_models_state(user_module, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.setattr(preflight_module, "host_memory", lambda: 4096)
    argv = ["train", *RUN, *DP2_TP4, f"train.workdir={tmp_path}", "--no-progress",
            f"model.factory={user_module}:make"]
    assert main(argv) == 2
    err = _without_imports(capsys.readouterr().err).strip()
    assert err.startswith("meshkit train: error: model.factory: the run needs at least ")
    assert "parameters, gradients and optimizer state" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.factory=nosuchmodule_meshkit:make"],
         "model.factory: no module named 'nosuchmodule_meshkit'"),
        (["model.factory={m}:nothing"], "model.factory: module '{m}' has no attribute 'nothing'"),
        (["model.factory={m}:NOT_CALLABLE"],
         "model.factory: {m}:NOT_CALLABLE is an int, not a function or class"),
        (["model.factory={m}:no_rngs"],
         "model.factory: {m}:no_rngs has no parameter named 'rngs': meshkit calls it as "
         "no_rngs(rngs=...)"),
        (["model.factory={m}:make", "model.factory_kwargs={width: 8}"],
         "model.factory_kwargs: {m}:make cannot be called as make(rngs=..., width=8): got an "
         "unexpected keyword argument 'width'"),
        (["model.factory={m}:make", "model.loss={m}:no_rngs"],
         "model.loss: {m}:no_rngs has no parameter named 'model'"),
        (["model.factory={m}:make", "parallel.logical_axes={}"],
         "parallel.logical_axes: parameter 'blocks/0/attn/to_out/bias': unknown logical axis "
         "'width'"),
    ],
    ids=["no-module", "no-attribute", "not-callable", "no-rngs", "bad-kwargs", "bad-loss",
         "unmapped-name"],
)
def test_cli_bad_factory_or_loss_exits_2_in_one_line(overrides, message, user_module,
                                                    tmp_path, capsys):
    argv = ["train", *RUN, *DP2_TP4, f"train.workdir={tmp_path / 'run'}", "--no-progress",
            *(o.replace("{m}", user_module) for o in overrides)]
    assert main(argv) == 2
    err = _without_imports(capsys.readouterr().err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("meshkit train: error: " + message.replace("{m}", user_module)), err
    assert not (tmp_path / "run").exists()


def test_cli_finds_a_factory_in_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "usergpt_cwd.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:  # found and imported (then refused for its signature): not "no module named"
        assert main(["train", "mesh.axes={dp: 1}", *NO_EXPERTS, "model.factory=usergpt_cwd:no_rngs",
                     f"train.workdir={tmp_path / 'run'}"]) == 2
    finally:
        sys.modules.pop("usergpt_cwd", None)
    assert capsys.readouterr().err.splitlines() == [
        "meshkit train: importing model.factory usergpt_cwd:no_rngs from ./usergpt_cwd.py",
        "meshkit train: error: model.factory: usergpt_cwd:no_rngs has no parameter named "
        "'rngs': meshkit calls it as no_rngs(rngs=...), and only a function written for "
        "meshkit takes that"]
    assert str(tmp_path) not in sys.path  # only while the command ran


def _without_imports(err: str) -> str:
    """stderr without the lines announcing the user's imports."""
    return "".join(line for line in err.splitlines(keepends=True)
                   if not line.startswith("meshkit train: importing "))
