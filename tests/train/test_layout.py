"""Issue 34, item 3: a checkpoint records the order of the transformer's stacked layers,
and a resume under a pipeline layout that orders them otherwise moves every layer (and
its AdamW moments) to its slot there."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layouts import _config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.config import Config
from meshkit.training import train
from meshkit.training.checkpoint import Checkpointer
from meshkit.training.layout import Moves, layer_layout, layer_moves, reorder, saved_target

PP2 = ["mesh.axes={pp: 2, dp: 2, device: 2}", "parallel.pipeline=pp",
       "parallel.microbatches=2", "exchange.node_axis=[]", "model.num_layers=4"]
PP4 = ["mesh.axes={pp: 4, device: 2}", "parallel.pipeline=pp", "parallel.microbatches=4",
       "exchange.node_axis=[]", "model.num_layers=8"]
ONE_F_ONE_B = ["parallel.schedule=1f1b"]
INTERLEAVED = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]


def _layout(*overrides: str) -> dict:
    return layer_layout(_config(list(overrides)))


@pytest.mark.parametrize(("first", "then"), [(ONE_F_ONE_B, INTERLEAVED),
                                             (INTERLEAVED, ONE_F_ONE_B)],
                         ids=["1f1b-to-interleaved", "interleaved-to-1f1b"])
def test_a_resume_under_another_layer_order_continues_as_the_uninterrupted_run(
        tmp_path, first, then):
    # Steps 2 and 3 after the step-1 checkpoint: step 3's loss follows an update made
    # with the restored AdamW moments, so they must have moved with their layers.
    run = [*PP2, "train.steps=3", "train.warmup_steps=0", "train.checkpoint_every=1",
           "train.keep_checkpoints=3", "train.log_every=1", "train.eval_batches=1",
           f"train.workdir={tmp_path}"]
    whole = train(_config([*run, *first]), verbose=False)
    for step in (2, 3):
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    resumed = train(_config([*run, *then]), verbose=False)
    assert resumed.start_step == 1 and [s for s, _ in resumed.losses] == [2, 3]
    np.testing.assert_allclose([loss for _, loss in resumed.losses],
                               [loss for _, loss in whole.losses[1:]], rtol=1e-5)


@pytest.mark.parametrize(("saved", "current"), [
    (ONE_F_ONE_B, ["parallel.schedule=gpipe"]),
    (["parallel.schedule=gpipe"], ONE_F_ONE_B),
    (["parallel.stage_layers=[2, 2]"], ONE_F_ONE_B),  # an even split
    (INTERLEAVED, INTERLEAVED),
])
def test_layouts_that_order_the_layers_alike_restore_as_they_are(saved, current):
    assert layer_moves(_layout(*PP2, *saved), _layout(*PP2, *current), assumed=None) is None


def test_another_stage_count_in_layer_order_restores_as_it_is():
    assert layer_moves(_layout(*PP2, "model.num_layers=8"), _layout(*PP4), assumed=None) is None
    assert layer_moves(layer_layout(Config()), _layout(*PP2, "model.num_layers=2"),
                       assumed=None) is None


@pytest.mark.parametrize(("saved", "current", "moves"), [
    ([*PP2, *ONE_F_ONE_B], [*PP2, *INTERLEAVED], Moves((0, 1, 2, 3), 4, (0, 2, 1, 3), 4)),
    ([*PP2, "parallel.stage_layers=[1, 3]"], PP2, Moves((0, 3, 4, 5), 6, (0, 1, 2, 3), 4)),
    # 8 layers interleaved: 4 stages of 2 chunks of 1, or 1 chunk of 2, or 2 stages.
    ([*PP4, *INTERLEAVED], [*PP4, "parallel.schedule=interleaved"],
     Moves((0, 2, 4, 6, 1, 3, 5, 7), 8, tuple(range(8)), 8)),
    ([*PP2, "model.num_layers=8", *INTERLEAVED], [*PP4, *INTERLEAVED],
     Moves((0, 1, 4, 5, 2, 3, 6, 7), 8, (0, 2, 4, 6, 1, 3, 5, 7), 8)),
])
def test_another_schedule_virtual_stage_count_stage_layers_or_stage_count_moves_the_layers(
        saved, current, moves):
    assert layer_moves(_layout(*saved), _layout(*current), assumed=None) == moves


def test_a_checkpoint_without_a_layout_has_that_of_the_saved_config_else_the_default():
    interleaved, in_order = _layout(*PP2, *INTERLEAVED), _layout(*PP2)
    for missing in (None, {"schedule": "interleaved"}):  # none, or one that cannot be read
        assert layer_moves(missing, interleaved, assumed=interleaved) is None
        assert layer_moves(missing, in_order, assumed=None) is None
        assert layer_moves(missing, interleaved, assumed=None).target == (0, 2, 1, 3)
        assert layer_moves(missing, in_order, assumed=interleaved).source == (0, 2, 1, 3)


def test_uneven_stages_restore_onto_a_mesh_that_does_not_divide_them(tmp_path):
    # 4 layers saved as stage_layers [1, 1, 2] (6 slots: 0 | 2 | 4, 5) and restored on 4
    # stages in order: the saved dimension of 6 stays whole on the 4-way pipeline axis.
    moves = layer_moves(_layout(*PP4, "model.num_layers=4", "mesh.axes={pp: 3, device: 2}",
                                "parallel.microbatches=2", "parallel.stage_layers=[1, 1, 2]"),
                        _layout(*PP4, "model.num_layers=4"), assumed=None)
    assert moves == Moves((0, 2, 4, 5), 6, (0, 1, 2, 3), 4)
    mesh = jax.make_mesh((4,), ("pp",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    pp, whole = NamedSharding(mesh, P("pp", None)), NamedSharding(mesh, P())
    saved = {"layers": {"w": jnp.arange(12.0).reshape(6, 2)}, "head": jnp.ones(3)}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, jax.device_put(saved, {"layers": {"w": whole}, "head": whole}))
    target = {"layers": {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=pp)},
              "head": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=whole)}
    onto = saved_target(target, moves)
    assert (onto["layers"]["w"].shape, onto["layers"]["w"].sharding.spec) == ((6, 2), P(None, None))
    assert onto["head"] is target["head"]
    got = reorder(ckpt.restore(1, onto), moves, {"layers": {"w": pp}, "head": whole})
    np.testing.assert_array_equal(got["layers"]["w"], [[0, 1], [4, 5], [8, 9], [10, 11]])
    assert got["layers"]["w"].sharding == pp
    np.testing.assert_array_equal(got["head"], np.ones(3))
    ckpt.close()
