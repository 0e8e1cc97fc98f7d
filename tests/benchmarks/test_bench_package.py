"""``meshkit bench NAME`` runs the benchmarks the package ships (issue 33).

The bug this guards against: ``meshkit bench`` ran ``benchmarks/bench_NAME.py`` from
beside the source tree, so an installed wheel listed ten benchmarks and ran none. Here
the package is copied alone (as a wheel installs it, no source tree around it) and a
benchmark runs from the copy; setuptools' package discovery, as ``pyproject.toml`` sets
it, must take the benchmarks into the wheel; and every listed name is a module of
:mod:`meshkit.benchmarks` with a ``--help`` and a ``--json FILE``.
"""

from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools

from meshkit.choices import BENCHMARKS
from meshkit.cli.main import _bench_command
from meshkit.cli.script import run

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_listed_is_a_module_of_the_package_and_no_other() -> None:
    files = importlib.resources.files("meshkit.benchmarks")
    shipped = sorted(p.name for p in files.iterdir() if p.name.startswith("bench_"))
    assert shipped == sorted(f"bench_{name}.py" for name in BENCHMARKS)


def test_the_wheel_takes_the_benchmarks_package() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    assert "meshkit.benchmarks" in setuptools.find_packages(str(ROOT), include=find["include"])
    assert (ROOT / "meshkit" / "benchmarks" / "__init__.py").is_file()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_cli_runs_the_module_with_a_help_and_a_json_flag(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    command = _bench_command(name, ["--help"])
    assert command[1:] == ["-m", f"meshkit.benchmarks.bench_{name}", "--help"]
    module = importlib.import_module(command[2])
    assert run(module.main, name, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: meshkit bench {name} ") and "--json FILE" in out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The package copied alone into a folder, and an environment that imports it."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(ROOT / "meshkit", site / "meshkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import meshkit; print(meshkit.__file__)"],
                           cwd=site, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).parent == site / "meshkit"
    return site, env


def test_a_benchmark_runs_from_the_package_alone_and_writes_its_report(
        installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    site, env = installed
    report = tmp_path / "groups.json"
    done = subprocess.run([sys.executable, "-m", "meshkit.cli", "bench", "groups", "--quick",
                           "--repeats", "1", "--json", str(report)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "vectorised queries" in done.stdout and done.stderr == f"wrote {report}\n"
    doc = json.loads(report.read_text())
    # Not a git checkout: no commit to name.
    assert (doc["benchmark"], doc["commit"], doc["dirty"]) == ("groups", None, None)
    assert len(doc["tables"][0]["rows"]) == 7
    # Every module of the copy resolves from it.
    code = ("import importlib.util, sys; from meshkit.choices import BENCHMARKS; "
            "print(sorted({importlib.util.find_spec(f'meshkit.benchmarks.bench_{n}').origin"
            ".rsplit('/', 2)[0] for n in BENCHMARKS}))")
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True)
    assert found.stdout.strip() == repr([str(site / "meshkit")])


def test_an_unknown_benchmark_is_a_usage_error() -> None:
    assert importlib.util.find_spec("meshkit.benchmarks.bench_nope") is None
    done = subprocess.run([sys.executable, "-m", "meshkit.cli", "bench", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr
