"""Issue 35: a user's model pipelined through the trainer.

A Qwen3-style decoder of plain ``nnx.Embed``/``nnx.Linear``/``nnx.Einsum`` layers
(``tests/_user_qwen3_stacked.py``: ``embed``, 4 stacked decoder layers, ``head``) trains on
pp2×dp4 (1F1B: pp2×dp2×tp2) under every schedule with the losses of one device, from ``train(config,
model=...)``, from a config's ``model.factory`` and from the command line; its pipeline
permutes run between the two stages' same-index devices. A model without the pipeline
protocol on a pipeline axis is refused before anything compiles: exit 2, naming
``parallel.pipeline``.

One 1-device baseline, 4 steps each, width 16.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import _user_qwen3_stacked as qwen3
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshkit
import meshkit.training.loop as loop_module
from meshkit.cli import main
from meshkit.config import ConfigError, load_config
from meshkit.errors import UserCodeError
from meshkit.model.pipelined import pipeline_parts
from meshkit.training import Hook, train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.metrics import read_metrics
from meshkit.training.models import build_model, resolve_model
from meshkit.training.pipelining import plan_pipeline
from meshkit.training.programs import Programs, compile_step

LAYERS = 4
LOGICAL = "parallel.logical_axes={" + ", ".join(
    f"{k}: {'null' if v is None else v}" for k, v in qwen3.LOGICAL.items()) + "}"
RUN = ["train.batch_size=8", "train.seq_len=8", "train.steps=4", "train.warmup_steps=0",
       "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=1000",
       "train.eval_batches=1", "exchange.node_axis=[]", "exchange.device_axis=[]",
       f"model.vocab_size={qwen3.VOCAB}", LOGICAL]
FACTORY = ["model.factory=_user_qwen3_stacked:make", f"model.factory_kwargs={{layers: {LAYERS}}}",
           "model.loss=_user_qwen3_stacked:loss"]
ONE = ["mesh.axes={dp: 1}"]
PP2_DP4 = ["mesh.axes={pp: 2, dp: 4}", "parallel.pipeline=pp", "parallel.microbatches=2"]
GPIPE = [*PP2_DP4, "parallel.schedule=gpipe"]
# Tensor-parallel stages too: the head's vocabulary split over tp inside the schedule.
ONE_F_ONE_B = ["mesh.axes={pp: 2, dp: 2, tp: 2}", "parallel.pipeline=pp",
               "parallel.microbatches=2", "parallel.tensor=tp", "parallel.schedule=1f1b"]
INTERLEAVED = [*PP2_DP4, "parallel.schedule=interleaved", "parallel.virtual_stages=2"]


def _config(workdir: Path, *layout: str):
    return load_config(None, [*RUN, *FACTORY, *layout, f"train.workdir={workdir}"])


def _make(rngs: nnx.Rngs) -> nnx.Module:
    return qwen3.make(rngs, layers=LAYERS)


def _losses(result) -> list[float]:
    return [value for _, value in result.losses]


def _train(workdir: Path, *layout: str, **kwargs):
    return train(_config(workdir, *layout), verbose=False, progress=False, **kwargs)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> list[float]:
    return _losses(_train(tmp_path_factory.mktemp("one") / "run", *ONE))


def test_gpipe_through_train_model_matches_one_device(one_device, tmp_path):
    workdir = tmp_path / "run"
    config = load_config(None, [*RUN, *GPIPE, f"train.workdir={workdir}"])
    result = train(config, model=_make, loss=qwen3.loss, verbose=False, progress=False)
    np.testing.assert_allclose(_losses(result), one_device, rtol=1e-5)
    assert one_device[-1] < one_device[0]  # it learns
    # The loss's own metrics come out of the pipelined step.
    for row in read_metrics(workdir):
        assert row["ce_loss"] == pytest.approx(row["loss"]) and row["logit_ms"] > 0


@pytest.mark.parametrize("layout", [GPIPE, ONE_F_ONE_B], ids=["gpipe", "1f1b"])
def test_the_permutes_run_between_the_stages_same_index_devices(layout, tmp_path):
    # The programs the runs here compile: persistent-cache hits.
    compiled = compile_step(_config(tmp_path, *layout))
    permutes = {frozenset(c.groups) for c in meshkit.collectives(compiled)
                if c.op == "collective-permute"}
    # pp is the mesh's first axis of 2: stage 0 is devices 0-3, stage 1 devices 4-7.
    forward = frozenset((d, d + 4) for d in range(4))
    backward = frozenset((d + 4, d) for d in range(4))
    assert forward in permutes and backward in permutes, permutes
    if "parallel.tensor=tp" not in layout:
        assert permutes == {forward, backward}, permutes
    # With tp, XLA also reorders the vocab-split embedding table over all 8 devices for
    # nnx.Embed's gather (and its scatter-add): a [VOCAB/2, WIDTH] share, outside the
    # pipeline.


def test_1f1b_from_the_command_line_matches_one_device(one_device, tmp_path, capsys):
    workdir = tmp_path / "run"
    argv = ["train", *RUN, *FACTORY, *ONE_F_ONE_B, f"train.workdir={workdir}", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = read_metrics(workdir)
    np.testing.assert_allclose([r["loss"] for r in rows], one_device, rtol=1e-5)
    # The loss's metrics come out of the schedule: means over the microbatches.
    for row in rows:
        assert row["ce_loss"] == pytest.approx(row["loss"]) and row["logit_ms"] > 0
    assert "eval_loss" in rows[-1]


def test_interleaved_matches_one_device_and_resumes_on_one_device(one_device, tmp_path):
    workdir = tmp_path / "run"
    stopped = tmp_path / "stopped-at-3"

    def snapshot(info):
        if info.step == 3:  # the step-2 checkpoint saved, as a run killed there left it
            shutil.copytree(workdir, stopped, ignore=shutil.ignore_patterns(".lock"))

    result = _train(workdir, *INTERLEAVED, hooks=[Hook(snapshot, every=1)])
    np.testing.assert_allclose(_losses(result), one_device, rtol=1e-5)
    # The layers are saved in their natural order: the checkpoint restores on one device.
    assert Checkpointer(stopped / "checkpoints").all_steps() == [2]
    resumed = _train(stopped, *ONE)
    assert resumed.start_step == 2
    np.testing.assert_allclose(_losses(resumed), one_device[2:], rtol=1e-5)


# ----------------------------------------------------------------- refusals, no compile
@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the run could not work")

    monkeypatch.setattr(loop_module, "_compile", refuse)


def test_a_model_without_the_protocol_is_refused_naming_parallel_pipeline(tmp_path,
                                                                         no_compile):
    config = load_config(None, [*RUN, *GPIPE, f"train.workdir={tmp_path}"])
    with pytest.raises(ConfigError, match=(
            r"^parallel.pipeline: axis 'pp' runs a model's layers as pipeline stages, but "
            r"model=make_flat's model: its layers are a List, not one nnx.Module of stacked "
            r"layers; stack them .*meshkit.Pipelined\(embed=")):
        train(config, model=qwen3.make_flat, loss=qwen3.loss, verbose=False, progress=False)

    def plain(rngs: nnx.Rngs) -> nnx.Module:
        return nnx.Linear(4, qwen3.VOCAB, rngs=rngs)

    with pytest.raises(ConfigError, match=r"^parallel.pipeline: .* but .*plain's model has "
                       r"no embed, layers, head: "):
        train(config, model=plain, verbose=False, progress=False)


def test_a_factory_of_meshkits_transformer_runs_its_own_schedules(tmp_path):
    config = load_config(None, [*RUN, *GPIPE, "model.num_layers=2", "model.d_model=16",
                                "model.num_heads=2", "model.d_ff=16", "model.num_experts=2",
                                f"train.workdir={tmp_path}"])
    spec = resolve_model(config, model=lambda rngs: build_model(config, rngs=rngs))
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(spec.rules.flax_rules()):
        model = nnx.eval_shape(lambda: spec.factory(nnx.Rngs(0)))
    assert not spec.transformer and plan_pipeline(config, spec, model, mesh) is None

    class ArrayEmbedding(nnx.Module):  # the parts' names, but a table, not a module
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Param(jnp.zeros((qwen3.VOCAB, 4)))
            self.layers = qwen3.make(rngs, layers=2).layers
            self.head = nnx.Linear(4, qwen3.VOCAB, rngs=rngs)

    spec = resolve_model(config, model=ArrayEmbedding)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(spec.rules.flax_rules()):
        model = nnx.eval_shape(lambda: spec.factory(nnx.Rngs(0)))
    with pytest.raises(ConfigError, match=r"model=.*ArrayEmbedding's model: its embed is a "
                       r"Param, not a callable module"):
        plan_pipeline(config, spec, model, mesh)


def test_the_command_line_exits_2_naming_parallel_pipeline(tmp_path, capsys, no_compile):
    argv = ["train", *RUN, *FACTORY, "model.factory=_user_qwen3_stacked:make_flat", *ONE_F_ONE_B,
            f"train.workdir={tmp_path}", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines()
              if not line.startswith("meshkit train: importing ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("meshkit train: error: parallel.pipeline: axis 'pp' "), err
    assert "model.factory: _user_qwen3_stacked:make_flat's model" in errors[0], err


@pytest.mark.parametrize(("layout", "message"), [
    ([*GPIPE, "mesh.axes={pp: 4, dp: 2}", "model.factory_kwargs={layers: 2}"],
     r"^parallel.pipeline: 4 stages \(axis 'pp'\) do not divide the 2 stacked layers of "
     r"model.factory: _user_qwen3_stacked:make's model"),
    ([*INTERLEAVED, "parallel.virtual_stages=4"],
     r"^parallel.virtual_stages: 4 does not divide the 2 layers per stage"),
    ([*GPIPE, "parallel.stage_layers=[1, 3]"],
     r"^parallel.stage_layers: uneven stages are for meshkit's transformer"),
    ([*ONE, "parallel.microbatches=2"],
     r"^parallel.microbatches: 2 microbatches need a pipeline axis"),
], ids=["stages", "virtual_stages", "stage_layers", "microbatches"])
def test_pipeline_settings_the_model_cannot_take_are_refused(layout, message, tmp_path):
    config = _config(tmp_path, *layout)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=message):
        Programs(config, mesh)


def _skips_a_token(model, batch):
    logits = model(batch[:, :-2])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 2:]).mean()


def _twice(model, batch):
    return model(batch[:, :-1]).mean() + model(batch[:, 1:]).mean()


def _never(model, batch):
    return model.head(model.embed(batch)).mean()


def _with_options(model, batch):
    return model(batch[:, :-1], deterministic=True).mean()


@pytest.mark.parametrize(("layout", "loss", "message"), [
    (ONE_F_ONE_B, _skips_a_token, r"^loss=_skips_a_token called the model on tokens of shape "
     r"\(4, 7\); under parallel.schedule '1f1b' the model's input is a microbatch's "
     r"batch\[:, :-1\], of shape \(4, 8\)"),
    (ONE_F_ONE_B, _twice, r"^loss=_twice called the model twice; under parallel.schedule "
     r"'1f1b' the loss calls it once"),
    (GPIPE, _never, r"^loss=_never never called the model; under parallel.pipeline the "
     r"trainer pipelines the model's call"),
    (GPIPE, _with_options, r"^loss=_with_options called the model with more than the "
     r"tokens \(deterministic=\); under parallel.pipeline its call runs embed"),
], ids=["1f1b-tokens", "1f1b-twice", "gpipe-never", "gpipe-options"])
def test_a_loss_must_call_the_pipelined_model_as_the_schedule_needs(layout, loss, message,
                                                                    tmp_path):
    config = _config(tmp_path, *layout)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh, loss=loss)
        with pytest.raises(UserCodeError, match=message):
            programs.train_step.lower(programs.abstract_state, programs.abstract_batch)


def test_pipelined_runs_its_layers_in_order_and_names_what_it_lacks():
    model = qwen3.make(nnx.Rngs(0), layers=2)
    wrapped = meshkit.Pipelined(embed=model.embed, layers=model.layers, head=model.head)
    tokens = np.arange(4, dtype=np.int32).reshape(1, 4)
    call = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(call(wrapped, tokens), call(model, tokens), rtol=1e-6)
    assert pipeline_parts(wrapped).num_layers == 2
    with pytest.raises(TypeError, match=r"^Pipelined: head must be an nnx.Module, got function"):
        meshkit.Pipelined(embed=model.embed, layers=model.layers, head=lambda h: h)
    with nnx.use_eager_sharding(False):
        one = nnx.Linear(16, 16, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("embed", "embed")), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"^Pipelined: its layers are not stacked: variable "
                       r"'layers/kernel' has shape \(16, 16\) named \('embed', 'embed'\)"):
        meshkit.Pipelined(embed=model.embed, layers=one, head=model.head)
