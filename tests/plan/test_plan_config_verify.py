"""``meshkit plan CONFIG``: ``--verify`` compiles the config itself, and a config naming
``model.factory`` plans and verifies the user's own model (measured, imported only
because the config names it, and announced)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from meshkit.cli import main
from meshkit.config import load_config
from meshkit.plan.config_plan import config_desc, run_plan
from meshkit.plan.planner import Layout, PlanError
from meshkit.training.factory_desc import describe_factory

USER_GPT = Path(__file__).resolve().parents[1] / "_user_gpt.py"
MODULE = """
from _user_gpt import make as make_gpt

def make(rngs, *, d=16):
    return make_gpt(rngs, vocab=16, width=d, heads=4, layers=1)
"""
FACTORY = ["model.factory=planned_gpt:make", "model.vocab_size=16", "train.seq_len=16",
           "parallel.logical_axes={width: fsdp, nheads: tensor, ffn: tensor, "
           "vocab_rows: tensor}"]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's model in the current directory, where the command and its compiling
    subprocess (``python -m``) both find it."""
    shutil.copy(USER_GPT, tmp_path / "_user_gpt.py")
    (tmp_path / "planned_gpt.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the command adds it; the library does not
    yield tmp_path
    sys.modules.pop("planned_gpt", None)  # this test's; the tests' _user_gpt stays


def test_verify_compiles_the_config_and_the_memory_is_xlas(capsys) -> None:
    assert main(["plan", "--devices", "8", "--verify", "1", "--top", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    ratio = row["predicted_memory_bytes"] / row["verified_memory_bytes"]
    assert 0.9 <= ratio <= 1.1, (row["layout"], ratio)
    assert row["compiled_predicted_memory_bytes"] == row["predicted_memory_bytes"]


def test_a_factory_config_plans_and_verifies_the_users_model(user_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="meshkit"):
        report = run_plan(None, FACTORY, devices=8, verify=1, top=2,
                          describe=describe_factory)
    # Announced, as meshkit train announces it.
    assert "importing model.factory planned_gpt:make from" in caplog.text
    rows = [json.loads(report.to_json())[i] for i in range(2)]
    assert all(r["layout"].split()[0][:2] in ("dp", "fs") for r in rows)  # data and fsdp
    ratio = rows[0]["predicted_memory_bytes"] / rows[0]["verified_memory_bytes"]
    assert 0.8 <= ratio <= 1.2, ratio
    # The description's parameters are the user's model's, by jax.eval_shape.
    from planned_gpt import make  # type: ignore[import-not-found]

    model = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
    want = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    desc = report.desc
    assert desc.params == want and desc.measured is not None
    assert 0 < desc.measured.fsdp_params < want  # the width-named weights, not the rest
    # XLA's FLOPs a token against the 6·N count of its matmul weights (the embedding
    # lookup aside) and the attention scores: the same order, not another model's.
    six_n = 6 * (want - 16 * 16) + 12 * 16 * 16
    assert 0.7 < desc.flops_per_token() / six_n < 1.5


@pytest.mark.parametrize("argv, message", [
    ([*FACTORY, "--verify", "1", "--verify-extrapolate"],
     "--verify-extrapolate: compiles meshkit's transformer"),
    (["model.factory=no_such_module_here:make", "--devices", "8"],
     "model.factory: no module named 'no_such_module_here'"),
    (["--verify-extrapolate"], "--verify-extrapolate: needs --verify K"),
])
def test_bad_factory_plans_are_one_line(argv, message, user_dir, capsys) -> None:
    assert main(["plan", "--devices", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_the_library_needs_a_measuring_function_for_a_factory() -> None:
    config = load_config(None, [*FACTORY, *Layout().overrides()])
    with pytest.raises(PlanError, match=r"model\.factory: planned_gpt:make is planned by"):
        config_desc(config)
