"""Training: the loss falls, exchanges agree, resume is exact, NaN stops, bad configs exit 2."""

import json
import logging
import math
import os
import re
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _configs import SMALL

import meshkit.training.builtin_hooks as hooks_module
import meshkit.training.loop as train_module
import meshkit.training.models as models_module
import meshkit.training.programs as programs_module
from meshkit.cli import main
from meshkit.config import Config, load_config
from meshkit.errors import Preempted, TrainingDiverged
from meshkit.plan.flops import flops_per_token
from meshkit.training import Hook, train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.metrics import read_metrics


def small(tmp_path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"train.workdir={tmp_path}", *extra])


def record_fetches(monkeypatch) -> list[list[int]]:
    """The steps of each copy of metrics to the host, in order, from now on."""
    fetches: list[list[int]] = []
    original = train_module._fetch

    def recording(pending):
        fetches.append([step for step, _ in pending])
        return original(pending)

    monkeypatch.setattr(train_module, "_fetch", recording)
    return fetches


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 20-step run (hierarchical exchange), shared by several tests,
    with the steps of each fetch of metrics to the host."""
    workdir = tmp_path_factory.mktemp("reference")
    config = small(workdir, "train.steps=20", "train.checkpoint_every=10",
                   "exchange.method=hierarchical")
    with pytest.MonkeyPatch.context() as monkeypatch:
        fetches = record_fetches(monkeypatch)
        result = train(config, verbose=False)
    return config, result, fetches


def test_loss_falls_and_metrics_are_written(reference):
    config, result, _ = reference
    losses = [loss for _, loss in result.losses]
    assert [s for s, _ in result.losses] == list(range(1, 21))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2
    assert math.isfinite(result.eval_loss) and result.entropy_rate is not None
    rows = read_metrics(config.train.workdir)
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    for key in ("loss", "tokens_per_s", "dropped_fraction", "grad_norm", "lr", "nodes_per_token",
                "tflops_per_device"):
        assert all(key in r for r in rows), key
    assert "eval_loss" in rows[-1] and "entropy_rate" in rows[-1]
    assert rows[-1]["loss"] == pytest.approx(losses[-1])
    assert np.asarray(rows[-1]["expert_load"]).shape == (1, config.model.num_experts)
    assert Checkpointer(f"{config.train.workdir}/checkpoints").all_steps() == [10, 20]
    # Model FLOPs: tokens/s x training FLOPs per token over the 8 devices; no MFU on CPU.
    per_token = flops_per_token(config.model, seq_len=config.train.seq_len).training
    for r in rows:
        assert r["tflops_per_device"] == pytest.approx(r["tokens_per_s"] * per_token / 8 / 1e12)
        assert "mfu" not in r
    assert result.tflops_per_device == pytest.approx(result.tokens_per_s * per_token / 8 / 1e12)
    assert result.mfu is None
    # XLA's count of the compiled step, next to it: more (padding, softmax, optimizer...).
    assert result.flops_per_token == per_token and result.xla_flops_per_token > per_token
    assert all(r["xla_tflops_per_device"] > r["tflops_per_device"] for r in rows)


def test_metrics_stay_on_the_device_until_a_log_or_checkpoint_step(reference):
    _, result, fetches = reference
    # log_every=5, checkpoint_every=10: four copies to the host in 20 steps, each of the
    # steps queued since the last one, every step's loss kept.
    assert fetches == [list(range(1, 6)), list(range(6, 11)), list(range(11, 16)),
                       list(range(16, 21))]
    assert [s for s, _ in result.losses] == list(range(1, 21))


def test_sigterm_between_fetches_fetches_checks_and_saves_that_step(reference, tmp_path,
                                                                    monkeypatch):
    config, whole, _ = reference
    original = programs_module.load_batch

    def load(dataset, step, **kwargs):
        if step == 7 and kwargs["split"] == "train":  # while step 7 runs, before step 8
            os.kill(os.getpid(), signal.SIGTERM)
        return original(dataset, step, **kwargs)

    monkeypatch.setattr(programs_module, "load_batch", load)
    fetches = record_fetches(monkeypatch)
    with pytest.raises(Preempted, match=r"^stopped by SIGTERM after step 7; checkpoint "):
        train(config.replace(train={"workdir": str(tmp_path)}), verbose=False)
    # Steps 6 and 7 were queued (log_every=5); the signal made step 7 a fetch point, its
    # checkpoint written after both were checked.
    assert fetches == [[1, 2, 3, 4, 5], [6, 7]]
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [7]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [5] and rows[0]["loss"] == pytest.approx(whole.losses[4][1])


def test_a_row_reports_mfu_on_a_device_of_known_peak(reference):
    config, _, _ = reference
    per_token = flops_per_token(config.model, seq_len=config.train.seq_len).training
    rate = hooks_module._Rate(config, hooks_module.Flops(per_token, xla_per_token=2 * per_token))
    rate._kind = "NVIDIA H100 80GB HBM3"  # no GPU here: the row as one would write it
    metrics = {"loss": 2.0, "ce_loss": 1.9, "aux_loss": 1.0, "z_loss": 0.1, "grad_norm": 0.5,
               "dropped": 3, "assignments": 100, "expert_load": np.full((1, 8), 0.125),
               "nodes_per_token": 1.5}
    row = hooks_module._row(7, metrics, lr=programs_module.make_lr(config), rate=rate,
                            tokens_per_s=1e6)
    assert row["tflops_per_device"] == pytest.approx(1e6 * per_token / 8 / 1e12)
    assert row["xla_tflops_per_device"] == pytest.approx(2 * row["tflops_per_device"])
    assert row["mfu"] == pytest.approx(1e6 * per_token / 8 / 989e12)
    assert row["dropped_fraction"] == 0.03 and row["step"] == 7
    assert "dropped" not in row and row["expert_load"] == [[0.125] * 8]


def test_flat_exchange_and_the_fetch_every_step_loop_give_the_same_losses(
    reference, tmp_path, monkeypatch
):
    _, hierarchical, _ = reference
    fetches = record_fetches(monkeypatch)
    # One run checks two things: the flat exchange, and the old loop (one step in flight,
    # the benchmark's baseline), which must fetch each step alone and change no result.
    flat = train(small(tmp_path, "train.steps=20", "exchange.method=flat"), verbose=False,
                 sync_every_step=True)
    assert fetches == [[step] for step in range(1, 21)]
    np.testing.assert_allclose([loss for _, loss in flat.losses],
                               [loss for _, loss in hierarchical.losses], rtol=1e-5)
    assert [r["step"] for r in read_metrics(tmp_path)] == [5, 10, 15, 20]


def test_resume_after_a_crash_matches_an_uninterrupted_run(reference, tmp_path, monkeypatch):
    _, whole, _ = reference
    config = small(tmp_path, "train.steps=20", "train.checkpoint_every=10",
                   "exchange.method=hierarchical")

    def crash(info):
        if info.step == 15:
            raise KeyboardInterrupt("simulated crash after the step-10 checkpoint")

    with pytest.raises(KeyboardInterrupt):
        train(config, verbose=False, hooks=[Hook(crash, every=5)])
    resumed = train(config, verbose=False)
    assert resumed.start_step == 10
    np.testing.assert_allclose([loss for _, loss in resumed.losses],
                               [loss for _, loss in whole.losses[10:]], rtol=1e-6)
    # The metrics file holds each step once: the crashed run's step 15 row was dropped.
    assert [r["step"] for r in read_metrics(tmp_path)] == [5, 10, 15, 20]
    # Rerunning a finished run trains nothing and evaluates the final state.
    again = train(config, verbose=False)
    assert again.losses == [] and again.final_step == 20
    assert again.eval_loss == pytest.approx(resumed.eval_loss, rel=1e-6)


def test_expert_weights_and_their_adam_moments_are_sharded(reference):
    config, _, _ = reference
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = programs_module.Programs(config, mesh)
        state = programs.init()
    experts = config.model.num_experts // config.num_expert_devices
    sharded = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
               if "w_up" in jax.tree_util.keystr(path)]
    assert len(sharded) == 3  # the weight, Adam's mu and nu
    for path, leaf in sharded:
        shards = leaf.addressable_shards
        assert len(shards) == 8
        # [L, E, d, f]: the expert dimension is split, the layer dimension is whole.
        assert {s.data.shape[:2] for s in shards} == {(1, experts)}, path
        starts = sorted(s.index[1].start for s in shards)
        assert starts == [i * experts for i in range(8)], path


def test_nan_loss_or_gradient_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch, capsys
):
    overrides = [*SMALL, f"train.workdir={tmp_path}", "train.steps=12", "train.checkpoint_every=3"]
    config = load_config(None, overrides)

    def crash(row):
        if row["step"] == 10:
            raise KeyboardInterrupt("stop after the step-9 checkpoint")

    # on_log is deprecated but still sees every metrics row, as before 0.2.
    with pytest.raises(KeyboardInterrupt), pytest.warns(DeprecationWarning,
                                                        match=r"hooks=\[Hook\(fn"):
        train(config, verbose=False, on_log=crash)
    original = models_module.transformer_loss

    def nan_loss(model, batch):
        loss, aux = original(model, batch)
        return loss * jnp.nan, aux

    def nan_gradient(model, batch):
        # The value stays finite (where picks 0) but d/dw sqrt(negative) is NaN.
        loss, aux = original(model, batch)
        bad = jnp.where(True, 0.0, jnp.sqrt(-1.0 - jnp.abs(model.head[...]).sum()))
        return loss + bad, aux

    monkeypatch.setattr(models_module, "transformer_loss", nan_loss)
    fetches = record_fetches(monkeypatch)
    # log_every=4: steps 10 and 11 stay on the device; the fetch before the step-12
    # checkpoint finds the first bad step and no checkpoint is written.
    with pytest.raises(TrainingDiverged,
                       match=r"loss became nan \(gradient norm nan\) at step 10.*\(step 9\)"):
        train(config.replace(train={"log_every": 4}), verbose=False)
    assert fetches == [[10, 11, 12]]
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 9
    monkeypatch.setattr(models_module, "transformer_loss", nan_gradient)
    assert main(["train", *overrides, "--no-progress"]) == 3
    assert re.search(r"loss became \d\.\d+ \(gradient norm nan\) at step 10.*\(step 9\) "
                     r"in .* predates it and is intact", capsys.readouterr().err)
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 9
    monkeypatch.setattr(models_module, "transformer_loss", original)
    resumed = train(config, verbose=False)
    assert resumed.start_step == 9 and all(math.isfinite(loss) for _, loss in resumed.losses)


def test_changed_model_in_an_old_workdir_is_refused(reference):
    config, _, _ = reference
    changed = config.replace(model={"d_ff": 64})
    with pytest.raises(ValueError, match=r"model.d_ff: 32 -> 64"):
        train(changed, verbose=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train.step=5"], "unknown config key 'train.step' (did you mean 'train.steps'?)"),
        (["model.num_experts=6"], "model.num_experts"),
        (["train.batch_size=12"], "train.batch_size"),
        (["model.d_model=0"], "model.d_model"),
        (["mesh.axes={node: 4, device: 4}", "train.batch_size=16", "model.num_experts=16"],
         "mesh needs 16 devices but only 8 are available"),
        (["missing.yaml"], "config file not found: missing.yaml"),
        # It aborted (exit 134) at the first all-reduce, after minutes of starting up.
        (["mesh.axes={dp: 2048}", "exchange.node_axis=[]", "exchange.device_axis=[]",
          "train.batch_size=2048"], "meshkit train: error: mesh.axes: 2,048 devices in one "
         "process are more than the 256 that meshkit train runs"),
        (["train.profile_steps=[3, 2]"], "train.profile_steps: start must be below stop, "
         "got [3, 2]"),
        (["train.profile_steps=[0, 2]"], "train.profile_steps: start must be >= 1"),
        (["train.steps=5", "train.profile_steps=[2, 7]"],
         "train.profile_steps: stop 7 is past the run's last step (train.steps=5"),
        (["train.profile_steps=4"], "train.profile_steps: input should be a valid list, got 4"),
        (["data.kind=text", "data.path=/no/such/book.txt", "model.vocab_size=256"],
         "/no/such/book.txt"),
    ],
)
def test_bad_configs_exit_2(argv, message, capsys, tmp_path):
    assert main(["train", *argv, f"train.workdir={tmp_path}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


def test_cli_train_writes_summary_and_a_profile(tmp_path, capsys):
    assert main(["train", *SMALL, "train.steps=2", f"train.workdir={tmp_path}",
                 "train.profile_steps=[2, 3]", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "eval loss" in err and "source entropy rate" in err
    assert re.search(r"tokens/s \([0-9.e-]+ model TFLOP/s per device\)", err), err
    # The trace of step 2, for TensorBoard (xplane.pb) and Perfetto (trace.json.gz).
    traces = list((tmp_path / "profile" / "plugins" / "profile").glob("*/*"))
    assert {p.name.split(".", 1)[1] for p in traces} >= {"xplane.pb", "trace.json.gz"}, traces
    assert all(p.stat().st_size > 0 for p in traces)
    saved = (tmp_path / "config.yaml").read_text()
    assert load_config(tmp_path / "config.yaml").train.steps == 2 and "markov" in saved
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_resuming_with_other_data_settings_warns(reference, caplog, tmp_path):
    config, _, _ = reference
    shutil.copytree(config.train.workdir, tmp_path / "run")
    result = train(config.replace(train={"seed": 1, "workdir": str(tmp_path / "run")}),
                   verbose=False)
    assert result.losses == [] and result.start_step == 20
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "warning: resuming" in warning.message and "train.seed: 0 -> 1" in warning.message
