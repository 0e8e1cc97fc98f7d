"""The planner's model description: the shipped files load, bad ones fail in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshkit.plan.model_desc import ModelDesc, ModelDescError, load_model_desc

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "llama2_7b": (6_738_415_616, 4 * 2**20),  # Hugging Face's count; 4M-token batch
    "llama3_70b": (70_553_706_496, 16 * 2**20),
    "llama3_405b_128k": (405_853_388_800, 16 * 2**20),  # 128 sequences of 131,072
    "mixtral_8x7b": (46_702_792_704, 2 * 2**20),
    "deepseek_v2_lite": (15_787_866_112, 4 * 2**20),
    "deepseek_v3": (672_149_632_000, 15360 * 4096),  # MLA counted as MHA: 671B published
}
TINY = "name: t\nvocab_size: 16\nd_model: 64\nnum_layers: 2\nnum_heads: 4\nd_ff: 128\n" \
       "seq_len: 16\nbatch_size: 8\n"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models_load_with_their_parameter_count_and_source(name: str) -> None:
    desc = load_model_desc(ROOT / "configs" / "models" / f"{name}.yaml")
    params, tokens = SHIPPED[name]
    assert (desc.params, desc.tokens) == (params, tokens)
    assert desc.source


def test_moe_counts_active_parameters_of_top_k_experts() -> None:
    desc = load_model_desc(ROOT / "configs" / "models" / "mixtral_8x7b.yaml")
    assert desc.active_params == 12_879_925_248
    assert desc.differences() == []  # meshkit builds its grouped-query attention


@pytest.mark.parametrize(("text", "field"), [
    (TINY + "colour: red\n", "colour: unknown field"),
    (TINY + "num_kv_heads: 3\n", "num_kv_heads: 3 does not divide num_heads=4"),
    (TINY + "mlp: relu\n", "mlp: must be one of swiglu, gelu"),
    (TINY + "remat: sometimes\n", "remat: must be one of"),
    (TINY + "moe_tensor: auto\n", "moe_tensor: must be one of tokens, ffn or null"),
    (TINY + "expert_mlp: relu\n", "expert_mlp: must be one of swiglu, gelu or null"),
    (TINY + "grad_accum: 3\n", "grad_accum: 3 does not divide batch_size=8"),
    (TINY + "micro_batch_size: 9\n", "micro_batch_size: 9 is more than batch_size=8"),
    (TINY + "micro_batch_size: 0\n", "micro_batch_size: must be a positive integer or null"),
    (TINY + "max_nodes: 0\n", "max_nodes: must be a positive integer or null"),
    (TINY.replace("d_ff: 128\n", ""), "d_ff: missing"),
    (TINY.replace("d_model: 64", "d_model: -1"), "d_model: must be a positive integer"),
    ("[1, 2]\n", "a model description is a mapping"),
    # The check meshkit train makes: the planner ranks no layout that training refuses.
    (TINY + "attention: chunked\nattention_chunk: 7\n",
     "attention_chunk: 7 does not divide seq_len=16"),
    (TINY.replace("seq_len: 16", "seq_len: 200") + "attention: chunked\n",
     "attention_chunk: 128 does not divide seq_len=200"),
])
def test_bad_description_is_one_line_naming_the_field(tmp_path: Path, text: str,
                                                      field: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ModelDescError, match=field) as info:
        load_model_desc(path)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_missing_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ModelDescError, match=r"^--model file not found: .*none\.yaml$"):
        load_model_desc(tmp_path / "none.yaml")


def test_overrides_build_a_dense_model_dense() -> None:
    desc = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
                     d_ff=128, seq_len=16, batch_size=8)
    o = desc.overrides(grad_accum=2, known=frozenset({"model.remat"}))
    assert "model.num_experts=0" in o and "train.batch_size=4" in o
    assert not any(k.startswith("model.remat") for k in o)  # remat is None: planner's pick
    assert "model.remat=full" in dataclasses.replace(desc, remat="full").overrides(
        known=frozenset({"model.remat"}))
    assert all("remat" not in k for k in dataclasses.replace(desc, remat="full")
               .overrides())


def test_the_memory_issue_keys_pass_through_only_when_the_schema_knows_them() -> None:
    from meshkit.plan.memory_fit import layout_memory
    from meshkit.plan.planner import Layout

    desc = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
                     d_ff=128, seq_len=16, batch_size=8, zero1=True, attention="chunked",
                     attention_chunk=4, schedule="1f1b")
    every = frozenset({"model.attention", "model.attention_chunk", "parallel.zero1"})
    assert {"model.attention=chunked", "model.attention_chunk=4",
            "parallel.zero1=true"} <= set(desc.overrides(known=every))
    assert not any("zero1" in o or "chunk" in o for o in desc.overrides())
    plain = dataclasses.replace(desc, zero1=False)
    lay = Layout(data=8)
    assert layout_memory(desc, lay).terms["optimizer"] * 8 == \
        layout_memory(plain, lay).terms["optimizer"]
