"""Context parallelism's config: `parallel.context`, `parallel.context_method`,
`model.num_kv_heads` and `data.eos_id`; each bad value is one line naming its key, exit 2.

No JAX, nothing compiled: the CLI checks these before JAX starts.
"""

import pytest

from meshkit.cli import main
from meshkit.config import Config, ConfigError, load_config

NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
CP4 = ["mesh.axes={dp: 2, cp: 4}", *NO_EXPERTS, "parallel.context=cp"]
CP_TP = ["mesh.axes={cp: 2, tp: 2}", *NO_EXPERTS, "parallel.context=cp", "parallel.tensor=tp"]
TWO_LEVEL = ["mesh.axes={cpn: 2, cpd: 4}", *NO_EXPERTS, "parallel.context=[cpn, cpd]"]

BAD = [
    # The sequence is cut into 2c load-balanced chunks.
    ([*CP4, "train.seq_len=12"], "train.seq_len",
     "12 is not divisible by 2c = 8: the 4 context devices (parallel.context: ['cp'])"),
    # A context axis has no other role, and is an axis of the mesh, listed outer first.
    *(([*CP4, f"{key}=cp"], "parallel.context",
       f"axis 'cp' already has a role ({role}, from {key}); a context axis has no other role")
      for role, key in (("data", "parallel.data"), ("fsdp", "parallel.fsdp"),
                        ("tensor", "parallel.tensor"), ("pipeline", "parallel.pipeline"),
                        ("expert", "exchange.node_axis"), ("expert", "exchange.device_axis"))),
    ([*CP4, "parallel.context=sp"], "parallel.context",
     "'sp' is not an axis of the mesh (mesh.axes: dp, cp)"),
    ([*TWO_LEVEL, "parallel.context=[cpd, cpn]"], "parallel.context",
     "list the axes outer first, as mesh.axes orders them: ['cpn', 'cpd'], got ['cpd', 'cpn']"),
    # A method needs context axes; Ulysses needs the heads of a tensor rank to divide.
    (["parallel.context_method=ring"], "parallel.context_method",
     "'ring' says how attention crosses the context axes, but parallel.context is empty"),
    ([*CP4, "parallel.context_method=p2p"], "parallel.context_method",
     "must be one of auto, all_gather, ring, ulysses, hierarchical; got 'p2p'"),
    (["mesh.axes={cp: 8}", *NO_EXPERTS, "parallel.context=cp", "parallel.context_method=ulysses"],
     "parallel.context_method",
     "ulysses splits the 4 query heads of each tensor rank (model.num_heads=4) over the 8 "
     "context devices (parallel.context: ['cp']), which does not divide them"),
    ([*CP4, "parallel.context_method=ulysses", "model.num_heads=8", "model.num_kv_heads=2"],
     "parallel.context_method",
     "ulysses splits the 2 kv heads of each tensor rank (model.num_kv_heads=2) over the 4"),
    (["mesh.axes={cp: 4, tp: 2}", *NO_EXPERTS, "parallel.context=cp", "parallel.tensor=tp",
      "parallel.context_method=ulysses", "model.num_heads=8", "model.num_kv_heads=2"],
     "parallel.context_method",
     "ulysses splits the 1 kv heads of each tensor rank (model.num_kv_heads=2 over 2 tensor "
     "devices) over the 4 context devices"),
    # Kv heads the tensor axes do not divide are replicated: each rank holds all of them.
    ([*CP_TP, "parallel.context_method=ulysses", "model.num_heads=12", "model.num_kv_heads=3",
      "model.d_model=48"], "parallel.context_method",
     "ulysses splits the 3 kv heads of each tensor rank (model.num_kv_heads=3 replicated on "
     "each of 2 tensor devices, which do not divide them) over the 2 context devices"),
    ([*CP4, "parallel.context_method=hierarchical"], "parallel.context_method",
     "hierarchical runs Ulysses over the last context axis and a ring over the others, so it "
     "needs two or more context axes; got parallel.context: ['cp']"),
    ([*TWO_LEVEL, "parallel.context_method=hierarchical", "model.num_heads=2"],
     "parallel.context_method",
     "hierarchical splits the 2 query heads of each tensor rank (model.num_heads=2) over the 4 "
     "devices of the last context axis 'cpd'"),
    # Grouped-query attention.
    (["model.num_kv_heads=3"], "model.num_kv_heads", "3 does not divide model.num_heads=4"),
    (["model.num_kv_heads=8"], "model.num_kv_heads", "8 does not divide model.num_heads=4"),
    (["model.num_kv_heads=0"], "model.num_kv_heads", "input should be greater than or equal to 1"),
    # Packed documents.
    (["data.eos_id=16"], "data.eos_id",
     "16 is outside the vocabulary: ids are 0..15 (model.vocab_size=16)"),
    (["data.eos_id=-1"], "data.eos_id", "input should be greater than or equal to 0"),
    (["data.eos_id=1", "model.factory=_user_gpt:make", *NO_EXPERTS], "data.eos_id",
     "packed documents are kept apart by meshkit's transformer"),
    (["data.eos_id=1", "mesh.axes={pp: 2, node: 2, device: 2}", "parallel.pipeline=pp"],
     "data.eos_id",
     "packed documents cannot be combined with a pipeline"),
    # Checks that hold each context device's share of a sequence to the tensor axes and
    # to the attention blocks.
    (["mesh.axes={cp: 2, tp: 4}", *NO_EXPERTS, "parallel.context=cp", "parallel.tensor=tp",
      "parallel.sequence_parallel=true", "train.seq_len=12", "model.num_experts=0"],
     "parallel.sequence_parallel",
     "the 4 tensor devices (parallel.tensor: ['tp']) do not divide the 6 positions per context "
     "device (train.seq_len=12 over 2 context devices)"),
    (["mesh.axes={cp: 2}", *NO_EXPERTS, "parallel.context=cp", "model.attention=chunked",
      "model.attention_chunk=32", "train.seq_len=96"], "model.attention_chunk",
     "32 does not divide the positions per context device (train.seq_len/2)=48"),
]


@pytest.mark.parametrize(("overrides", "key", "detail"), BAD, ids=[" ".join(o) for o, *_ in BAD])
def test_each_error_is_one_line_naming_its_key_exit_2(overrides, key, detail, capsys):
    assert main(["config", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"meshkit config: error: {key}: {detail}"), err


def test_the_python_api_raises_the_same_error():
    with pytest.raises(ConfigError, match=r"^train\.seq_len: 12 is not divisible by 2c = 8"):
        load_config(None, [*CP4, "train.seq_len=12"])


@pytest.mark.parametrize("overrides", [
    # Context axes are no batch axes: the batch need only divide over dp.
    [*CP4, "train.batch_size=2"],
    # Sequence parallelism, a pipeline, and a user's model (whose heads the config does
    # not know: meshkit.context_attention checks them) all combine with context axes.
    [*CP_TP, "parallel.sequence_parallel=true", "model.num_experts=0"],
    ["mesh.axes={pp: 2, cp: 2}", *NO_EXPERTS, "parallel.context=cp", "parallel.pipeline=pp"],
    ["mesh.axes={cp: 8}", *NO_EXPERTS, "parallel.context=cp", "parallel.context_method=ulysses",
     "model.factory=_user_gpt:make"],
    # Hierarchical divides the heads over the last context axis only (Ulysses over 8
    # devices would not divide 4 heads).
    ["mesh.axes={cpn: 4, cpd: 2}", *NO_EXPERTS, "parallel.context=[cpn, cpd]",
     "parallel.context_method=hierarchical"],
    # Kv heads replicated over 4 tensor ranks, 2 per rank, divide over 2 context devices.
    ["mesh.axes={cp: 2, tp: 4}", *NO_EXPERTS, "parallel.context=cp", "parallel.tensor=tp",
     "parallel.context_method=ulysses", "model.num_heads=8", "model.num_kv_heads=2"],
    ["data.eos_id=15", "model.num_kv_heads=2"],
])
def test_what_context_parallelism_allows(overrides):
    load_config(None, overrides)


def test_a_context_axis_is_neither_a_batch_axis_nor_a_data_axis():
    cfg = load_config(None, [*CP4, "train.batch_size=2"])
    assert cfg.roles == {"dp": "data", "cp": "context"}
    assert cfg.batch_axes == ("dp",) and cfg.batch_devices == 2
    assert cfg.axes_with_role("data") == ("dp",) and cfg.context_axes == ("cp",)
    assert cfg.context_devices == 4 and cfg.unnamed_axes == ("dp",)
    assert cfg.describe_roles() == "dp=2 (no role given: data), cp=4 context"
    # Nothing gets a role by its name: an unnamed `cp` splits the batch, and says so.
    plain = load_config(None, ["mesh.axes={dp: 2, cp: 4}", *NO_EXPERTS])
    assert plain.roles == {"dp": "data", "cp": "data"} and plain.context_axes == ()
    assert plain.describe_roles() == "dp=2 (no role given: data), cp=4 (no role given: data)"


def test_defaults():
    cfg = Config()
    assert cfg.parallel.context == () and cfg.parallel.context_method == "auto"
    assert cfg.model.num_kv_heads is None and cfg.model.kv_heads == cfg.model.num_heads
    assert cfg.data.eos_id is None and cfg.context_devices == 1
