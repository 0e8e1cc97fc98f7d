"""Issue 34, item 3: a checkpoint records the order of the transformer's stacked layers,
and a resume whose pipeline layout orders them otherwise is refused in one line."""

from __future__ import annotations

import re

import pytest
from _layouts import _config

from meshkit.config import Config, ConfigError
from meshkit.training import train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.layout import check_layout, layer_layout

PP2 = ["mesh.axes={pp: 2, dp: 2, device: 2}", "parallel.pipeline=pp",
       "parallel.microbatches=2", "exchange.node_axis=[]", "model.num_layers=4"]
PP4 = ["mesh.axes={pp: 4, device: 2}", "parallel.pipeline=pp", "parallel.microbatches=4",
       "exchange.node_axis=[]", "model.num_layers=8"]
INTERLEAVED = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]


def _layout(*overrides: str) -> dict:
    return layer_layout(_config(list(overrides)))


def _refusal(saved: dict, current: dict, *, assumed: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        check_layout(saved, current, assumed=assumed, where="checkpoint 2")
    assert e.value.exit_code == 2
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("saved", "current", "keys", "then", "now"), [
    (["parallel.schedule=1f1b"], INTERLEAVED,
     "parallel.schedule, parallel.virtual_stages",
     "parallel.schedule='1f1b', parallel.virtual_stages=1",
     "parallel.schedule='interleaved', parallel.virtual_stages=2"),
    (INTERLEAVED, ["parallel.schedule=1f1b"],
     "parallel.schedule, parallel.virtual_stages",
     "parallel.schedule='interleaved', parallel.virtual_stages=2",
     "parallel.schedule='1f1b', parallel.virtual_stages=1"),
    (["parallel.stage_layers=[1, 3]"], [], "parallel.stage_layers",
     "parallel.stage_layers=[1, 3]", "parallel.stage_layers=None"),
])
def test_a_resume_into_another_layer_order_is_refused_naming_the_keys(saved, current, keys,
                                                                       then, now):
    message = _refusal(_layout(*PP2, *saved), _layout(*PP2, *current))
    assert message == (
        f"{keys}: checkpoint 2 stores the layers in the order of {then}, and this run's "
        f"order is that of {now}; resume with the checkpoint's values (a checkpoint "
        "restores only into a layout that orders the layers alike)")


def test_another_virtual_stage_count_or_stage_count_is_refused_naming_it():
    v2 = _layout(*PP4, *INTERLEAVED)  # 8 layers: 4 stages of 2 chunks of 1
    v1 = _layout(*PP4, "parallel.schedule=interleaved")  # layers in order
    assert _refusal(v2, v1).startswith(
        "parallel.virtual_stages: checkpoint 2 stores the layers in the order of "
        "parallel.virtual_stages=2, and this run's order is that of parallel.virtual_stages=1;")
    pp2 = _layout(*PP2, "model.num_layers=8", *INTERLEAVED)  # chunks of 2 layers
    assert _refusal(pp2, v2).startswith(
        "mesh.axes.pp: checkpoint 2 stores the layers in the order of mesh.axes.pp=2, and "
        "this run's order is that of mesh.axes.pp=4;")


@pytest.mark.parametrize(("saved", "current"), [
    (["parallel.schedule=1f1b"], ["parallel.schedule=gpipe"]),
    (["parallel.schedule=gpipe"], ["parallel.schedule=1f1b"]),
    (["parallel.stage_layers=[2, 2]"], ["parallel.schedule=1f1b"]),  # an even split
    (INTERLEAVED, INTERLEAVED),
])
def test_layouts_that_order_the_layers_alike_resume(saved, current):
    check_layout(_layout(*PP2, *saved), _layout(*PP2, *current),
                 assumed=None, where="checkpoint 2")


def test_another_stage_count_in_layer_order_resumes():
    check_layout(_layout(*PP2, "model.num_layers=8"), _layout(*PP4),
                 assumed=None, where="checkpoint 2")
    check_layout(layer_layout(Config()), _layout(*PP2, "model.num_layers=2"),
                 assumed=None, where="checkpoint 2")


def test_a_checkpoint_without_a_layout_has_that_of_the_saved_config_else_the_default():
    interleaved, in_order = _layout(*PP2, *INTERLEAVED), _layout(*PP2)
    for missing in (None, {"schedule": "interleaved"}):  # none, or one that cannot be read
        check_layout(missing, interleaved, assumed=interleaved, where="checkpoint 2")
        check_layout(missing, in_order, assumed=None, where="checkpoint 2")
        assert _refusal(missing, interleaved).startswith(
            "parallel.schedule, parallel.virtual_stages: checkpoint 2 stores the layers in "
            "the order of parallel.schedule='gpipe', parallel.virtual_stages=1,")
        assert _refusal(missing, in_order, assumed=interleaved).startswith(
            "parallel.schedule, parallel.virtual_stages: checkpoint 2 stores the layers in "
            "the order of parallel.schedule='interleaved'")


def test_train_records_the_layout_and_refuses_another_order_before_compiling(tmp_path,
                                                                           monkeypatch):
    run = [*PP2, "train.steps=1", "train.eval_batches=1", f"train.workdir={tmp_path}"]
    train(_config([*run, "parallel.schedule=1f1b"]), verbose=False)
    refusal = (r"^parallel\.schedule, parallel\.virtual_stages: checkpoint "
               rf"{re.escape(str(tmp_path))}/checkpoints/1 stores the layers in the order of "
               r"parallel\.schedule='1f1b', parallel\.virtual_stages=1, and this run's order "
               r"is that of parallel\.schedule='interleaved', parallel\.virtual_stages=2; ")
    with pytest.raises(ConfigError, match=refusal):
        train(_config([*run, *INTERLEAVED]), verbose=False)
    with monkeypatch.context() as m:  # a checkpoint without the record: config.yaml's
        m.setattr(Checkpointer, "saved_metadata", lambda self, step, key: None)
        with pytest.raises(ConfigError, match=refusal):
            train(_config([*run, *INTERLEAVED]), verbose=False)
    # The checkpoint is still there and restores under its own layout, or gpipe's.
    for schedule in ("1f1b", "gpipe"):
        resumed = train(_config([*run, f"parallel.schedule={schedule}"]), verbose=False)
        assert (resumed.start_step, resumed.losses) == (1, [])
