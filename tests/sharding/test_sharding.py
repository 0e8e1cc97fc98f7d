"""ShardingRules: roles to partition specs, and every error it raises."""

import pytest
from jax.sharding import PartitionSpec as P

from meshkit.config import load_config
from meshkit.sharding.rules import LOGICAL_AXES, ShardingRules


def test_every_logical_axis_maps_to_its_role():
    rules = ShardingRules(data="dp", fsdp="fs", tensor="tp", pipeline="pp", node="n",
                          device="d", context=("cn", "cd"))
    assert rules.spec(*LOGICAL_AXES) == P(
        "pp", "tp", "tp", "fs", "tp", ("n", "d"), None, ("dp", "fs", "n", "d"),
        ("dp", "fs", "n", "d", "cn", "cd", "tp"), ("cn", "cd"), "tp"
    )
    # Expert tensor parallelism: the experts' width is split, the tokens are not.
    ffn = ShardingRules(data="dp", tensor="tp", node="n", moe_tensor="ffn")
    assert ffn.spec("experts", "embed", "expert_mlp") == P("n", None, "tp")
    assert ffn.spec("tokens") == P(("dp", "n"))
    # An expert axis that is fsdp too: the expert dimension takes it, the width of an
    # expert weight keeps the other fsdp axes, every other weight's width takes all.
    both = ShardingRules(fsdp=("n", "fs"), node="n")
    assert both.spec("experts", "embed", None) == P("n", "fs", None)
    assert both.spec("embed", "heads") == P(("n", "fs"), None)
    assert both.batch == ("n", "fs") and both.expert_fsdp == ("fs",)
    with pytest.raises(ValueError, match="axis 'n' is in two roles"):
        ShardingRules(tensor="n", node="n")
    assert rules.spec(None, "embed") == P(None, "fs")
    assert [rules.role(a) for a in ("dp", "fs", "tp", "pp", "n", "d", "cn", "other")] == [
        "data", "fsdp", "tensor", "pipeline", "expert", "expert", "context", "data"]


def test_from_config_lays_the_batch_out_in_mesh_order():
    config = load_config(None, ["mesh.axes={node: 2, dp: 2, device: 2}", "parallel.data=dp"])
    rules = ShardingRules.from_config(config)
    assert rules.batch_axes == ("node", "dp", "device")
    assert rules.expert_axes == ("node", "device")


def test_context_axes_split_the_sequence_not_the_batch():
    config = load_config(None, ["mesh.axes={node: 2, cpn: 2, cpd: 2}",
                                "parallel.context=[cpn, cpd]", "exchange.device_axis=[]"])
    rules = ShardingRules.from_config(config)
    assert rules.context == ("cpn", "cpd") and rules.by_role()["context"] == ("cpn", "cpd")
    assert rules.batch_axes == ("node",) and config.batch_axes == ("node",)
    assert rules.batch_context_axes == ("node", "cpn", "cpd")
    assert rules.spec("batch", "sequence", "kv_heads") == P("node", ("cpn", "cpd"), None)
    assert rules.role("cpd") == "context" and config.roles["cpd"] == "context"
    assert rules.extend(seq="context").axes("seq") == ("cpn", "cpd")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data": "x", "tensor": ["x"]}, r"axis 'x' is in two roles \(data and tensor\)"),
        ({"pipeline": "n", "node": "n"}, r"axis 'n' is in two roles \(pipeline and expert\)"),
        ({"tensor": ["tp", ""]}, "tensor axis names must be non-empty strings"),
        ({"pipeline": 3}, "pipeline axis names must be non-empty strings"),
        ({"data": "a", "batch": ("a", "b")}, r"batch \('a', 'b'\) must hold exactly"),
        # A context axis shares no role, not even the batch's: its rows are not split.
        *(({role: "c", "context": "c"}, rf"axis 'c' is in two roles \({named} and context\)")
          for role, named in (("data", "data"), ("fsdp", "fsdp"), ("tensor", "tensor"),
                              ("pipeline", "pipeline"), ("node", "expert"),
                              ("device", "expert"))),
        ({"data": "a", "context": "c", "batch": ("a", "c")}, "must hold exactly"),
        ({"context": ["c", ""]}, "context axis names must be non-empty strings"),
    ],
)
def test_bad_rules_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardingRules(**kwargs)


def test_unknown_logical_axis_and_missing_mesh_axis():
    rules = ShardingRules(fsdp="f")
    with pytest.raises(ValueError, match="unknown logical axis 'hid'; valid: layers, vocab"):
        rules.spec("hid")
    with pytest.raises(ValueError, match=r"fsdp axis 'f' is not an axis of the mesh \['dp'\]"):
        rules.check_mesh(["dp"])


def test_a_tuple_of_mesh_axes_is_taken_as_is_even_where_a_name_is_logical():
    # The expert axes (node, experts): the mesh axis `experts` is also the logical name of
    # both, so only a tuple's literal reading keeps the transformer's expert weights placed.
    rules = ShardingRules(node="node", device="experts")
    mesh = ["node", "experts"]
    assert rules.mesh_spec((None, ("node", "experts")), mesh) == P(None, ("node", "experts"))
    assert rules.mesh_spec(("experts",), mesh) == P(("node", "experts"))  # a name: logical
    with_logical = ShardingRules(tensor="tp").extend(mlp="tensor")
    assert with_logical.mesh_spec((("dp", "mlp"),), ["dp", "tp"]) == P(("dp", "tp"))
