"""Whatever a user's factory, model or loss does wrong is the user's error: one line,
exit 2, naming ``model.factory`` / ``model.loss`` (or the Python argument) and the user's
own exception; ``--debug`` adds the traceback, and only meshkit's own bugs say "bug"."""

from __future__ import annotations

import sys

import pytest
from flax import nnx

from meshkit.cli import main
from meshkit.config import load_config
from meshkit.errors import UserCodeError
from meshkit.training import train

MODULE = '''
import jax.numpy as jnp
from flax import nnx
from _user_gpt import loss as good_loss, make as make_gpt

def make(rngs):
    return make_gpt(rngs, vocab=16, width=8, heads=2, layers=1)

def raises(rngs):
    raise ValueError("width must be even")

def returns_none(rngs):
    return None

def returns_dict(rngs):
    return {"w": 1}

def no_parameters(rngs):
    return nnx.Dropout(0.1)

class IntWeights(nnx.Module):
    def __init__(self, rngs):
        self.table = nnx.Param(jnp.zeros((16, 16), jnp.int32))
    def __call__(self, tokens):
        return self.table[...][tokens].astype(jnp.float32)

def int_parameters(rngs):
    return IntWeights(rngs)

class LastTokenOnly(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(1, 16, rngs=rngs)
    def __call__(self, tokens):
        return self.out(tokens[:, -1:].astype(jnp.float32))

def wrong_output(rngs):
    return LastTokenOnly(rngs)

def logits(model, batch):
    return model(batch[:, :-1])

def loss_vector(model, batch):
    return logits(model, batch).mean(axis=(1, 2))

def loss_triple(model, batch):
    return logits(model, batch).mean(), {}, 1

def loss_python_int(model, batch):
    return 3

def loss_int_array(model, batch):
    return batch.sum()

def loss_raises(model, batch):
    raise RuntimeError("my loss is not ready")

def loss_metric_named_loss(model, batch):
    value = logits(model, batch).mean()
    return value, {"loss": value}

def loss_string(model, batch):
    return "low"

def loss_python_float(model, batch):
    return 1.5
'''

CASES = [
    ("model.factory=usererr:raises", "model.factory: usererr:raises raised ValueError: width "
     "must be even"),
    ("model.factory=usererr:returns_none", "model.factory: usererr:returns_none returned None, "
     "not an nnx.Module"),
    ("model.factory=usererr:returns_dict", "model.factory: usererr:returns_dict returned a dict, "
     "not an nnx.Module"),
    ("model.factory=usererr:no_parameters", "model.factory: usererr:no_parameters returned a "
     "model with no parameters (nnx.Param) to train"),
    ("model.factory=usererr:int_parameters", "model.factory: usererr:int_parameters returned a "
     "model whose parameter table is int32: a parameter must be floating point"),
    ("model.factory=usererr:wrong_output", "model.factory: usererr:wrong_output's model raised "
     "ValueError: the model's output has shape (8, 16); the next-token loss needs logits "
     "[batch, seq, vocab >= 16] = [8, 4, 16]"),
    ("model.loss=usererr:loss_vector", "model.loss: usererr:loss_vector returned a loss of "
     "shape (8,): the loss must be a scalar"),
    ("model.loss=usererr:loss_triple", "model.loss: usererr:loss_triple returned a tuple of 3"),
    ("model.loss=usererr:loss_python_int", "model.loss: usererr:loss_python_int returned the "
     "constant 3 (an int), not a JAX array computed from the model"),
    ("model.loss=usererr:loss_int_array", "model.loss: usererr:loss_int_array returned a loss "
     "of dtype int32: the loss must be floating point"),
    ("model.loss=usererr:loss_raises", "model.loss: usererr:loss_raises raised RuntimeError: "
     "my loss is not ready"),
    ("model.loss=usererr:loss_metric_named_loss", "model.loss: usererr:loss_metric_named_loss "
     "returned a metric named 'loss'"),
    ("model.loss=usererr:loss_string", "model.loss: usererr:loss_string returned a str, not a "
     "JAX array"),
    ("model.loss=usererr:loss_python_float", "model.loss: usererr:loss_python_float returned the "
     "constant 1.5 (a float), not a JAX array computed from the model: its gradient would be 0"),
]

RUN = ["mesh.axes={dp: 1}", "exchange.node_axis=[]", "exchange.device_axis=[]",
       "train.batch_size=8", "train.seq_len=4", "train.steps=1", "--no-progress",
       "parallel.logical_axes={width: fsdp, nheads: tensor, ffn: tensor, vocab_rows: tensor}"]


@pytest.fixture
def usererr(tmp_path, monkeypatch):
    (tmp_path / "usererr.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MESHKIT_DEBUG", raising=False)
    yield
    sys.modules.pop("usererr", None)


@pytest.mark.parametrize(("item", "message"), CASES, ids=[c.split(":")[1] for c, _ in CASES])
def test_a_users_mistake_is_one_line_exit_2_naming_it(item, message, usererr, tmp_path,
                                                     capsys):
    factory = [] if item.startswith("model.factory") else ["model.factory=usererr:make"]
    argv = ["train", *RUN, *factory, item, f"train.workdir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith(
        ("meshkit train: importing ", "meshkit train: starting;"))]
    assert len(errors) == 1 and "Traceback" not in err and "a bug" not in err, err
    assert errors[0].startswith(f"meshkit train: error: {message}"), err


def test_debug_shows_the_users_traceback(usererr, tmp_path, capsys, monkeypatch):
    argv = ["train", *RUN, "model.factory=usererr:raises", f"train.workdir={tmp_path}"]
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "meshkit train: error: model.factory: usererr:raises raised ValueError" in err
    assert "Traceback" in err and 'raise ValueError("width must be even")' in err
    assert "a bug" not in err
    monkeypatch.setenv("MESHKIT_DEBUG", "1")
    assert main(argv) == 2 and "Traceback" in capsys.readouterr().err


def test_python_arguments_are_named_as_passed(tmp_path):
    config = load_config(None, [*RUN[:-2], RUN[-1], f"train.workdir={tmp_path}"])

    def my_factory(rngs):
        raise KeyError("d_model")

    with pytest.raises(UserCodeError, match=r"^model=test_python_arguments_are_named_as_passed"
                       r"\.<locals>\.my_factory raised KeyError: 'd_model'"):
        train(config, model=my_factory, verbose=False, progress=False)

    def float_loss(model, batch):
        return 1.5

    with pytest.raises(UserCodeError, match=r"^loss=.*float_loss returned the constant 1\.5"):
        train(config, model=lambda rngs: nnx.Embed(16, 16, rngs=rngs), loss=float_loss,
              verbose=False, progress=False)
