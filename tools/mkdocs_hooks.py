"""mkdocs hooks: the pages generated from the code and from measured results.

Nothing here is written to disk; each page is made afresh at every build, so none can
go stale:

- ``reference/api/<Name>.md``: one page per public name (``meshkit.__all__``), rendered
  by mkdocstrings from the docstring, plus one for each public namespace module;
- ``reference/configuration.md``: every config key from the pydantic schema;
- ``reference/cli.md``: every command's ``--help``, as ``meshkit`` prints it;
- ``benchmarks/<name>.md``: each benchmark's JSON report (``docs/benchmarks/<name>.json``,
  written by ``meshkit bench NAME --json FILE``), stamped with its commit, date and
  machine; a report from another commit than the one being built says so.

A missing report or a public name without a docstring fails the build.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_console  # noqa: E402  (beside this file, which mkdocs loads by path)

API = "reference/api"
#: Public modules documented whole: (import path, page name, what it is).
NAMESPACES = (
    ("meshkit.exchange.cost", "exchange.cost",
     "the exchange's cost model: links, topologies, presets, predict and choose"),
    ("meshkit.distributed", "distributed", "starting several processes (jax.distributed)"),
)
#: Subpackage -> its heading on the API index, lowest layer first.
LAYERS = {
    "strategy": "Strategy, mesh and groups",
    "exchange": "Exchange",
    "sharding": "Sharding",
    "model": "Model building blocks",
    "data": "Data",
    "config": "Configuration",
    "plan": "Planning",
    "training": "Training",
    "errors": "Errors",
}


def _public_names() -> list[tuple[str, str]]:
    """``(name, defining module)`` of each public name, in ``__all__``'s order."""
    import meshkit

    return [(name, meshkit._LAZY.get(name, "meshkit.strategy")) for name in meshkit.__all__]


def _summary(obj: Any, where: str) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if not doc:
        raise PluginError(f"{where} has no docstring: every public name needs one")
    return doc.split("\n\n")[0].replace("\n", " ")


def _api_pages() -> dict[str, str]:
    pages: dict[str, str] = {}
    sections: dict[str, list[str]] = {heading: [] for heading in LAYERS.values()}
    for name, module in _public_names():
        obj = getattr(importlib.import_module(module), name)
        layer = module.split(".")[1]
        line = f"| [`meshkit.{name}`]({name}.md) | {_summary(obj, f'meshkit.{name}')} |"
        sections[LAYERS[layer]].append(line)
        pages[f"{API}/{name}.md"] = (
            f"# meshkit.{name}\n\n`from meshkit import {name}` (defined in `{module}`)\n\n"
            f"::: {module}.{name}\n    options:\n      show_root_heading: false\n")
    for module, page, what in NAMESPACES:
        pages[f"{API}/{page}.md"] = (
            f"# {module}\n\n{what[0].upper()}{what[1:]}.\n\n"
            f"::: {module}\n    options:\n      show_root_heading: false\n"
            f"      members_order: alphabetical\n")
    index = ["# API reference", "",
             "Every public name, importable as `meshkit.NAME` (one import path each), and "
             "the namespaces below. Generated from the docstrings.", ""]
    for heading, lines in sections.items():
        if lines:
            index += [f"## {heading}", "", "| name | what it is |", "|---|---|", *lines, ""]
    index += ["## Namespaces", "", "| module | what it is |", "|---|---|",
              *(f"| [`{module}`]({page}.md) | {what} |" for module, page, what in NAMESPACES)]
    pages[f"{API}/index.md"] = "\n".join(index) + "\n"
    return pages


def _configuration_page() -> str:
    from meshkit.config import format_reference
    from meshkit.config.sections import SECTIONS

    header, rule, *rows = format_reference().strip().splitlines()
    out = ["# Configuration reference", "",
           "Every key of a config file, its default and its meaning, generated from the "
           "schema that validates configs. `meshkit config [FILE] [key=value ...]` prints "
           "a resolved config; `meshkit config --schema` prints the JSON schema for "
           "editors.", ""]
    for section in SECTIONS:
        mine = [row for row in rows if row.startswith(f"| `{section}.")]
        out += [f"## `{section}`", "", header, rule, *mine, ""]
    return "\n".join(out)


def _help(args: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "meshkit.cli", *args, "--help"], env=env,
                          capture_output=True, text=True, check=True).stdout


def _cli_page() -> str:
    from meshkit.cli.main import commands

    out = ["# Command-line reference", "",
           "Each command's `--help`, as `meshkit` prints it (generated at every build).", "",
           "```text", "$ meshkit --help", _help([]).rstrip(), "```", ""]
    for command in commands():
        out += [f"## `meshkit {command}`", "", "```text", f"$ meshkit {command} --help",
                _help([command]).rstrip(), "```", ""]
    return "\n".join(out)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _benchmark_description(name: str) -> str:
    """The first paragraph of the benchmark module's docstring (read, not imported)."""
    spec = importlib.util.find_spec(f"meshkit.benchmarks.bench_{name}")
    assert spec is not None and spec.origin is not None, name
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


#: A target's ``met``: met, missed, or only reported (no limit applies to this run).
_MET = {True: "yes", False: "**no**", None: "report only"}


def _benchmark_page(name: str, report: dict[str, Any], head: str | None) -> str:
    commit = report.get("commit") or "an unknown commit"
    m = report["machine"]
    machine = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
               f"{m.get('memory_gib', '?')} GiB; {m.get('system', '?')}; Python "
               f"{m.get('python', '?')}, JAX {m.get('jax', '?')} on {m.get('devices', '?')} "
               f"{m.get('backend', '?')} devices")
    out = [f"# `meshkit bench {name}`", "", _benchmark_description(name), "",
           "| | |", "|---|---|", f"| command | `{report['command']}` |",
           f"| commit | `{commit}`{' (uncommitted changes)' if report.get('dirty') else ''} |",
           f"| date | {report['date']} |", f"| machine | {machine} |",
           f"| wall time | {report['wall_s']:.0f} s |", ""]
    if head and report.get("commit") and not head.startswith(report["commit"]):
        out += ['!!! note "Figures from an older commit"',
                f"    These figures were measured at `{commit}`; these docs were built at "
                f"`{head[:len(report['commit'])]}`. Run the command above to measure again.",
                ""]
    for table in report["tables"]:
        out += [f"## {table['title']}", "", *_table(table["columns"], table["rows"]), ""]
        out += [f"- {note}" for note in table.get("notes", [])]
        out += [""] if table.get("notes") else []
    if report.get("targets"):
        out += ["## Targets", "", *_table(
            ["target", "measured", "limit", "met"],
            [[t["name"], t["measured"], t["limit"], _MET[t["met"]]]
             for t in report["targets"]]), ""]
    return "\n".join(out)


def _benchmark_pages() -> dict[str, str]:
    from meshkit.choices import BENCHMARKS

    head = _git("rev-parse", "HEAD")
    pages, index = {}, ["# Benchmarks", "",
                        "Each page is one run of `meshkit bench NAME --json FILE`, rendered "
                        "from its report in `docs/benchmarks/NAME.json` and stamped with the "
                        "commit, date and machine it ran on. Speed is reported as ratios "
                        "against a baseline measured in the same run.", "",
                        "| benchmark | what it measures | commit | date |", "|---|---|---|---|"]
    for name in BENCHMARKS:
        path = ROOT / "docs" / "benchmarks" / f"{name}.json"
        if not path.exists():
            raise PluginError(f"no report for benchmark {name!r}: run `meshkit bench {name} "
                              f"--json docs/benchmarks/{name}.json`")
        report = json.loads(path.read_text())
        pages[f"benchmarks/{name}.md"] = _benchmark_page(name, report, head)
        index.append(f"| [{name}]({name}.md) | {_benchmark_description(name)} | "
                     f"`{report.get('commit')}` | {report['date'][:10]} |")
    pages["benchmarks/index.md"] = "\n".join(index) + "\n"
    return pages


def _generated() -> dict[str, str]:
    return {**_api_pages(), "reference/configuration.md": _configuration_page(),
            "reference/cli.md": _cli_page(), **_benchmark_pages()}


_PAGES: dict[str, str] = {}
#: The docstrings' Sphinx roles (``:func:`x```), which markdown shows as text before the code.
_ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj):(?=<code>)")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Make the pages, and list the API and benchmark pages in the navigation."""
    _PAGES.clear()
    _PAGES.update(_generated())

    def expand(entries: list[Any]) -> list[Any]:
        out = []
        for entry in entries:
            if isinstance(entry, dict):
                (title, value), = entry.items()
                if value == f"{API}/index.md":
                    value = [value, *sorted(p for p in _PAGES if p.startswith(f"{API}/")
                                            and not p.endswith("index.md"))]
                elif value == "benchmarks/index.md":
                    value = [value, *(p for p in _PAGES if p.startswith("benchmarks/")
                                      and not p.endswith("index.md"))]
                elif isinstance(value, list):
                    value = expand(value)
                entry = {title: value}
            out.append(entry)
        return out

    config["nav"] = expand(config["nav"])
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages (and keep the reports' JSON out of the site)."""
    for src, content in _PAGES.items():
        files.append(File.generated(config, src, content=content))
    for file in [f for f in files if f.src_uri.startswith("benchmarks/")
                 and f.src_uri.endswith(".json")]:
        files.remove(file)
    return files


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Under each console block that shows volatile numbers, say which they are."""
    def note(match: re.Match[str]) -> str:
        if match["lang"] != "console" or not docs_console.VOLATILE.search(match["body"]):
            return match[0]
        before = markdown[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        how = ("regenerated by tools/docs_console.py --write" if before == docs_console.SLOW_MARK
               else "checked by the tests")
        return (f"{match[0]}\n\n{match['indent']}<small>Times and rates in this output vary "
                f"from run to run; the rest is what the command prints ({how}).</small>\n")
    return docs_console.FENCE.sub(note, markdown)


def on_page_content(html: str, **kwargs: Any) -> str:
    """Drop the Sphinx roles and ``~`` prefixes that the docstrings' markup leaves."""
    return _ROLE.sub("", html).replace("<code>~", "<code>")
