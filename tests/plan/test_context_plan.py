"""The planner's context ways: layouts, rules, the step and memory models, the 128K 405B."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from meshkit.config import ConfigError
from meshkit.exchange.cost import Link, preset
from meshkit.plan.config_plan import config_desc, plan
from meshkit.plan.context_cost import context_bytes, context_seconds
from meshkit.plan.memory_fit import layout_memory
from meshkit.plan.model_desc import Measured, ModelDesc, load_model_desc
from meshkit.plan.model_plan import (
    Candidate,
    auto_context_method,
    candidates,
    context_ways,
    model_rejection,
    plan_model,
    predict_model,
)
from meshkit.plan.planner import (
    Layout,
    PlanError,
    candidate_layouts,
    layout_of,
    planning_config,
    rejection,
    sized_topology,
)

DESC = ModelDesc(name="t", vocab_size=256, d_model=256, num_layers=4, num_heads=8,
                 num_kv_heads=2, d_ff=512, seq_len=1024, batch_size=16,
                 attention="chunked")
TOPOLOGY = preset("h100-8x400g", 1)


def test_context_layouts_name_their_axes_and_config_keys() -> None:
    ring = Layout(data=2, context=4, context_method="ring")
    assert ring.axes() == {"dp": 2, "cp": 4} and ring.devices == 8
    assert ring.name() == "dp2 cp4(ring)"
    assert {"parallel.context=[cp]", "parallel.context_method=ring"} <= set(ring.overrides())
    two = Layout(context=8, context_method="hierarchical", context_inner=4)
    assert two.axes() == {"cpo": 2, "cpi": 4} and two.name() == "cp2x4(hierarchical)"
    assert "parallel.context=[cpo, cpi]" in two.overrides()
    # Without context ways the keys are still set, so a base config's own are replaced.
    assert {"parallel.context=[]", "parallel.context_method=auto"} <= set(
        Layout(data=8).overrides())


@pytest.mark.parametrize("lay", [Layout(data=2, context=4, context_method="ring"),
                                 Layout(context=8, context_method="hierarchical",
                                        context_inner=2)])
def test_layout_of_reads_the_context_role_back(lay: Layout) -> None:
    base = planning_config(None, ["model.num_experts=0", "train.seq_len=64"])
    assert layout_of(lay.config(base)) == lay


def test_context_ways_need_whole_blocks_in_each_chunk() -> None:
    # 1024 tokens: 2c chunks of at least one 128-token attention block, c dividing 16.
    assert context_ways(DESC, 16) == (1, 2, 4)
    measured = dataclasses.replace(DESC, measured=Measured(
        params=10, fsdp_params=8, flops_per_token=60.0, bytes_per_token=4.0,
        bytes_per_param=16.0))
    assert context_ways(measured, 16) == (1,)


@pytest.mark.parametrize(("desc", "lay", "key"), [
    (dataclasses.replace(DESC, seq_len=24), Layout(context=8, context_method="ring"),
     "seq_len"),
    # 2 kv heads a rank do not split four ways of Ulysses (8 query heads would).
    (DESC, Layout(context=4, context_method="ulysses"), "num_kv_heads"),
    (DESC, Layout(context=2, context_method="ulysses", tensor=8), "num_heads"),
    (dataclasses.replace(DESC, measured=Measured(params=10, fsdp_params=8,
                                                 flops_per_token=60.0, bytes_per_token=4.0,
                                                 bytes_per_param=16.0)),
     Layout(context=2, context_method="ring"), "parallel.context"),
])
def test_a_context_split_the_model_cannot_take_names_the_field(
        desc: ModelDesc, lay: Layout, key: str) -> None:
    assert model_rejection(desc, Candidate(lay)) == key


@pytest.mark.parametrize(("overrides", "lay", "key"), [
    (["train.seq_len=64"], Layout(context=64, context_method="ring"), "train.seq_len"),
    (["model.num_kv_heads=2"], Layout(context=4, context_method="ulysses"),
     "parallel.context_method"),
])
def test_a_config_names_its_key_for_a_context_split_it_cannot_take(
        overrides: list[str], lay: Layout, key: str) -> None:
    config = planning_config(None, ["model.num_experts=0", "train.seq_len=1024", *overrides])
    assert rejection(config, lay) == key


def test_activations_per_device_are_the_device_share_of_the_sequence() -> None:
    # cp4 holds a quarter of each sequence: its activations are those of a sequence of
    # T/4 on one device; only the context attention's K/V are more.
    split = layout_memory(DESC, Layout(context=4, context_method="ring"), attention="chunked")
    short = layout_memory(dataclasses.replace(DESC, seq_len=DESC.seq_len // 4), Layout(),
                          attention="chunked")
    for term in ("activations", "mlp_hidden", "logits", "in_flight"):
        assert split.terms[term] == pytest.approx(short.terms[term]), term
    assert split.terms["context_kv"] > 0 == short.terms["context_kv"]
    gather = layout_memory(DESC, Layout(context=4, context_method="all_gather"),
                           attention="chunked")
    assert gather.terms["context_kv"] > split.terms["context_kv"]  # the whole sequence's K/V


def test_context_ways_divide_the_compute_and_add_their_traffic() -> None:
    one = predict_model(DESC, Candidate(Layout(data=8), attention="chunked"),
                        TOPOLOGY)
    split = predict_model(DESC, Candidate(Layout(data=2, context=4, context_method="ring"),
                                          attention="chunked"), TOPOLOGY)
    # The same tokens per device either way (16 sequences of 1024 over 8 devices).
    assert split.terms["compute"] == pytest.approx(one.terms["compute"])
    assert split.terms["context"] > 0 == one.terms["context"]


def test_context_seconds_credit_the_ring_overlap_and_count_no_attention_flops() -> None:
    shape = dict(seq_len=131072, batch=1, heads=16, kv_heads=1, head_dim=128,
                 dtype_bytes=2, sizes=(16,), links=(Link(4e-6, 50e9),))
    alone = context_seconds("all_gather", flops_per_s=None, **shape)
    assert context_seconds("all_gather", flops_per_s=4e14,
                           **shape) == pytest.approx(alone)
    assert 0 <= context_seconds("ring", flops_per_s=4e14, **shape) < context_seconds(
        "ring", flops_per_s=None, **shape)
    assert context_bytes("all_gather", kv=1, q=4, ways=16) > context_bytes(
        "ring", kv=1, q=4, ways=16)


def test_layout_rules_checked_once_count_as_each_candidate_checked() -> None:
    # Nothing splits: the error's counts are those of every candidate checked alone.
    desc = ModelDesc(name="t", vocab_size=16, d_model=24, num_layers=1, num_heads=3,
                     d_ff=48, seq_len=16, batch_size=1)
    want = collections.Counter(model_rejection(desc, c) for c in candidates(desc, 4, 4))
    with pytest.raises(PlanError) as err:
        plan_model(desc, devices=4, topology=sized_topology("h100-8x400g", 4))
    message = str(err.value)
    assert f"({sum(want.values())} rejected;" in message
    for key, count in want.items():
        assert f"{key} {count}" in message


@pytest.mark.parametrize("method", ["auto", "ulysses"])
def test_a_config_plans_context_layouts_of_its_own_method(method: str) -> None:
    config = planning_config(None, ["model.num_experts=0", "train.seq_len=1024",
                                    "model.attention=chunked",
                                    f"parallel.context_method={method}"])
    ranked = plan(config, devices=8, topology=TOPOLOGY)
    split = [p.layout for p in ranked if p.layout.context > 1]
    assert split
    # auto: what the config's cost model picks for each layout's axes, as the model runs.
    desc = config_desc(config)
    assert all(lay.context_method == (method if method != "auto" else
                                      auto_context_method(desc, lay, TOPOLOGY))
               for lay in split)


def test_llama3_405b_at_128k_plans_context_ways_first() -> None:
    desc = load_model_desc("configs/models/llama3_405b_128k.yaml")
    assert (desc.seq_len, desc.kv_heads, desc.tokens) == (131072, 8, 16 * 2**20)
    best = plan_model(desc, devices=16384, topology=preset("h100-8x400g", 2048))[0]
    assert best.layout.context > 1
    assert best.memory.total <= 80 * 2**30


@pytest.mark.parametrize("memory_bytes", [40 * 2**20, 8 * 2**20])
def test_the_bisected_micro_steps_rank_as_every_candidate_checked(memory_bytes: int) -> None:
    # A `reject` of its own sends every candidate through the plain loop, each
    # micro-step count predicted in turn: the same ranking, or the same least memory.
    topology = dataclasses.replace(sized_topology("h100-8x400g", 8), memory_bytes=memory_bytes)
    desc = dataclasses.replace(DESC, attention=None, batch_size=64)

    def ranked(**kw: object) -> list[tuple[Candidate, float]] | str:
        try:
            return [(p.candidate, p.predicted_step_s)
                    for p in plan_model(desc, devices=8, topology=topology, **kw)]
        except PlanError as e:
            return str(e)

    fast, plain = ranked(), ranked(reject=lambda cand: None)
    assert fast == plain
    assert isinstance(fast, str) == (memory_bytes == 8 * 2**20)  # the small one fits nowhere


def test_context_rules_agree_with_config_validation_on_every_8_device_layout() -> None:
    # 8 tokens: 8 context ways do not cut them into 16 chunks; 2 kv heads: no Ulysses
    # over 4 ways.
    base = planning_config(None, ["model.num_experts=0", "train.seq_len=8",
                                  "model.num_kv_heads=2", "train.batch_size=8"])
    seen = set()
    for layout in candidate_layouts(8, per_node=4, contexts=(2, 4, 8)):
        try:
            layout.config(base)
            want = None
        except ConfigError as e:
            want = str(e).split(":")[0]
        assert rejection(base, layout) == want, layout
        seen.add(want)
    assert {"train.seq_len", "parallel.context_method", None} <= seen


def test_kernels_that_skip_the_causal_blocks_compute_half_the_scores() -> None:
    lay = Layout(data=8)
    whole = predict_model(DESC, Candidate(lay, attention="xla"), TOPOLOGY).terms["compute"]
    half = predict_model(DESC, Candidate(lay, attention="chunked"), TOPOLOGY).terms["compute"]
    scores = 12 * DESC.num_layers * DESC.seq_len * DESC.num_heads * DESC.head_size
    tokens = DESC.tokens // 8
    assert whole - half == pytest.approx(0.5 * scores * tokens / TOPOLOGY.flops_per_s)
    # A ring visits blocks of T/c and skips those above the diagonal whatever the kernel.
    ring = predict_model(DESC, Candidate(Layout(data=2, context=4, context_method="ring"),
                                         attention="xla"), TOPOLOGY).terms["compute"]
    assert ring == pytest.approx(half)


def test_a_bad_context_method_in_the_planned_config_is_one_line(capsys) -> None:
    from meshkit.cli import main

    assert main(["plan", "--devices", "8", "parallel.context_method=foo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.context_method: must be one of" in err[0]
