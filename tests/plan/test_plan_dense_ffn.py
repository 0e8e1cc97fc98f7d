"""The planner models what meshkit builds for issue 36: dense models and dense layers,
expert tensor parallelism (``parallel.moe_tensor: ffn``) and expert axes that are fsdp
too. No compiles: parameter counts and shardings by ``jax.eval_shape``, the rest numpy."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from flax import nnx

from meshkit.config import ConfigError, load_config
from meshkit.exchange import cost
from meshkit.model.transformer import Transformer
from meshkit.plan.config_plan import plan, predict
from meshkit.plan.memory_fit import layout_memory
from meshkit.plan.model_desc import ModelDesc
from meshkit.plan.model_plan import Candidate, plan_model, predict_model, runnable_rejection
from meshkit.plan.planner import Layout, layout_of, planning_config, rejection, sized_topology
from meshkit.training import Programs

SMALL = ["model.vocab_size=16", "model.d_model=16", "model.num_heads=4", "model.d_ff=32",
         "model.num_layers=2", "train.batch_size=8", "train.seq_len=8"]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
CONFIGS = {
    "dense-gelu": ["model.num_experts=0", "model.mlp=gelu", "mesh.axes={dp: 2, tp: 4}",
                   "parallel.tensor=tp", *NO_EXPERTS],
    "mixed": ["model.num_experts=4", "model.dense_layers=1", "model.mlp=gelu",
              "model.num_shared_experts=1", "mesh.axes={dp: 2, ep: 4}",
              "exchange.node_axis=ep", "exchange.device_axis=[]"],
    "ffn": ["model.num_experts=4", "mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp",
            "parallel.moe_tensor=ffn", *NO_EXPERTS],
    "ep-fsdp-ffn": ["model.num_experts=4", "model.dense_layers=1", "model.num_layers=3",
                    "model.num_shared_experts=1", "mesh.axes={tp: 2, ep: 2, fsdp: 2}",
                    "parallel.tensor=tp", "parallel.fsdp=[ep, fsdp]",
                    "parallel.moe_tensor=ffn", "exchange.node_axis=ep",
                    "exchange.device_axis=[]"],
}
WANT = {  # (is_moe, mlp, dense_layers, moe_tensor, layout name)
    "dense-gelu": (False, "gelu", 0, None, "dp2 tp4"),
    "mixed": (True, "gelu", 1, None, "dp2 ep4(flat)"),
    "ffn": (True, "swiglu", 0, "ffn", "dp2 tp4(ffn)"),
    "ep-fsdp-ffn": (True, "swiglu", 1, "ffn", "fsdp2 ep2(flat,fsdp) tp2(ffn)"),
}


def _config(name: str):
    return load_config(None, [*SMALL, *CONFIGS[name]])


def _topology(devices: int = 8) -> cost.Topology:
    return sized_topology(cost.preset("h100-8x400g", 1), devices)


@pytest.mark.parametrize("name", CONFIGS)
def test_of_config_describes_the_model_meshkit_builds(name: str) -> None:
    config = _config(name)
    desc = ModelDesc.of_config(config)
    assert (desc.is_moe, desc.mlp, desc.dense_layers, desc.moe_tensor,
            layout_of(config).name()) == WANT[name]
    assert desc.differences() == [] or desc.dense_layers  # pipelined layouts only
    model = nnx.eval_shape(lambda: Transformer.from_config(config))
    params = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert desc.params == params


@pytest.mark.parametrize("name", CONFIGS)
def test_overrides_load_as_the_same_model(name: str) -> None:
    config = _config(name)
    desc = ModelDesc.of_config(config)
    again = load_config(None, [*desc.overrides(), *layout_of(config).overrides()])
    # The layout carries moe_tensor (of_config keeps a config's explicit choice).
    assert ModelDesc.of_config(again) == desc
    assert layout_of(again) == layout_of(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_predicted_state_is_what_the_shardings_hold(name: str) -> None:
    config = _config(name)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        abstract = Programs(config, mesh).abstract_state
    held = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(abstract))
    got = predict(config, layout_of(config), _topology()).memory.state
    # The state's scalars (step, counts) and norms the formula rounds: within 2 %.
    assert abs(got - held) <= 0.02 * held, (got, held)


WIDE = ModelDesc(name="wide", vocab_size=512, d_model=128, num_layers=2, num_heads=4,
                 d_ff=2048, num_experts=8, top_k=2, seq_len=64, batch_size=32,
                 compute_dtype="float32")


def test_ffn_holds_less_than_tokens_and_sends_tp_times_the_exchange() -> None:
    tokens, ffn = (Layout(data=2, expert_devices=2, tensor=2, exchange="flat", moe_tensor=m)
                   for m in ("tokens", "ffn"))
    long = dataclasses.replace(WIDE, seq_len=4096)  # the exchange's bytes over its latency
    mem = {m: layout_memory(WIDE, lay) for m, lay in (("tokens", tokens), ("ffn", ffn))}
    assert mem["ffn"].total < mem["tokens"].total
    routed = WIDE.routed_params * 4  # float32 parameters, over the 2 expert ways
    assert mem["tokens"].terms["parameters"] - mem["ffn"].terms["parameters"] == \
        pytest.approx(routed / 2 / 2)
    # Each tensor rank routes all the device's tokens: twice the dispatch buffers.
    t = _topology()
    p = {m: predict_model(long, Candidate(lay), t) for m, lay in (("tokens", tokens),
                                                                   ("ffn", ffn))}
    assert p["ffn"].terms["exchange"] > 1.9 * p["tokens"].terms["exchange"]
    assert p["ffn"].terms["tensor"] > p["tokens"].terms["tensor"]


def test_the_planner_ranks_both_modes_and_names_its_pick() -> None:
    ranked = plan_model(WIDE, devices=8, topology=_topology())
    modes = {p.layout.moe_tensor for p in ranked if p.layout.tensor > 1}
    assert modes == {"tokens", "ffn"}
    assert {p.layout.moe_tensor for p in ranked if p.layout.tensor == 1} == {"auto"}
    ffn = next(p for p in ranked if p.layout.moe_tensor == "ffn")
    assert "parallel.moe_tensor=ffn" in ffn.layout.overrides()
    assert any(p.layout.expert_fsdp for p in ranked)
    # A config's explicit choice is the only one ranked.
    config = planning_config(None, ["model.d_ff=2048", "parallel.moe_tensor=tokens"])
    fixed = plan(config, devices=8, topology=_topology())
    assert {p.layout.moe_tensor for p in fixed if p.layout.tensor > 1} == {"tokens"}


def test_a_dense_config_naming_a_moe_tensor_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.moe_tensor: 'ffn' .* no MoE layers"):
        planning_config(None, ["model.num_experts=0", "parallel.moe_tensor=ffn"])


def test_expert_axes_that_are_fsdp_shard_the_other_weights() -> None:
    plain = Layout(data=2, expert_devices=4, exchange="flat")
    sharded = dataclasses.replace(plain, expert_fsdp=True)
    a, b = (layout_memory(WIDE, lay).params for lay in (plain, sharded))
    expert = WIDE.routed_params / 4
    assert (a - expert) / (b - expert) == pytest.approx(4, rel=0.02)  # norms replicated
    assert "parallel.fsdp=[ep]" in sharded.overrides()


def test_no_pipelined_layout_for_dense_layers() -> None:
    config = load_config(None, ["model.dense_layers=1"])
    ranked = plan(config, devices=8, topology=_topology())
    assert ranked and all(p.layout.pipeline == 1 for p in ranked)
    assert rejection(config, Layout(pipeline=2, data=4, microbatches=2)) == \
        "model.dense_layers"
    desc = ModelDesc.of_config(config)
    runnable = plan_model(desc, devices=8, topology=_topology(),
                          reject=runnable_rejection(desc))
    assert all(p.layout.pipeline == 1 for p in runnable)
    # A published model's plan may pipeline it; what --verify compiles says so.
    assert any("pipelined" in d for d in desc.differences())


def test_a_dense_mlp_is_split_over_the_tensor_ways() -> None:
    dense = ModelDesc(name="d", vocab_size=512, d_model=128, num_layers=2, num_heads=4,
                      d_ff=2048, seq_len=64, batch_size=32, compute_dtype="float32")
    built = dense.buildable()
    assert built.megatron_tp and not built.is_moe and built.differences() == []
    assert "model.num_experts=0" in built.overrides()
    one, four = (layout_memory(built, Layout(data=8 // t, tensor=t)).params for t in (1, 4))
    norms = 2 * built.d_model * built.num_layers + built.d_model  # replicated
    assert one - four == pytest.approx((built.params - norms) * 3 / 4)
    whole = dataclasses.replace(built, megatron_tp=False)  # the MLP replicated instead
    mlp = built.num_layers * built.dense_mlp_params
    assert layout_memory(whole, Layout(data=2, tensor=4)).params - four == \
        pytest.approx(mlp * 3 / 4)
