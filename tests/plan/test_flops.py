"""Model FLOPs per token: each matmul term checked against the weights the model has."""


import numpy as np
import pytest
from flax import nnx

from meshkit.config import Config, ModelConfig
from meshkit.model.transformer import Transformer
from meshkit.plan.flops import flops_per_token, peak_flops


def _shapes(model_config: ModelConfig) -> dict[str, int]:
    config = Config().replace(model=model_config)
    model = nnx.eval_shape(lambda: Transformer.from_config(config))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): int(np.prod(v.shape)) for path, v in flat}


@pytest.mark.parametrize("top_k,shared", [(1, 0), (2, 1), (4, 2)])
def test_matmul_terms_are_twice_the_weights_a_token_uses(top_k, shared):
    m = ModelConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, d_ff=24,
                    num_experts=8, top_k=top_k, num_shared_experts=shared)
    w = _shapes(m)
    routed = sum(w[f"layers/moe/{n}"] for n in ("w_gate", "w_up", "w_down"))
    shared_w = sum(v for k, v in w.items() if "/shared_" in k)
    f = flops_per_token(m, seq_len=8)
    assert f.attention == 2 * (w["layers/qkv"] + w["layers/out"])
    assert f.router == 2 * w["layers/moe/router"]
    assert f.experts == 2 * routed * top_k // m.num_experts  # k of the E experts' weights
    assert f.shared == 2 * shared_w
    assert f.head == 2 * w["head"]
    assert f.training == 3 * f.forward


def test_scores_grow_with_the_sequence_and_nothing_else_does():
    m = ModelConfig()
    short, long = flops_per_token(m, seq_len=64), flops_per_token(m, seq_len=128)
    assert long.scores == 2 * short.scores == 2 * m.num_layers * 4 * 64 * m.d_model
    assert long.forward - short.forward == short.scores


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_seq_len_is_named(bad):
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(ModelConfig(), seq_len=bad)


def test_peak_is_known_for_datasheet_gpus_only():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("cpu") is None
    assert peak_flops("TPU v5 lite") is None
