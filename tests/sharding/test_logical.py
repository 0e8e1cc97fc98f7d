"""A model's own logical names: rules.extend, the placement of any model, and each error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit.errors import UsageError
from meshkit.model.pipeline import pipeline
from meshkit.sharding.linear import ColumnParallelLinear, ParallelEmbed, RowParallelLinear
from meshkit.sharding.place import logical_shardings, partition_specs, shard_model
from meshkit.sharding.rules import ShardingRules


def _mesh(**axes: int) -> jax.sharding.Mesh:
    return meshkit.Strategy.from_axes(axes).mesh()


def test_extend_maps_roles_logical_names_mesh_axes_and_none():
    rules = ShardingRules(data="dp", fsdp="f", tensor="tp").extend(
        mlp="tensor", kv="heads", seq=None, pair=["dp", "tp"], own="x")
    assert rules.axes("mlp") == ("tp",) and rules.axes("kv") == ("tp",)
    assert rules.axes("seq") == () and rules.axes("pair") == ("dp", "tp")
    assert rules.axes("own") == ("x",)
    # A later extend adds to the earlier names and may replace a built-in one.
    again = rules.extend(embed=None)
    assert again.axes("embed") == () and again.axes("mlp") == ("tp",)
    assert rules.axes("embed") == ("f",)  # the original is unchanged
    assert ("mlp", "tp") in rules.flax_rules() and ("seq", None) in rules.flax_rules()
    assert ShardingRules(tensor="tp", logical={"mlp": "tensor"}) == ShardingRules(
        tensor="tp").extend(mlp="tensor")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mlp": 3}, r"logical name 'mlp' maps to 3; give a role"),
        ({"mlp": ["tp", ""]}, r"logical name 'mlp' maps to \['tp', ''\]"),
    ],
)
def test_bad_logical_targets_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardingRules(tensor="tp").extend(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"w": "w"}, r"logical name 'w' maps to itself \(w → w\)"),
        ({"a": "b", "b": "a"}, r"logical names map to each other in a cycle \(a → b → a\)"),
        ({"a": "b", "b": "c", "c": "b"}, r"\(b → c → b\)"),
    ],
)
def test_logical_names_in_a_cycle_are_refused_naming_the_chain(kwargs, match):
    with pytest.raises(UsageError, match=match) as info:
        ShardingRules(tensor="tp").extend(**kwargs)
    assert "\n" not in str(info.value)


def test_names_of_one_extend_may_refer_to_each_other_in_any_order():
    rules = ShardingRules(tensor="tp").extend(up="ffn", ffn="tensor")
    assert rules.axes("up") == ("tp",) and rules.logical_names()[-2:] == ("up", "ffn")


def test_a_misspelt_role_is_named_where_the_mesh_is_known():
    rules = ShardingRules(tensor="tp").extend(width=None, ffn="tensors")
    culprit = (r"^ShardingRules: logical name 'ffn' maps to 'tensors', which is not a role "
               r"\(data, .*\) nor a mesh axis \(tp\); did you mean 'tensor'\?$")
    with pytest.raises(UsageError, match=culprit):
        shard_model(_linear(), _mesh(tp=8), rules)
    with pytest.raises(UsageError, match=culprit):
        partition_specs(nnx.eval_shape(_linear), _mesh(tp=8), rules)
    # An axis no role holds is a mesh axis once the mesh has it.
    own = ShardingRules(tensor="tp").extend(width="sp", ffn="tensor")
    assert partition_specs(_linear(), _mesh(sp=2, tp=4), own)["kernel"].get_value() == P(
        "sp", "tp")


def test_shard_model_refuses_what_is_not_a_module():
    with pytest.raises(UsageError, match=r"^shard_model: expected an nnx.Module, got dict"):
        shard_model({"w": jnp.ones(8)}, _mesh(tp=8))  # type: ignore[type-var]


def test_a_logical_name_must_be_an_identifier():
    with pytest.raises(ValueError, match=r"logical name 'a-b' must be an identifier"):
        ShardingRules(logical={"a-b": None})


def test_unknown_logical_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown logical axis 'hid'; valid: layers, .*, tok"):
        ShardingRules().spec("hid")


def test_mesh_spec_refuses_an_axis_on_two_dimensions():
    rules = ShardingRules(tensor="tp").extend(mlp="tensor")
    with pytest.raises(ValueError, match=r"mesh axis 'tp' shards two dimensions"):
        rules.mesh_spec(("heads", "mlp"), ["tp"])


def _linear(names=("width", "ffn"), shape=(8, 16)):
    with nnx.use_eager_sharding(False):
        return nnx.Linear(*shape, kernel_metadata={"out_sharding": names}, rngs=nnx.Rngs(0))


def test_any_model_is_placed_by_its_logical_names():
    mesh = _mesh(f=2, tp=4)
    rules = ShardingRules(fsdp="f", tensor="tp").extend(width="fsdp", ffn="tensor")
    layer = shard_model(_linear(), mesh, rules)
    assert layer.kernel[...].sharding.spec == P("f", "tp")
    assert layer.kernel[...].addressable_shards[0].data.shape == (4, 4)
    assert layer.bias[...].sharding.spec == P()  # no metadata: replicated
    # logical_shardings creates each device's share inside jit, the same placement.
    shardings = logical_shardings(nnx.eval_shape(_linear), mesh, rules)
    state = jax.jit(lambda: nnx.state(_linear()), out_shardings=shardings)()
    assert state["kernel"][...].sharding.spec == P("f", "tp")
    np.testing.assert_array_equal(state["kernel"][...], layer.kernel[...])


def test_placement_errors_name_the_parameter():
    mesh = _mesh(tp=8)
    with pytest.raises(ValueError, match=r"'kernel'.*'width' is not a mesh axis"):
        partition_specs(_linear(), mesh)  # logical names without rules
    rules = ShardingRules(tensor="tp").extend(width=None, ffn="tensor")
    with pytest.raises(ValueError, match=r"'kernel': dimension 1 \('ffn'\) of size 12 is not "
                                         r"divisible by the 8 devices of mesh axes \('tp',\)"):
        partition_specs(_linear(shape=(8, 12)), mesh, rules)
    with pytest.raises(ValueError, match=r"'kernel': sharding \('ffn',\) has 1 entries"):
        partition_specs(_linear(names=("ffn",)), mesh, rules)


def test_projection_errors_name_the_culprit():
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_axes has 1 names for 2"):
        ColumnParallelLinear(4, (2, 3), out_axes="mlp", rngs=nnx.Rngs(0))
    layer = RowParallelLinear(8, 4, in_axes="mlp", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"RowParallelLinear: x must be \[batch, ..., 8\], got"):
        layer(jnp.ones((2, 3, 6)))
    with pytest.raises(ValueError, match=r"ParallelEmbed: ids must be an integer"):
        ParallelEmbed(4, 2, rngs=nnx.Rngs(0))(jnp.ones((2, 3)))
    mesh = _mesh(dp=8)
    rules = ShardingRules(data="dp").extend(mlp=None)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"logical axis 'batch' is not in the logical "
                                             r"rules in effect \(none\)"):
            layer(jnp.ones((8, 8)))
        with nnx.logical_axis_rules(rules.flax_rules()), pytest.raises(
                ValueError, match=r"batch dimension 4 is not divisible by the 8 devices"):
            layer(jnp.ones((4, 8)))


def test_pipeline_errors_name_the_culprit():
    layers = jnp.ones((3, 2))
    add = lambda w, h: h + w  # noqa: E731
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'; valid: gpipe, 1f1b"):
        pipeline(layers, jnp.ones((4, 2)), microbatches=1, apply=add, schedule="zigzag")
    with pytest.raises(ValueError, match=r"microbatches must be an integer >= 1, got 0"):
        pipeline(layers, jnp.ones((4, 2)), microbatches=0, apply=add)
    with pytest.raises(ValueError, match=r"microbatches=3 does not divide the batch 4"):
        pipeline(layers, jnp.ones((4, 2)), microbatches=3, apply=add)
    with pytest.raises(ValueError, match=r"stacked arrays need apply"):
        pipeline(layers, jnp.ones((4, 2)), microbatches=1)
    rules = ShardingRules(data="dp", pipeline="pp")
    with jax.set_mesh(_mesh(pp=2, dp=4)), nnx.logical_axis_rules(rules.flax_rules()), \
            pytest.raises(ValueError, match=r"3 layers do not split over 2 stages \(mesh axis"):
        pipeline(layers, jnp.ones((4, 2)), microbatches=1, apply=add)
    # Without a mesh the layers simply run in order.
    out = pipeline(layers, jnp.zeros((4, 2)), microbatches=2, apply=add)
    np.testing.assert_array_equal(out, jnp.full((4, 2), 3.0))
