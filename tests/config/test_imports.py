"""A config is code: only the commands that train or plan a model import
``model.factory`` / ``model.loss``, they say so first, and only functions written for
meshkit (``rngs``; ``model, batch``) are called."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshkit.cli import main
from meshkit.config import ConfigError, load_config

NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]

# A module that leaves a mark when it is imported: a downloaded .py in the current folder.
EVIL = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("imported")

def make(rngs):
    raise AssertionError("called")
"""


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """``evilmod.py`` in the current directory, which meshkit commands can import from."""
    (tmp_path / "evilmod.py").write_text(EVIL)
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "IMPORTED"
    sys.modules.pop("evilmod", None)


@pytest.mark.parametrize("argv", [
    ["config", "model.factory=evilmod:make", "model.loss=evilmod:make"],
    ["mesh", "model.factory=evilmod:make", "model.loss=evilmod:make"],
    ["plan", "--devices", "8", "--top", "1", "model.loss=evilmod:make"],
], ids=["config", "mesh", "plan"])
def test_commands_that_train_nothing_import_nothing(argv, evil, capsys):
    assert main(argv) == 0, capsys.readouterr().err
    assert not evil.exists()
    assert "importing" not in capsys.readouterr().err


def test_plan_imports_the_factory_it_plans_and_says_so_first(evil, capsys):
    # Planning a factory's model measures it: the config asked for the import.
    assert main(["plan", "--devices", "8", "model.factory=evilmod:make"]) == 2
    err = capsys.readouterr().err
    assert evil.exists()
    assert err.index("importing model.factory evilmod:make from ./evilmod.py") < err.index(
        "error: model.factory: evilmod:make raised AssertionError: called")


def test_a_config_file_from_elsewhere_is_shown_without_running_it(evil, capsys):
    (evil.parent / "shared.yaml").write_text("model:\n  factory: evilmod:make\n")
    assert main(["config", "shared.yaml"]) == 0
    assert "factory: evilmod:make" in capsys.readouterr().out and not evil.exists()


ATTACKS = [
    # A YAML file alone, with only the standard library: each would run the kwargs.
    ("model.factory=timeit:timeit", "model.factory_kwargs={setup: \"open('PWNED','w')\"}"),
    ("model.factory=os:system", "model.factory_kwargs={command: 'touch PWNED'}"),
    ("model.factory=builtins:eval", "model.factory_kwargs={}"),
    ("model.factory=builtins:exec", "model.factory_kwargs={}"),
    ("model.factory=subprocess:run", "model.factory_kwargs={args: [touch, PWNED]}"),
    ("model.loss=builtins:eval", "model.factory_kwargs={}"),
    ("model.loss=os:system", "model.factory_kwargs={}"),
]


@pytest.mark.parametrize(("path", "kwargs"), ATTACKS, ids=[a for a, _ in ATTACKS])
def test_a_config_cannot_call_a_library_function(path, kwargs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if path.startswith("model.loss"):
        kwargs = "model.factory=_user_gpt:make"
    argv = ["train", "mesh.axes={dp: 1}", *NO_EXPERTS, path, kwargs, "train.steps=1",
            f"train.workdir={tmp_path / 'run'}", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    key = path.partition("=")[0]
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"meshkit train: error: {key}: "), err
    assert "has no parameter named" in errors[0] or "no signature" in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "run").exists()


def test_a_command_that_imports_says_which_file_first(tmp_path, monkeypatch, capsys):
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "gpt.py").write_text("def make(width):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["train", "mesh.axes={dp: 1}", *NO_EXPERTS, "model.factory=userpkg.gpt:make",
                     f"train.workdir={tmp_path / 'run'}"]) == 2
    finally:
        for name in ("userpkg", "userpkg.gpt"):
            sys.modules.pop(name, None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("meshkit train: importing model.factory userpkg.gpt:make from "
                        "./userpkg/gpt.py")
    assert lines[1].startswith("meshkit train: error: model.factory: userpkg.gpt:make has no "
                               "parameter named 'rngs': meshkit calls it as make(rngs=...)")


REFUSED = [
    (["model.factory=nomodule_for_meshkit_tests:make"], "factory", "model.factory",
     "no module named 'nomodule_for_meshkit_tests' (from "),
    (["model.factory=math:nothing"], "factory", "model.factory",
     "module 'math' has no attribute 'nothing'"),
    (["model.factory=math:pi"], "factory", "model.factory",
     "math:pi is a float, not a function or class"),
    (["model.factory=operator:add"], "factory", "model.factory",
     "operator:add has no parameter named 'rngs'"),
    (["model.factory=builtins:dict"], "factory", "model.factory",
     "builtins:dict has no parameter named 'rngs'"),
    (["model.factory=math:hypot"], "factory", "model.factory",
     "math:hypot has no signature Python can read, so meshkit cannot check that it takes "
     "rngs=..."),
    (["model.factory=_user_gpt:make", "model.factory_kwargs={rngs: 1}"], "factory",
     "model.factory_kwargs", "'rngs' is meshkit's to pass"),
    (["model.factory=_user_gpt:Block", "model.factory_kwargs={width: 8}"], "factory",
     "model.factory_kwargs", "_user_gpt:Block cannot be called as Block(rngs=..., width=8): "
     "missing a required argument: 'heads'"),
    (["model.loss=math:sqrt"], "loss", "model.loss", "math:sqrt has no parameter named 'model'"),
    (["model.loss=_user_gpt:make"], "loss", "model.loss",
     "_user_gpt:make has no parameter named 'model'"),
]


@pytest.mark.parametrize(("overrides", "which", "key", "detail"), REFUSED,
                         ids=[" ".join(o) for o, *_ in REFUSED])
def test_an_import_path_is_checked_when_used(overrides, which, key, detail):
    config = load_config(None, overrides)  # building the config imports nothing
    with pytest.raises(ConfigError) as info:
        getattr(config.model, f"{which}_function")()
    assert str(info.value).startswith(f"{key}: {detail}"), str(info.value)


def test_a_class_written_for_meshkit_is_a_factory():
    """An ``nnx.Module`` class: its ``__init__``'s ``rngs`` counts, not the metaclass's
    ``(*args, **kwargs)``."""
    config = load_config(None, ["model.factory=_user_gpt:UserGPT",
                                "model.factory_kwargs={width: 8, layers: 1}",
                                "model.loss=_user_gpt:loss"])
    import _user_gpt
    from flax import nnx

    model = config.model.factory_function()(nnx.Rngs(0))
    assert isinstance(model, _user_gpt.UserGPT)
    assert config.model.loss_function() is not None


def test_no_import_happens_twice_or_unannounced(tmp_path, monkeypatch, caplog):
    (tmp_path / "quietmod.py").write_text("def make(rngs):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["model.factory=quietmod:make"])
    try:
        with caplog.at_level("INFO", logger="meshkit"):
            config.model.factory_function()
            config.model.factory_function()
    finally:
        sys.modules.pop("quietmod", None)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"meshkit: importing model.factory quietmod:make from "
                    f"{Path(tmp_path, 'quietmod.py')}"]
