"""Config: loading, overrides, coercion, every validation error, round trips, reference.

No JAX here: the CLI validates configs before JAX starts.
"""

import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from meshkit import Strategy
from meshkit.config import (
    Config,
    ConfigError,
    MeshConfig,
    ModelConfig,
    check_devices,
    format_reference,
    load_config,
    validate,
    with_overrides,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

# {pp: 2, tp: 2, node: 2}: every role but fsdp and data, experts over node alone.
PP_TP = ["mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp", "parallel.tensor=tp",
         "exchange.device_axis=[]"]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]

SECTIONS = ("mesh", "parallel", "exchange", "model", "data", "train")
ALL_KEYS = [f"{name}.{key}" for name in SECTIONS
            for key in type(getattr(Config(), name)).model_fields]


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults and files


def test_embedded_default_is_the_dataclass_default():
    assert load_config() == Config()
    assert load_config(None) == Config()


def test_embedded_default_is_byte_identical_to_configs_default():
    assert (ROOT / "meshkit" / "config" / "default.yaml").read_bytes() == (
        ROOT / "configs" / "default.yaml"
    ).read_bytes()


def test_default_yaml_lists_every_key():
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    listed = [f"{s}.{k}" for s, keys in raw.items() for k in keys]
    assert listed == ALL_KEYS


def test_default_values_and_derived_properties():
    cfg = Config()
    assert cfg.strategy() == Strategy.from_axes({"node": 2, "device": 4})
    assert cfg.node_axes == ("node",)
    assert cfg.device_axes == ("device",)
    assert cfg.expert_axes == ("node", "device")
    assert cfg.num_expert_devices == 8
    assert cfg.num_devices == 8
    assert cfg.model.head_dim == 16


def test_four_axis_example():
    cfg = load_config(ROOT / "configs" / "dp_pp_ep_tp.yaml")
    assert cfg.strategy().shape == {"dp": 1, "pp": 2, "ep": 2, "tp": 2}
    assert cfg.roles == {"dp": "data", "pp": "pipeline", "ep": "expert", "tp": "tensor"}
    assert cfg.expert_axes == ("ep",)
    assert cfg.batch_axes == ("dp", "ep")
    assert cfg.num_expert_devices == 2
    assert cfg.num_devices == 8
    assert cfg.model == ModelConfig()


def test_partial_file_and_empty_sections_take_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "model:\ntrain:\n  steps: 70\n"))
    assert cfg == Config().replace(train={"steps": 70})
    assert load_config(_write(tmp_path, "")) == Config()


def test_yaml_12_floats_and_explicit_ranks(tmp_path):
    text = "train:\n  lr: 3e-4\nmesh:\n  axes: {node: -1, device: 2}\n  ranks: [[3, 2], [1, 0]]\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.train.lr == 3e-4
    assert cfg.strategy().ranks.tolist() == [[3, 2], [1, 0]]
    assert cfg.strategy().shape == {"node": 2, "device": 2}
    assert cfg.num_devices == 4


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("train: [1, 2]", r"^train: expected a mapping of keys, got \[1, 2\]$"),
        ("train: []", r"^train: expected a mapping of keys, got \[\]$"),
        ("- 1\n- 2\n", r"^config: expected a mapping of sections \['mesh', "),
        ("train: {steps: 1\n", r"c\.yaml: invalid YAML: "),
        ("train:\n  steps: 1\n  steps: 2\n", r"c\.yaml: invalid YAML: .*duplicate key 'steps'"),
        ("mesh:\n  axes: {node: 2, node: 4}\n", r"c\.yaml: invalid YAML: .*duplicate key 'node'"),
    ],
)
def test_bad_files(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file not found: .*nope\.yaml$"):
        load_config(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize(
    ("text", "key", "suggestion"),
    [
        ("train:\n  step: 5\n", "train.step", "train.steps"),
        ("trian:\n  steps: 5\n", "trian", "train"),
        ("train:\n  num_experts: 4\n", "train.num_experts", "model.num_experts"),
        ("exchange:\n  nodeaxis: node\n", "exchange.nodeaxis", "exchange.node_axis"),
    ],
)
def test_unknown_key_in_yaml_names_the_closest(tmp_path, text, key, suggestion):
    with pytest.raises(
        ConfigError, match=rf"unknown config key '{key}' \(did you mean '{suggestion}'\?\)"
    ):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("train.step=5", "train.step", "train.steps"),
        ("trian.steps=5", "trian.steps", "train.steps"),
        ("model.num_expert=4", "model.num_expert", "model.num_experts"),
        ("mesh.axes.nod=4", "mesh.axes.nod", "mesh.axes.node"),
        ("train.steps.x=4", "train.steps.x", "train.steps"),
    ],
)
def test_unknown_key_in_override_names_the_closest(override, key, suggestion):
    with pytest.raises(
        ConfigError, match=rf"unknown config key '{key}' \(did you mean '{suggestion}'\?\)"
    ):
        load_config(None, [override])


def test_from_dict_needs_a_mapping():
    with pytest.raises(
        ConfigError,
        match=r"^config: expected a mapping of sections \['mesh', 'parallel', 'exchange', 'model', "
        r"'data', 'train'\], got \[\('train', \{\}\)\]$",
    ):
        Config.from_dict([("train", {})])  # type: ignore[arg-type]


def test_unknown_key_without_a_close_match():
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'$"):
        Config.from_dict({"zzz": {}})


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.steps", r"^override 'train\.steps' is not key=value \(e\.g\. train\.steps=50\)"),
        ("train.steps 5", r"^override 'train\.steps 5' is not key=value"),
        ("=5", r"^override '=5' has an empty key \(e\.g\. train\.steps=50\)"),
        ("train..steps=5", r"^override 'train\.\.steps=5' has an empty key"),
    ],
)
def test_malformed_override(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_overrides_must_be_a_list():
    with pytest.raises(
        ConfigError, match=r"^overrides must be a list of key=value strings, got 'train\.steps=5'"
    ):
        load_config(None, "train.steps=5")  # type: ignore[arg-type]


def test_axis_override_needs_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"^mesh\.axes: input should be a valid mapping"):
        load_config(_write(tmp_path, "mesh:\n  axes: [2, 4]\n"), ["mesh.axes.node=1"])


def test_override_does_not_hide_a_bad_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^train: expected a mapping"):
        load_config(_write(tmp_path, "train: 5\n"), ["train.steps=50"])


def test_override_value_must_parse():
    with pytest.raises(ConfigError, match=r"mesh\.axes: invalid YAML"):
        load_config(None, ["mesh.axes={node: 1"])


# -------------------------------------------------------------------- overrides, types


def test_overrides_apply_in_order_and_parse_yaml():
    cfg = load_config(
        None,
        [
            "train.steps=50",
            "exchange.method=flat",
            "train.lr=1e-3",
            "data.path=null",
            "train.steps=60",
            "exchange.topology=a100-8x200g",
        ],
    )
    assert cfg.train.steps == 60
    assert cfg.exchange.method == "flat"
    assert cfg.train.lr == 1e-3
    assert cfg.exchange.topology == "a100-8x200g"


def test_override_of_nested_mesh_axes():
    cfg = load_config(None, ["mesh.axes={node: 1, device: 8}"])
    assert cfg.strategy().shape == {"node": 1, "device": 8}
    assert list(cfg.mesh.axes) == ["node", "device"]
    cfg = load_config(None, ["mesh.axes.node=4", "mesh.axes.device=2"])
    assert cfg.strategy().shape == {"node": 4, "device": 2}
    cfg = load_config(
        None,
        ["mesh.axes={a: 2, b: 2, c: 2}", "exchange.node_axis=[a]", "exchange.device_axis=[b, c]"],
    )
    assert cfg.expert_axes == ("a", "b", "c")
    assert cfg.exchange.device_axis == ("b", "c")
    assert cfg.num_expert_devices == 8


def test_int_coerces_to_float_and_integral_float_to_int():
    cfg = load_config(None, ["model.capacity_factor=2", "train.steps=1e3"])
    assert cfg.model.capacity_factor == 2.0
    assert isinstance(cfg.model.capacity_factor, float)
    assert cfg.train.steps == 1000
    assert isinstance(cfg.train.steps, int)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.steps=fifty", r"^train\.steps: input should be a valid integer, got 'fifty'$"),
        ("train.steps=2.5", r"^train\.steps: input should be a valid integer, got 2\.5$"),
        ("train.steps=true", r"^train\.steps: input should be a valid integer, got True$"),
        ("train.lr=fast", r"^train\.lr: input should be a valid number, got 'fast'$"),
        ("train.lr=.inf", r"^train\.lr: input should be a finite number, got inf$"),
        ("model.aux_loss_weight=1" + "0" * 400,
         r"^model\.aux_loss_weight: input should be a valid number, got 1\.000e\+400$"),
        ("train.workdir=2024", r"^train\.workdir: input should be a valid string, got 2024$"),
        ("train.workdir=''", r"^train\.workdir: string should have at least 1 character"),
        ("exchange.method=[flat]", r"^exchange\.method: input should be a valid string"),
        ("exchange.node_axis=[node, node]", r"exchange\.node_axis: axes named twice"),
        ("exchange.node_axis=3", r"exchange\.node_axis: expected a mesh axis name"),
        ("mesh.axes=[2, 4]", r"^mesh\.axes: input should be a valid mapping, got \[2, 4\]$"),
        ("mesh.axes={}", r"^mesh\.axes: mapping should have at least 1 item, not 0, got \{\}$"),
        ("mesh.axes={1: 8}", r"^mesh\.axes: input should be a valid string, got 1$"),
        ("mesh.axes={'': 8}", r"^mesh\.axes: string should have at least 1 character"),
        ("mesh.axes.node=two", r"^mesh\.axes\.node: input should be a valid integer"),
        ("mesh.ranks=7", r"^mesh\.ranks: expected a nested list"),
        ("mesh.ranks=[[0, 1, 2, 3], [4, 5, 6, x]]", r"^mesh\.ranks: rank ids must be integers"),
        ("train.profile_steps=[1, x]",
         r"^train\.profile_steps\.1: input should be a valid integer, got 'x'$"),
        ("train.profile_steps=[0, 5]", r"^train\.profile_steps: start must be >= 1"),
        ("train.profile_steps=[3, 3]", r"^train\.profile_steps: start must be below stop"),
        ("train.profile_steps=[1, 2, 3]", r"^train\.profile_steps: list should have at most 2"),
    ],
)
def test_type_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


# ------------------------------------------------------------------ validation errors

GE, GT = "input should be greater than or equal to", "input should be greater than"
LE = "input should be less than or equal to"
BAD = [
    # (overrides, dotted key the message starts with, what the message says next)
    *[
        ([f"model.{k}=0"], f"model.{k}", f"{GE} 1, got 0")
        for k in ("d_model", "num_layers", "num_heads", "d_ff", "top_k")
    ],
    (["model.num_experts=-1"], "model.num_experts", f"{GE} 0, got -1"),
    (["model.dense_layers=-1"], "model.dense_layers", f"{GE} 0, got -1"),
    (["model.mlp=relu"], "model.mlp", "must be one of"),
    (["parallel.moe_tensor=experts"], "parallel.moe_tensor", "must be one of"),
    *[
        ([f"train.{k}=0"], f"train.{k}", f"{GE} 1, got 0")
        for k in (
            "steps",
            "batch_size",
            "seq_len",
            "log_every",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
        )
    ],
    (["model.vocab_size=0"], "model.vocab_size", f"{GE} 2, got 0"),
    (["model.vocab_size=1"], "model.vocab_size", f"{GE} 2, got 1"),
    (["train.lr=0"], "train.lr", f"{GT} 0, got 0"),
    (["train.lr=-1e-3"], "train.lr", f"{GT} 0, got -0.001"),
    (["train.grad_clip=0"], "train.grad_clip", f"{GT} 0, got 0"),
    (["train.weight_decay=-0.1"], "train.weight_decay", f"{GE} 0, got -0.1"),
    (["train.warmup_steps=-1"], "train.warmup_steps", f"{GE} 0, got -1"),
    (["train.seed=-1"], "train.seed", f"{GE} 0, got -1"),
    (["train.seed=4294967296"], "train.seed", f"{LE} 4294967295, got 4294967296"),
    (["train.steps=2147483648"], "train.steps", f"{LE} 2147483647, got 2147483648"),
    (["model.top_k=9"], "model.top_k", "9 is more than model.num_experts=8"),
    (
        ["model.num_experts=1", "mesh.axes={node: 1, device: 1}", "train.batch_size=1"],
        "model.top_k",
        "2 is more than model.num_experts=1",
    ),
    (["model.capacity_factor=-1.5"], "model.capacity_factor", f"{GE} 0, got -1.5"),
    (["exchange.dedup=2"], "exchange.dedup", "input should be a valid boolean, got 2"),
    (
        ["exchange.dedup=true", "exchange.device_axis=[]", "mesh.axes={node: 8}"],
        "exchange.dedup",
        "needs both exchange.node_axis and exchange.device_axis, got ['node'] and []",
    ),
    (
        ["exchange.dedup=true", "model.dispatch=einsum"],
        "exchange.dedup",
        "needs model.dispatch: sort, got 'einsum'",
    ),
    (["model.num_shared_experts=-1"], "model.num_shared_experts", f"{GE} 0, got -1"),
    (["model.max_nodes=0"], "model.max_nodes", f"{GE} 1, got 0"),
    (["model.max_nodes=two"], "model.max_nodes", "input should be a valid integer"),
    (["model.max_nodes=3"], "model.max_nodes", "3 is more than the 2 nodes"),
    (
        ["model.max_nodes=1", "model.top_k=5"],
        "model.max_nodes",
        "1 node(s) of 4 experts hold fewer than model.top_k=5 experts",
    ),
    (["model.aux_loss_weight=-0.01"], "model.aux_loss_weight", f"{GE} 0, got -0.01"),
    (["model.z_loss_weight=-1"], "model.z_loss_weight", f"{GE} 0, got -1"),
    (["model.num_heads=3"], "model.d_model", "64 is not divisible by model.num_heads=3"),
    (
        ["model.d_model=24", "model.num_heads=8"],
        "model.d_model",
        "head size d_model / num_heads = 3 must be even",
    ),
    (["model.dispatch=onehot"], "model.dispatch", "must be one of sort, einsum; got 'onehot'"),
    (["model.dtype=float16"], "model.dtype", "must be one of float32, bfloat16; got 'float16'"),
    (
        ["exchange.method=tree"],
        "exchange.method",
        "must be one of auto, flat, hierarchical; got 'tree'",
    ),
    (
        ["exchange.order=random"],
        "exchange.order",
        "must be one of node_first, device_first; got 'random'",
    ),
    (
        ["exchange.topology=tpu-v5"],
        "exchange.topology",
        "must be one of a100-8x200g, h100-8x400g, h800-8x400g or a topology file (*.yaml); "
        "got 'tpu-v5'",
    ),
    (["data.kind=images"], "data.kind", "must be one of markov, text, tokens; got 'images'"),
    (["data.kind=text"], "data.path", "required for data.kind='text'"),
    (["data.kind=tokens"], "data.path", "required for data.kind='tokens'"),
    (
        ["data.dtype=float32"],
        "data.dtype",
        "must be one of uint16, uint32, int32, int64, uint64, int16, uint8, int8; "
        "got 'float32'",
    ),
    (["data.dtype=u4"], "data.dtype", "must be one of uint16, uint32"),
    (["data.dtype=7"], "data.dtype", "input should be a valid string, got 7"),
    (
        ["data.kind=text", "data.path=x.txt"],
        "model.vocab_size",
        "16 is too small for data.kind='text'",
    ),
    (["data.order=0"], "data.order", f"{GE} 1, got 0"),
    (["data.concentration=0"], "data.concentration", f"{GT} 0, got 0"),
    (["data.seed=-3"], "data.seed", f"{GE} 0, got -3"),
    (
        ["mesh.axes={node: 0, device: 4}"],
        "mesh",
        "axis 'node': size must be positive, got 0",
    ),
    (
        ["mesh.axes={node: -1, device: 4}"],  # -1 only with explicit ranks
        "mesh",
        "axis 'node' is -1 but no world_size was given",
    ),
    (
        ["mesh.ranks=[[0, 1, 2, 3], [4, 5, 6, 6]]"],
        "mesh",
        "rank ids must be a permutation of 0..7: duplicates [6], missing [7]",
    ),
    (
        ["mesh.ranks=[[0, 1], [2, 3]]"],  # 4 ranks for 2×4 axes
        "mesh",
        "axis sizes {'node': 2, 'device': 4} multiply to 8, not world_size 4",
    ),
    (
        ["mesh.axes={node: -1, device: 2}", "mesh.ranks=[[0, 1, 2, 3]]"],
        "mesh",
        "mesh.ranks has shape (1, 4) but mesh.axes gives (2, 2)",
    ),
    (
        ["exchange.node_axis=nodes"],
        "exchange.node_axis",
        "'nodes' is not an axis of the mesh",
    ),
    (
        ["exchange.device_axis=[device, gpu]"],
        "exchange.device_axis",
        "'gpu' is not an axis of the mesh",
    ),
    (
        ["exchange.device_axis=node"],
        "exchange.device_axis",
        "axes ['node'] are also in exchange.node_axis",
    ),
    (
        ["exchange.node_axis=[node, device]", "exchange.device_axis=[device]"],
        "exchange.device_axis",
        "axes ['device'] are also in exchange.node_axis",
    ),
    (["model.num_experts=6"], "model.num_experts", "6 is not divisible by the 8 expert devices"),
    (["train.batch_size=12"], "train.batch_size", "12 is not divisible by the 8 batch devices"),
    # The parallel section: roles.
    (["parallel.tensor=tp"], "parallel.tensor", "'tp' is not an axis of the mesh"),
    (["parallel.pipeline=pp"], "parallel.pipeline", "'pp' is not an axis of the mesh"),
    (["parallel.data=[dp]"], "parallel.data", "'dp' is not an axis of the mesh"),
    (
        ["parallel.tensor=node"],
        "exchange.node_axis",
        "axis 'node' already has a role (tensor, from parallel.tensor)",
    ),
    (
        [*PP_TP, "parallel.fsdp=pp"],
        "parallel.pipeline",
        "axis 'pp' already has a role (fsdp, from parallel.fsdp)",
    ),
    (["parallel.fsdp=[a, a]"], "parallel.fsdp", "axes named twice: ['a']"),
    (["parallel.tensor=3"], "parallel.tensor", "expected a mesh axis name or a list of them"),
    (["parallel.pipeline=[pp]"], "parallel.pipeline", "input should be a valid string"),
    (["parallel.microbatches=0"], "parallel.microbatches", f"{GE} 1, got 0"),
    (
        [*PP_TP, "model.num_layers=3"],
        "parallel.pipeline",
        "2 stages (axis 'pp') do not divide model.num_layers=3",
    ),
    (
        [*PP_TP, "model.num_heads=1", "model.d_model=64"],
        "model.num_heads",
        "1 attention heads cannot be split over the 2 tensor-parallel devices",
    ),
    (
        [*PP_TP, "model.vocab_size=15"],
        "model.vocab_size",
        "15 vocabulary entries (embedding and head) cannot be split over the 2 tensor",
    ),
    (
        ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *NO_EXPERTS, "model.d_model=36",
         "model.num_heads=2"],
        "model.d_model",
        "36 cannot be sharded over the 8 fsdp devices",
    ),
    (
        ["parallel.microbatches=2"],
        "parallel.microbatches",
        "2 microbatches need a pipeline axis",
    ),
    (["parallel.schedule=1f1b"], "parallel.schedule", "'1f1b' needs a pipeline axis"),
    (["parallel.stage_layers=[1, 1]"], "parallel.stage_layers",
     "2 entries for no pipeline (parallel.pipeline is null)"),
    ([*PP_TP, "parallel.stage_layers=[2]"], "parallel.stage_layers",
     "1 entries for the 2 stages of axis 'pp'"),
    ([*PP_TP, "parallel.stage_layers=[1, 2]"], "parallel.stage_layers",
     "[1, 2] sums to 3, not model.num_layers=2"),
    ([*PP_TP, "parallel.stage_layers=[2, 0]"], "parallel.stage_layers.1",
     f"{GE} 1, got 0"),
    ([*PP_TP, "parallel.schedule=zigzag"], "parallel.schedule",
     "must be one of gpipe, 1f1b, interleaved; got 'zigzag'"),
    ([*PP_TP, "parallel.virtual_stages=2"], "parallel.virtual_stages",
     "2 chunks per stage need parallel.schedule: interleaved, got 'gpipe'"),
    ([*PP_TP, "parallel.virtual_stages=0"], "parallel.virtual_stages", f"{GE} 1, got 0"),
    ([*PP_TP, "parallel.schedule=interleaved", "parallel.virtual_stages=2",
      "parallel.microbatches=2"], "parallel.virtual_stages",
     "2 does not divide the 1 layers per stage (model.num_layers=2 over 2 stages of axis 'pp')"),
    ([*PP_TP, "parallel.schedule=interleaved", "parallel.stage_layers=[1, 1]",
      "parallel.microbatches=2"], "parallel.stage_layers",
     "uneven stages cannot be combined with parallel.schedule: interleaved"),
    ([*PP_TP, "parallel.schedule=interleaved"], "parallel.microbatches",
     "the interleaved schedule needs at least as many microbatches as stages, got 1 for 2"),
    (
        [*PP_TP, "parallel.microbatches=3"],
        "parallel.microbatches",
        "3 does not divide the per-device batch of 16 sequences",
    ),
    (
        [*PP_TP, "train.seq_len=1", "parallel.microbatches=16"],
        "parallel.tensor",
        "the MoE splits each device's 1 tokens per microbatch over the 2 tensor devices",
    ),
    # A user's own model, by import path (imported only when used: tests/config/
    # test_imports.py); its logical axes.
    (["model.factory=math"], "model.factory", "expected an import path module:attribute"),
    (["model.factory_kwargs={a: 1}"], "model.factory_kwargs",
     "keyword arguments for model.factory, which is null"),
    (["model.flops_per_token=0"], "model.flops_per_token", "input should be greater than 0"),
    (["parallel.logical_axes={mlp: tp}"], "parallel.logical_axes.mlp", "'tp' is not a role"),
    (["parallel.logical_axes={mlp: 3}"], "parallel.logical_axes.mlp", "expected a role"),
    (["parallel.logical_axes={mlp: []}"], "parallel.logical_axes.mlp", "an empty list"),
    (["parallel.logical_axes={up: hid, hid: tensor}"], "parallel.logical_axes.up",
     "'hid' is not a role (data, fsdp, tensor, pipeline, expert, context), a logical name "
     "(layers, "),
    (["parallel.logical_axes=[mlp]"], "parallel.logical_axes", "expected a mapping of names"),
    (["parallel.logical_axes={ffn: tensors}"], "parallel.logical_axes.ffn",
     "'tensors' is not a role (data, fsdp, tensor, pipeline, expert, context), a logical name"),
    (["parallel.logical_axes={w: w}"], "parallel.logical_axes.w", "'w' is not a role"),
]


@pytest.mark.parametrize(("overrides", "key", "detail"), BAD, ids=[" ".join(o) for o, *_ in BAD])
def test_every_validation_error_names_its_key(overrides, key, detail):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(f"{key}: {detail}"), str(info.value)


def test_a_misspelt_logical_axes_target_gets_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"^parallel\.logical_axes\.ffn: .*; did you mean "
                                          r"'tensor'\?$"):
        load_config(None, ["parallel.logical_axes={ffn: tensors}"])


def test_a_factory_model_is_not_held_to_the_transformers_sizes():
    tp8 = ["mesh.axes={tp: 8}", "parallel.tensor=tp", *NO_EXPERTS]
    with pytest.raises(ConfigError, match=r"^model\.num_heads: 4 attention heads"):
        load_config(None, tp8)
    cfg = load_config(None, [*tp8, "model.factory=_user_gpt:make", "model.factory_kwargs={b: [1]}",
                             "parallel.logical_axes={mlp: tensor, up: mlp, seq: null, x: [tp]}"])
    assert cfg.parallel.logical_axes == {"mlp": "tensor", "up": "mlp", "seq": None, "x": ("tp",)}
    assert cfg.to_dict()["model"]["factory_kwargs"] == {"b": [1]}
    assert Config.from_dict(cfg.to_dict()) == cfg and hash(Config.from_dict(cfg.to_dict()))
    assert cfg.model.loss_function() is None
    # The batch must still split over the batch devices.
    with pytest.raises(ConfigError, match=r"^train\.batch_size: 12 is not divisible"):
        load_config(None, ["model.factory=_user_gpt:make", "train.batch_size=12"])


def test_cross_section_messages_explain_the_numbers():
    with pytest.raises(
        ConfigError, match=r"6 is not divisible by the 8 expert devices \(node×device = 2×4\)"
    ):
        load_config(None, ["model.num_experts=6"])
    with pytest.raises(ConfigError, match=r"12 is not divisible by the 8 batch devices"):
        load_config(None, ["train.batch_size=12"])
    with pytest.raises(
        ConfigError, match=r"'nodes' is not an axis of the mesh \(mesh\.axes: node, device\)"
    ):
        load_config(None, ["exchange.node_axis=nodes"])
    with pytest.raises(
        ConfigError,
        match=r"^model\.vocab_size: 16 is too small for data\.kind='text' \(byte-level text "
        r"needs at least 256\)$",
    ):
        load_config(None, ["data.kind=text", "data.path=x.txt"])


def test_experts_divisible_by_expert_devices_not_by_all_devices():
    # 4 expert devices (node × device) of 8; 4 experts is fine although 8 devices exist.
    cfg = load_config(None, ["mesh.axes={dp: 2, node: 2, device: 2}", "model.num_experts=4"])
    assert cfg.model.num_experts == 4
    with pytest.raises(
        ConfigError, match=r"model\.num_experts: 6 .* 4 expert devices \(node×device = 2×2\)"
    ):
        with_overrides(cfg, ["model.num_experts=6"])


def test_valid_edge_cases():
    cfg = load_config(
        None,
        [
            "train.warmup_steps=300",  # == steps is allowed
            "model.top_k=1",
            "model.aux_loss_weight=0",
            "data.kind=text",
            "data.path=corpus.txt",
            "model.vocab_size=256",
            "model.dtype=bfloat16",
            "model.dispatch=einsum",
            "exchange.method=hierarchical",
            "exchange.order=device_first",
            "train.seed=4294967295",  # seeds are uint32, other integers int32
            "data.seed=2147483648",
        ],
    )
    assert cfg.data.path == "corpus.txt"


# ------------------------------------------------------------- construction, round trip


def test_direct_construction_validates_and_coerces():
    assert ModelConfig(capacity_factor=2).capacity_factor == 2.0
    model = ModelConfig(num_experts=np.int64(16), capacity_factor=np.float32(1.5))
    assert type(model.num_experts) is int and type(model.capacity_factor) is float
    with pytest.raises(ConfigError,
                       match=r"^model\.num_experts: input should be a valid integer, got '8'$"):
        ModelConfig(num_experts="8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^model\.num_experts: 6 is not divisible"):
        Config(model=ModelConfig(num_experts=6))
    with pytest.raises(ConfigError, match=r"^train: input should be an instance of TrainConfig"):
        Config(train={"steps": 5})  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"^model\.num_experts: 4 is not divisible by the 8 expert devices"
    ):
        Config().replace(model=ModelConfig(num_experts=4))
    validate(Config())


def test_replace_merges_section_fields_and_revalidates():
    cfg = Config().replace(train={"steps": 10, "warmup_steps": 5}, model=ModelConfig(top_k=1))
    assert (cfg.train.steps, cfg.train.warmup_steps, cfg.model.top_k) == (10, 5, 1)
    assert cfg.train.batch_size == Config().train.batch_size
    with pytest.raises(ConfigError, match=rf"^train\.steps: {GE} 1, got 0$"):
        Config().replace(train={"steps": 0})
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train\.step' \(did you mean 'train\.steps'"
    ):
        Config().replace(train={"step": 10})
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'"):
        Config().replace(trian={"steps": 10})


def test_with_overrides_returns_new_config():
    base = Config()
    cfg = with_overrides(
        base, ["train.steps=10", "train.warmup_steps=0", "mesh.axes.node=1", "train.batch_size=4"]
    )
    assert cfg.train.steps == 10 and cfg.num_devices == 4
    assert base == Config()


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["mesh.ranks=[[7, 6, 5, 4], [3, 2, 1, 0]]", "exchange.node_axis=[node]"],
        [
            "mesh.axes={dp: 2, ep: 2, tp: 2}",
            "exchange.node_axis=ep",
            "exchange.device_axis=[tp]",
            "data.kind=tokens",
            "data.path=t.bin",
            "data.dtype=uint32",
            "train.lr=1e-5",
            "exchange.topology=h100-8x400g",
        ],
    ],
)
def test_round_trips(tmp_path, overrides):
    cfg = load_config(None, overrides)
    d = cfg.to_dict()
    assert Config.from_dict(d) == cfg
    assert tuple(d) == SECTIONS
    path = tmp_path / "saved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(Config.from_dict(d)) == hash(cfg)


def test_to_dict_is_plain_yaml_safe_data():
    import yaml

    d = load_config(None, ["mesh.ranks=[[7, 6, 5, 4], [3, 2, 1, 0]]"]).to_dict()
    assert type(d["mesh"]["axes"]) is dict
    assert d["mesh"]["ranks"] == [[7, 6, 5, 4], [3, 2, 1, 0]]
    yaml.safe_dump(d)


def test_config_is_read_only():
    cfg = Config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.steps = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"^mesh\.axes is read-only; build a new config with"):
        cfg.mesh.axes["node"] = 4
    with pytest.raises(TypeError, match=r"^mesh\.axes is read-only; build a new config with"):
        cfg.mesh.axes.update(node=4)
    assert cfg.mesh.axes == {"node": 2, "device": 4}


def test_axis_order_matters_for_equality():
    a = MeshConfig(axes={"node": 2, "device": 4})
    b = MeshConfig(axes={"device": 4, "node": 2})
    assert a != b
    assert a == MeshConfig()


# --------------------------------------------------------------------- devices, import


def test_check_devices():
    check_devices(Config(), 8)
    check_devices(Config(), 16)
    with pytest.raises(ConfigError, match=r"^mesh: mesh needs 8 devices but only 4 are available"):
        check_devices(Config(), 4)


def test_config_module_does_not_import_jax():
    code = "import sys, meshkit.config; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -------------------------------------------------------------------------- reference


def test_format_reference_lists_every_key_with_default_and_meaning():
    ref = format_reference()
    lines = ref.splitlines()
    assert lines[:2] == ["| key | default | meaning |", "|---|---|---|"]
    assert len(lines) == 2 + len(ALL_KEYS)
    for line, key in zip(lines[2:], ALL_KEYS):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells[0] == f"`{key}`"
        assert cells[1].startswith("`") and len(cells[2]) > 5, line
    assert "| `mesh.axes` | `{node: 2, device: 4}` |" in ref
    assert "| `exchange.topology` | `null` |" in ref


def test_fine_grained_example():
    cfg = load_config(ROOT / "configs" / "fine_grained.yaml")
    m = cfg.model
    assert cfg.strategy().shape == {"node": 2, "device": 4}
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.max_nodes) == (16, 4, 1, 1)
    assert cfg.exchange.dedup is True
