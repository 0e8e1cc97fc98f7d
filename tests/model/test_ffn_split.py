"""Dense layers, tensor ranks that split the FFN, expert axes that shard the rest.

Each layout runs two plain SGD steps from the same initial parameters (made once on one
device) and must give a one-device run's losses and gradients to rtol 1e-5; the compiled
step must run its tensor and expert collectives over exactly those axes' groups, and hold
the weights split as the layout says.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from _sgd import Run, assert_same_run, sgd_run
from flax import nnx

from meshkit.config import Config, ConfigError, load_config
from meshkit.model.transformer import Transformer
from meshkit.sharding.rules import ShardingRules
from meshkit.strategy.hlo import collectives, groups_as_ranks
from meshkit.training import compile_step, init_state

BASE = [
    "model.vocab_size=16", "model.d_model=16", "model.num_heads=4", "model.d_ff=16",
    "model.num_layers=2", "model.top_k=2", "model.aux_loss_weight=0",
    "train.batch_size=8", "train.seq_len=8",
]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
# capacity_factor = E / k: nothing is dropped, so every layout trains the same model.
MODELS = {
    "dense": ["model.num_experts=0", *NO_EXPERTS],
    "moe": ["model.num_experts=4", "model.capacity_factor=2"],
    "mixed": ["model.num_experts=4", "model.capacity_factor=2", "model.dense_layers=1",
              "model.mlp=gelu", "model.num_shared_experts=1"],
}
ONE = ["mesh.axes={dp: 1}", "exchange.node_axis=[]", "exchange.device_axis=[]"]
DP2_TP4 = ["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp"]
LAYOUTS = {
    # A dense model through the 1F1B schedule too (its layers report no routing).
    ("dense", "pp2-tp2-dp2-1f1b"): ["mesh.axes={pp: 2, tp: 2, dp: 2}", "parallel.pipeline=pp",
                                    "parallel.tensor=tp", "parallel.microbatches=2",
                                    "parallel.schedule=1f1b"],
    ("moe", "dp2-tp4-ffn"): ["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp",
                             "parallel.moe_tensor=ffn", *NO_EXPERTS],
    ("moe", "dp2-ep4-fsdp"): ["mesh.axes={dp: 2, ep: 4}", "parallel.fsdp=ep",
                              "exchange.node_axis=[]", "exchange.device_axis=ep"],
    ("moe", "dp2-tp2-ep2-sp"): ["mesh.axes={dp: 2, tp: 2, ep: 2}", "parallel.tensor=tp",
                                "parallel.moe_tensor=tokens", "parallel.sequence_parallel=true",
                                "exchange.node_axis=[]", "exchange.device_axis=ep"],
    ("mixed", "tp2-ep2-fsdp2-ffn-sp"): [
        "mesh.axes={tp: 2, ep: 2, fsdp: 2}", "parallel.tensor=tp", "parallel.fsdp=[ep, fsdp]",
        "parallel.moe_tensor=ffn", "parallel.sequence_parallel=true", "exchange.node_axis=[]",
        "exchange.device_axis=ep"],
}
STEPS = 2


def _config(model: str, layout: list[str]) -> Config:
    return load_config(None, [*BASE, *MODELS[model], *layout])


def _run(config: Config, initial: dict[str, Any]) -> Run:
    """Losses and gradients of ``STEPS`` SGD steps on one batch, from ``initial``."""
    return sgd_run(config, initial, STEPS)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[dict[str, Any], Run]]:
    """Per model: its initial parameters and its one-device run, made on first use."""
    return {}


def _reference(model: str, references: dict[str, tuple[dict[str, Any], Run]]
               ) -> tuple[dict[str, Any], Run]:
    if model not in references:
        config = _config(model, ONE)
        with nnx.use_eager_sharding(False):
            initial = nnx.to_pure_dict(nnx.state(Transformer.from_config(config)))
        references[model] = initial, _run(config, initial)
    return references[model]


@pytest.mark.parametrize(("model", "layout"), list(LAYOUTS), ids=[f"{m}-{x}" for m, x in LAYOUTS])
def test_layout_matches_one_device(model: str, layout: str, references: Any) -> None:
    initial, (want_losses, want_grads) = _reference(model, references)
    assert want_losses[-1] < want_losses[0]  # the steps do something
    assert_same_run(_run(_config(model, LAYOUTS[model, layout]), initial),
                    (want_losses, want_grads))


def _local_shape(config: Config, path: str) -> tuple[int, ...]:
    """One device's shard shape of a parameter of the initial state."""
    for p, leaf in jax.tree_util.tree_leaves_with_path(init_state(config)):
        if jax.tree_util.keystr(p) == path:
            return leaf.addressable_shards[0].data.shape
    raise KeyError(path)


def test_tensor_ranks_split_the_dense_mlp() -> None:
    dense = _config("dense", DP2_TP4)
    # [L, d, f]: f = 16 split four ways; [L, f, d] likewise. (The experts' split under
    # ffn: test_a_tokens_checkpoint_restores_under_ffn.)
    assert _local_shape(dense, "[0]['layers']['mlp']['w_up'].value") == (2, 16, 4)
    assert _local_shape(dense, "[0]['layers']['mlp']['w_down'].value") == (2, 4, 16)


def test_an_expert_axis_in_fsdp_shards_every_other_weight() -> None:
    config = _config("moe", LAYOUTS["moe", "dp2-ep4-fsdp"])
    # Experts split over ep on their expert dimension only; the rest on the width.
    assert _local_shape(config, "[0]['layers']['moe']['w_up'].value") == (2, 1, 16, 16)
    assert _local_shape(config, "[0]['layers']['qkv'].value") == (2, 4, 3, 4, 4)
    assert _local_shape(config, "[0]['embed'].value") == (16, 4)
    assert config.roles == {"dp": "data", "ep": "expert"}
    assert config.fsdp_axes == ("ep",) and config.batch_axes == ("dp", "ep")


def _groups(config: Config, op: str) -> list[set[tuple[int, ...]]]:
    strategy = config.strategy()
    return [{tuple(sorted(g)) for g in groups_as_ranks(c.groups, strategy)}
            for c in collectives(compile_step(config)) if c.op == op]


def _axis_groups(config: Config, *axes: str) -> set[tuple[int, ...]]:
    return {tuple(sorted(g)) for g in config.strategy().groups(axes).tolist()}


def test_compiled_step_uses_the_tensor_expert_and_fsdp_groups() -> None:
    config = _config("mixed", LAYOUTS["mixed", "tp2-ep2-fsdp2-ffn-sp"])
    tp, ep = _axis_groups(config, "tp"), _axis_groups(config, "ep")
    # Sequence parallel: the experts', the MLP's and attention's partial sums are
    # reduce-scattered over the tensor groups, and each block's input all-gathered there.
    assert tp in _groups(config, "reduce-scatter")
    assert tp in _groups(config, "all-gather")
    # The exchange stays inside the expert groups.
    exchanges = _groups(config, "all-to-all")
    assert exchanges and all(g <= ep for g in exchanges)
    # ZeRO-3 over ep and fsdp together: the non-expert weights are gathered over both;
    # the experts (split on ep) over fsdp alone.
    gathers = _groups(config, "all-gather")
    assert _axis_groups(config, "ep", "fsdp") in gathers
    assert _axis_groups(config, "fsdp") in gathers


@pytest.mark.parametrize(("extra", "key"), [
    (["model.num_experts=0", "model.dense_layers=1"], "model.dense_layers"),
    (["model.num_experts=4", "model.dense_layers=2"], "model.dense_layers"),
    (["model.num_experts=0"], "exchange.node_axis"),  # the default's expert axes
    (["model.num_experts=8", "parallel.moe_tensor=ffn"], "parallel.moe_tensor"),
    (["model.num_experts=0", *NO_EXPERTS, "mesh.axes={tp: 8}", "parallel.tensor=tp",
      "model.num_heads=8", "model.d_ff=12"], "model.d_ff"),
    (["model.num_experts=8", *NO_EXPERTS, "mesh.axes={tp: 8}", "parallel.tensor=tp",
      "model.num_heads=8", "model.d_ff=12", "parallel.moe_tensor=ffn"], "model.d_ff"),
    (["model.num_experts=4", "model.dense_layers=1", "mesh.axes={pp: 2, node: 2, device: 2}",
      "parallel.pipeline=pp"], "model.dense_layers"),
    (["model.num_experts=4", "mesh.axes={tp: 2, node: 2, device: 2}", "parallel.tensor=tp",
      "parallel.fsdp=tp"], "parallel.tensor"),
    (["model.num_experts=0", *NO_EXPERTS, "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel"),  # no tensor axes
    (["model.num_experts=0", *NO_EXPERTS, "mesh.axes={tp: 8}", "parallel.tensor=tp",
      "model.num_heads=8", "model.d_model=32", "train.seq_len=12",
      "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["model.factory=_user_gpt:make", "mesh.axes={tp: 8}", "parallel.tensor=tp", *NO_EXPERTS,
      "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
])
def test_bad_combinations_name_their_key(extra: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}"):
        load_config(None, [*BASE, *extra])


def test_auto_picks_by_the_cost_model_and_the_rules_follow() -> None:
    from meshkit.config.moe_tensor import choose

    config = _config("moe", LAYOUTS["moe", "dp2-tp4-ffn"][:2] + NO_EXPERTS)
    assert config.parallel.moe_tensor == "auto"
    choice = choose(config)
    assert ShardingRules.from_config(config).moe_tensor == choice.mode
    # 64 tokens per device: the collectives' latency decides, and ffn's extra all-reduce
    # makes it more than 5 % slower, whatever memory it saves.
    assert choice.mode == "tokens" and choice.seconds["ffn"] > 1.05 * choice.seconds["tokens"]
    # Mixtral's width at 16k tokens per device: the matmuls decide the time, both modes
    # are within 5 % and ffn holds a quarter of the expert weights.
    wide = config.replace(model={"d_ff": 14336, "d_model": 4096}, train={"seq_len": 4096})
    choice = choose(wide)
    assert choice.mode == "ffn" and choice.bytes["ffn"] < 0.6 * choice.bytes["tokens"]
    assert choice.seconds["ffn"] <= 1.05 * choice.seconds["tokens"]
    assert choice.describe().startswith("ffn (cost model: ") and "slower than tokens" in (
        choice.describe())


def test_a_tokens_checkpoint_restores_under_ffn(tmp_path) -> None:
    from meshkit.training import Programs
    from meshkit.training.checkpoint import Checkpointer

    layout = ["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp", *NO_EXPERTS]
    tokens = _config("moe", [*layout, "parallel.moe_tensor=tokens"])
    ffn = _config("moe", [*layout, "parallel.moe_tensor=ffn"])
    mesh = tokens.strategy().mesh()
    ckpt = Checkpointer(tmp_path)
    with jax.set_mesh(mesh):
        saved = Programs(tokens, mesh).init()
        ckpt.save(1, saved)
        ckpt.close()
        restored = Checkpointer(tmp_path).restore(1, Programs(ffn, mesh).abstract_state)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(saved),
                                 jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                      err_msg=jax.tree_util.keystr(path))
    # [L, E, d, f]: whole experts on each tensor rank under tokens, d_ff split under ffn.
    shard = saved[0]["layers"]["moe"]["w_up"].get_value().addressable_shards[0]
    assert shard.data.shape == (2, 4, 16, 16)
    shard = restored[0]["layers"]["moe"]["w_up"].get_value().addressable_shards[0]
    assert shard.data.shape == (2, 4, 16, 4)


def test_modules_refuse_what_they_cannot_split() -> None:
    from meshkit.config import ModelConfig
    from meshkit.model.experts import FunctionExperts
    from meshkit.model.moe import MoE

    rules = ShardingRules(tensor="tp", node="node", moe_tensor="ffn")
    whole = FunctionExperts(lambda w, rows: rows @ w["w"], {"w": np.ones((2, 8, 8), np.float32)},
                            rules=rules)  # no dimension split over tp
    with pytest.raises(ValueError, match=r"^MoE: moe_tensor='ffn' splits each expert's hidden"):
        MoE(ModelConfig(d_model=8, d_ff=16, num_experts=2, top_k=1), rules, experts=whole,
            rngs=nnx.Rngs(0))
    mixed = ModelConfig(d_model=8, num_heads=2, d_ff=16, num_experts=2, top_k=1,
                        dense_layers=1)
    with pytest.raises(ValueError, match=r"^Transformer: dense_layers=1 with a pipeline axis"):
        Transformer(mixed, ShardingRules(pipeline="pp", node="node"), rngs=nnx.Rngs(0))
