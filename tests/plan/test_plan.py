"""The planner: its rules agree with the config's, its terms follow their formulas, its
memory matches the state training places, and every bad input is a clear error."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import jax
import pytest
from _layouts import MODEL, NO_EXPERTS, STRATEGIES, _config

from meshkit.cli import main
from meshkit.config import ConfigError, load_config
from meshkit.exchange import cost
from meshkit.plan.config_plan import plan, predict
from meshkit.plan.flops import flops_per_token
from meshkit.plan.planner import (
    Layout,
    PlanError,
    candidate_layouts,
    layout_of,
    rejection,
    resolve_topology,
    sized_topology,
)
from meshkit.training import Programs, init_state

# Models on which the rules of meshkit.config.validate reject 8-device layouts: between
# them, every rule fires (the second: 4 heads and a vocabulary of 2, node-limited
# routing, einsum dispatch).
RULES = ["model.d_model=12", "model.num_heads=2", "model.vocab_size=6", "model.num_layers=2",
         "model.num_experts=4", "model.top_k=2", "train.batch_size=4", "train.seq_len=3",
         "mesh.axes={dp: 1}", "exchange.node_axis=[]", "exchange.device_axis=[]"]
MORE_RULES = ["model.d_model=24", "model.num_heads=4", "model.vocab_size=2",
              "model.max_nodes=1", "model.dispatch=einsum"]
COMMON = {"model.num_experts", "parallel.pipeline", "train.batch_size",
          "parallel.microbatches", "parallel.tensor", "model.num_heads"}
MODEL_OF_THE_PARITY_TESTS = [*MODEL, "mesh.axes={dp: 1}", *NO_EXPERTS]
MIXTRAL_LIKE = ["model.d_model=4096", "model.num_heads=32", "model.num_layers=32",
                "model.d_ff=14336", "model.num_experts=8", "model.top_k=2",
                "model.vocab_size=32000", "train.batch_size=512", "train.seq_len=4096"]


def _config_error_key(config, layout: Layout) -> str | None:
    try:
        layout.config(config)
    except ConfigError as e:
        return str(e).split(":")[0]
    return None


@pytest.mark.parametrize("overrides, fired", [
    (RULES, COMMON | {"model.d_model"}),
    # The experts' width split over the tensor ways (moe_tensor: ffn).
    ([*RULES, *MORE_RULES, "model.d_ff=3"],
     COMMON | {"model.vocab_size", "exchange.dedup", "model.max_nodes", "model.d_ff"}),
    (MODEL_OF_THE_PARITY_TESTS, {None}),
    # Dense layers: no pipeline; a dense model: no expert axes, no moe_tensor.
    ([*RULES, "model.dense_layers=1", "model.d_ff=3"], {"model.dense_layers", "model.d_ff"}),
    ([*RULES, "model.num_experts=0"], {"exchange.node_axis", "parallel.moe_tensor"}),
], ids=["plain", "vocab+max_nodes+einsum", "parity-model", "dense-layers", "dense"])
def test_rules_agree_with_config_validation_on_every_8_device_layout(overrides, fired) -> None:
    base = load_config(None, overrides)
    keys = set()
    # 4 a node: two-level expert splits; each moe_tensor mode and expert axes also fsdp.
    layouts = list(candidate_layouts(8, per_node=4, moe_tensor=("tokens", "ffn"),
                                     expert_fsdp=(False, True)))
    assert len({(x.pipeline, x.data, x.fsdp, x.expert, x.tensor) for x in layouts}) == 35
    for layout in layouts:
        want = _config_error_key(base, layout)
        assert rejection(base, layout) == want, layout
        keys.add(want)
    assert keys >= fired, fired - keys  # every rule was exercised


def _state_bytes(config) -> int:
    """One device's bytes of the state ``init_state`` builds, from its shardings."""
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        abstract = Programs(config, mesh).abstract_state
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(abstract))


def _placed_bytes(config) -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(init_state(config))
               for s in leaf.addressable_shards if s.device == device)


def _predicted_state(config) -> int:
    layout = layout_of(config)
    topology = sized_topology(cost.preset("h100-8x400g", 1), layout.devices)
    return predict(config, layout, topology).memory.state


@pytest.mark.parametrize("name", STRATEGIES)
def test_predicted_state_bytes_within_10_percent(name: str) -> None:
    config = _config(STRATEGIES[name])
    got, want = _predicted_state(config), _state_bytes(config)
    assert abs(got - want) <= 0.1 * want, (got, want)


def test_the_shardings_are_what_init_state_places() -> None:
    config = _config(STRATEGIES["pp2-tp2-node2"])  # pipeline, tensor and expert at once
    assert _placed_bytes(config) == _state_bytes(config)


# ---------------------------------------------------------------- the terms
def _topology(devices: int = 8, per_node: int = 8) -> cost.Topology:
    return sized_topology(cost.preset("h100-8x400g", 1, per_node), devices)


def test_bubble_is_the_gpipe_fraction_of_the_pipelined_part() -> None:
    config = load_config(None, ["model.num_layers=4", "train.batch_size=64"])
    for stages, micro in ((2, 4), (4, 8), (2, 16)):
        layout = Layout(pipeline=stages, data=8 // stages, microbatches=micro)
        terms = predict(config, layout, _topology()).terms
        pipelined = sum(terms[k] for k in ("compute", "weights", "tensor", "exchange",
                                           "fsdp", "pipeline", "bubble"))
        assert terms["bubble"] / pipelined == pytest.approx(
            (stages - 1) / (micro + stages - 1))


def test_compute_is_the_mfu_flops_over_the_device_rate() -> None:
    # capacity_factor 1 with tokens·k divisible by E: no padding; data only: no split.
    config = load_config(None, ["model.capacity_factor=1", "exchange.node_axis=[]",
                                "exchange.device_axis=[]", "mesh.axes={dp: 8}"])
    topology = _topology()
    terms = predict(config, Layout(data=8), topology).terms
    tokens = config.train.batch_size * config.train.seq_len // 8
    flops = flops_per_token(config.model, seq_len=config.train.seq_len).training * tokens
    assert terms["compute"] == pytest.approx(flops / topology.flops_per_s)
    padded = predict(config.replace(model={"capacity_factor": 2}), Layout(data=8),
                     topology).terms["compute"]
    assert padded > terms["compute"]  # the padding the MoE computes is counted


def test_groups_that_cross_nodes_pay_the_inter_node_link() -> None:
    config = load_config(None, ["model.num_heads=8"])
    layout = Layout(data=2, tensor=4)
    inside = predict(config, layout, _topology(per_node=8)).terms["tensor"]
    across = predict(config, layout, _topology(per_node=2)).terms["tensor"]
    assert across > 2 * inside > 0


def test_dedup_is_cheaper_than_two_stage_for_top_k_above_one() -> None:
    config = load_config(None, ["model.top_k=4", "model.num_experts=16"])
    two = Layout(expert_nodes=2, expert_devices=4, exchange="hierarchical")
    dedup = dataclasses.replace(two, exchange="dedup")
    topology = _topology(per_node=4)
    assert (predict(config, dedup, topology).terms["exchange"]
            < predict(config, two, topology).terms["exchange"])


def test_plan_ranks_and_drops_what_does_not_fit() -> None:
    config = load_config(None)
    ranked = plan(config, devices=8, topology=_topology())
    times = [p.predicted_step_s for p in ranked]
    assert times == sorted(times) and len(ranked) > 10
    limit = sorted(p.memory.total for p in ranked)[len(ranked) // 2]
    tight = dataclasses.replace(_topology(), memory_bytes=limit)
    kept = plan(config, devices=8, topology=tight)
    assert 0 < len(kept) < len(ranked)
    assert all(p.memory.total <= limit for p in kept)


def test_plans_2048_devices() -> None:
    # The time is a benchmark figure (meshkit bench plan), not asserted here.
    config = load_config(None, MIXTRAL_LIKE)
    ranked = plan(config, devices=2048, topology=resolve_topology(
        devices=None, topology=None, preset="h100-8x400g", nodes=256))
    assert ranked and all(p.layout.devices == 2048 for p in ranked)
    assert rejection(config, ranked[0].layout) is None


# ---------------------------------------------------------------- the command
def test_json_lists_the_best_layouts_with_their_overrides(capsys) -> None:
    assert main(["plan", "--devices", "8", "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    for row in rows:
        assert isinstance(row["overrides"], list) and all("=" in o for o in row["overrides"])
        assert isinstance(row["predicted_step_s"], float)
        assert isinstance(row["predicted_memory_bytes"], int)
        assert 0 < row["predicted_state_bytes"] < row["predicted_memory_bytes"]
    assert [r["predicted_step_s"] for r in rows] == sorted(r["predicted_step_s"] for r in rows)


def test_write_gives_a_config_train_loads(tmp_path, capsys) -> None:
    out = tmp_path / "best.yaml"
    assert main(["plan", "model.num_layers=4", "--devices", "8", "--json", "--top", "1",
                 "--write", str(out)]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    written = load_config(out)
    assert written == load_config(None, ["model.num_layers=4", *best["overrides"]])
    assert written.num_devices == 8


@pytest.mark.parametrize("argv, message", [
    (["--devices", "7"], "no layout of 7 devices satisfies the config's rules"),
    (["model.d_model=4096", "model.d_ff=65536", "model.num_layers=64", "model.num_experts=64",
      "--devices", "8"], "model: fits nowhere on 8 devices"),
    (["--preset", "tpu-v5", "--nodes", "2"], "--preset: unknown preset 'tpu-v5'"),
    (["--preset", "h100-8x400g", "--nodes", "2", "--devices", "8"],
     "--devices: 8, but --nodes 2 of h100-8x400g have 16"),
    (["--nodes", "2"], "--nodes: needs --preset"),
    (["--devices", "12", "--preset", "h100-8x400g"], "12 devices are not whole nodes of 8"),
    (["--devices", "0"], "--devices: must be a positive integer"),
    ([], "--devices: give the device count"),
    (["--devices", "8", "--top", "0"], "--top: must be a positive integer"),
    (["--devices", "8", "--topology", "a.yaml", "--preset", "h100-8x400g"],
     "--topology and --preset both"),
    (["--devices", "8", "--topology", "missing.yaml"],
     "--topology: topology file not found: missing.yaml"),
    (["--devices", "8", "--write", "/no/such/dir/x.yaml"], "--write: cannot write"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_topology_without_flops_is_refused(tmp_path) -> None:
    path = tmp_path / "links.yaml"
    data = cost.topology_to_dict(cost.preset("a100-8x200g", 1))
    del data["flops_per_s"]
    path.write_text(json.dumps(data))  # JSON is YAML
    with pytest.raises(PlanError, match="no flops_per_s"):
        plan(load_config(None), devices=8, topology=sized_topology(str(path), 8))


def test_the_planner_imports_no_jax() -> None:
    code = ("import sys, meshkit.plan.planner, meshkit.plan.config_plan\n"
            "sys.exit(', '.join(m for m in ('jax', 'flax', 'optax') if m in sys.modules) or None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, f"meshkit.plan.planner imported: {result.stderr.strip()}"


def test_fewer_experts_per_device_stream_fewer_weights() -> None:
    config = load_config(None)
    topology = _topology()
    data = predict(config, Layout(data=8), topology).terms["weights"]
    experts = predict(config, Layout(expert_devices=8, exchange="flat"), topology).terms
    model = config.model
    saved = 3 * model.num_layers * 3 * model.d_model * model.d_ff * 7 * 4  # 7 of 8 experts
    assert data - experts["weights"] == pytest.approx(saved / topology.memory_bandwidth_Bps)


def test_fsdp_charges_three_transposes_of_the_weights_it_gathers_off_their_leading_dim(
) -> None:
    # The transposes go through memory: halving the bandwidth adds exactly their cost at
    # the full one (the collectives use the link, which does not change).
    config = load_config(None)
    topology = _topology()
    slow = dataclasses.replace(topology, memory_bandwidth_Bps=topology.memory_bandwidth_Bps / 2)
    layout = Layout(fsdp=2, expert_devices=4, exchange="flat")
    extra = (predict(config, layout, slow).terms["fsdp"]
             - predict(config, layout, topology).terms["fsdp"])
    m = config.model
    transposed = (m.d_model**2 + 3 * m.num_experts * m.d_model * m.d_ff // 4) * 4  # bytes
    assert extra == pytest.approx(m.num_layers * 3 * 2 * transposed
                                  / topology.memory_bandwidth_Bps)
    assert predict(config, Layout(data=2, expert_devices=4, exchange="flat"),
                   topology).terms["fsdp"] == 0
