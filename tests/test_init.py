"""The package namespace: lazy public names, no JAX at import time."""

import ast
import importlib
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

import meshkit


def test_import_does_not_import_jax_or_flax():
    code = (
        "import sys, meshkit, meshkit.config\n"
        "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules)\n"
        "sys.exit(', '.join(heavy) or None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"import meshkit imported: {result.stderr.strip()}"


@pytest.mark.parametrize("name", meshkit.__all__)
def test_every_public_name_resolves(name):
    value = getattr(meshkit, name)
    module = meshkit._LAZY.get(name, "meshkit.strategy")
    assert value is getattr(importlib.import_module(module), name)
    assert name in vars(meshkit)  # cached: the next lookup skips __getattr__


def test_all_lists_strategy_and_every_lazy_name_once():
    assert meshkit.__all__[0] == "Strategy"
    assert sorted(meshkit.__all__) == sorted({"Strategy", *meshkit._LAZY})
    assert len(set(meshkit.__all__)) == len(meshkit.__all__)
    assert dir(meshkit) == sorted(meshkit.__all__)


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'meshkit' has no attribute 'nope'$"):
        meshkit.nope  # noqa: B018
    assert not hasattr(meshkit, "make_meshh")
    with pytest.raises(ImportError, match=r"cannot import name 'Trainer' from 'meshkit'"):
        from meshkit import Trainer  # noqa: F401


def test_type_checkers_see_every_lazy_name_from_its_module():
    """The ``if TYPE_CHECKING:`` imports name each lazy name once, from its ``_LAZY`` module."""
    tree = ast.parse(pathlib.Path(meshkit.__file__).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name: statement.module
             for statement in block.body if isinstance(statement, ast.ImportFrom)
             for alias in statement.names}
    assert typed == meshkit._LAZY


def test_mypy_sees_real_types(tmp_path):
    """``reveal_type(meshkit.MoE)`` is the class, not ``Any``."""
    from mypy import api
    script = tmp_path / "use.py"
    script.write_text(
        "import meshkit\nreveal_type(meshkit.MoE)\nreveal_type(meshkit.load_config)\n"
    )
    out, _, _ = api.run([str(script), "--no-incremental", "--cache-dir", str(tmp_path / "c"),
                         "--ignore-missing-imports", "--follow-imports=silent"])
    assert 'Revealed type is "def (' in out and "meshkit.model.moe.MoE" in out, out
    assert re.search(r"-> meshkit\.config\.[\w.]*Config\"", out), out


def test_version_is_the_installed_distributions():
    assert meshkit.__version__ == importlib.metadata.version("meshkit")
    cli = subprocess.run([sys.executable, "-m", "meshkit.cli", "--version"],
                         capture_output=True, text=True, check=True)
    assert cli.stdout.strip() == f"meshkit {meshkit.__version__}"


def test_train_is_the_function_and_its_modules_moved():
    assert callable(meshkit.train) and meshkit.train.__name__ == "train"
    with pytest.raises(ModuleNotFoundError, match=r"meshkit\.train's modules are "
                       r"meshkit\.training's since meshkit 0\.2"):
        importlib.import_module("meshkit.train.loop")
    assert callable(meshkit.train)  # the failed import bound no module over the function


@pytest.mark.parametrize("name", sorted(meshkit._MOVED))
def test_moved_names_warn_and_name_their_new_path(name):
    with pytest.warns(DeprecationWarning, match=rf"meshkit\.{name} moved to "
                      rf"meshkit\.exchange\.cost\.{name}"):
        value = getattr(meshkit, name)
    assert value is getattr(importlib.import_module("meshkit.exchange.cost"), name)
    assert name not in meshkit.__all__


@pytest.mark.parametrize(("old", "new"), [("meshkit.cost", "meshkit.exchange.cost"),
                                          ("meshkit.hlo", "meshkit.collectives")])
def test_moved_modules_warn_on_import(old, new):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"import {old}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 1 and f"{new}" in result.stderr, result.stderr
