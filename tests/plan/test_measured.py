"""A model meshkit builds, measured: parameters by jax.eval_shape, FLOPs and bytes by
XLA's cost analysis of compiled layers, against the description's formulas."""

from __future__ import annotations

from meshkit.cli import main
from meshkit.plan.model_desc import ModelDesc
from meshkit.training import compile_step, measured

# Grouped-query attention and a GELU MLP: measured as meshkit builds it (GQA, SwiGLU
# experts).
DESC = ModelDesc(name="tiny", vocab_size=128, d_model=64, num_layers=4, num_heads=4,
                 num_kv_heads=2, d_ff=128, num_experts=4, top_k=2, seq_len=16,
                 batch_size=8, compute_dtype="float32", mlp="gelu")


def test_measured_parameters_and_flops_agree_with_the_formulas() -> None:
    got = measured.measure_model(DESC)
    built = DESC.buildable()
    assert got.params == built.params  # jax.eval_shape of the model meshkit builds
    assert got.tokens == 8 * 16
    # XLA counts what the formula leaves out (capacity padding, softmax, norms, AdamW):
    # more, never less.
    assert 1.0 < got.flops_per_token(4) / built.flops_per_token() < 1.6
    assert got.layer_flops > 0 and got.other_flops > 0 and got.layer_bytes > 0
    # The line through 2 and 3 layers holds at 4.
    flops, _ = measured._cost(compile_step(measured._config(built, 4)))
    assert abs(got.step_flops(4) / flops - 1) < 0.01


def test_plan_measure_prints_the_measured_line(tmp_path, capsys) -> None:
    model = tmp_path / "tiny.yaml"
    model.write_text("name: tiny\nvocab_size: 64\nd_model: 32\nnum_layers: 2\nnum_heads: 2\n"
                     "d_ff: 64\nseq_len: 8\nbatch_size: 8\ncompute_dtype: float32\n")
    assert main(["plan", "--model", str(model), "--devices", "8", "--top", "1",
                 "--measure"]) == 0
    captured = capsys.readouterr()
    assert "measured as meshkit builds it:" in captured.out
    assert "(jax.eval_shape; formula" in captured.out
    assert "measure: compiling" in captured.err


def test_measure_without_a_model_is_one_line_exit_2(capsys) -> None:
    assert main(["plan", "--devices", "8", "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure: needs --model FILE" in err and len(err.strip().splitlines()) == 1
