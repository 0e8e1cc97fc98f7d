"""The JSON report of a benchmark: ``meshkit bench NAME --json FILE`` (``-``: stdout).

Every benchmark writes the same envelope, whatever it measures::

    {"benchmark": "groups", "command": "meshkit bench groups --repeats 1",
     "commit": "837dadf", "dirty": false, "version": "0.2.0",
     "date": "2026-12-04T23:10:00Z",
     "machine": {"system": "Linux x86_64", "cpu": "...", "cores": 2, "memory_gib": 23.4,
                 "python": "3.11.7", "jax": "0.10.0", "backend": "cpu", "devices": 8},
     "wall_s": 12.3,
     "tables": [{"title": "...", "columns": [...], "rows": [[...]], "notes": [...]}],
     "targets": [{"name": "...", "measured": 0.48, "limit": "<= 0.5", "met": true}]}

and, where a benchmark has more than its tables hold (every row's raw fields), a
``data`` object of its own. The tables hold the rows the benchmark prints, as numbers in
the columns' units; ``targets`` the goals it checks (``met`` is ``null`` where the limit
is only reported, or a row was not measured). ``commit`` and ``dirty`` come from git
when meshkit runs from a git checkout (``dirty``: ``git status --porcelain`` shows a
change outside ``docs/benchmarks/``, where the reports themselves go), else ``null``.
Non-finite numbers are written as ``null`` (JSON has no NaN).

A benchmark adds the flag with :func:`add_json_flag` (the path is checked when the
arguments are parsed, before anything is measured), then::

    report = Report("groups", argv, args.json)
    with report.printing():  # with --json -, the human-readable text goes to stderr
        table = report.table("...", ["axes", "ms"])
        table.add("dp", 1.5)
        print(...)
    report.write()

Example:
    >>> report = Report("groups", ["--quick"], None, devices=False)
    >>> report.table("t", ["a", "b"]).add("x", float("nan"))
    >>> report.target("ratio", 0.48, "<= 0.5").met
    True
    >>> doc = report.to_dict()
    >>> doc["command"], doc["tables"][0]["rows"], doc["machine"]["devices"]
    ('meshkit bench groups --quick', [['x', None]], None)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from meshkit._fs import cannot_write, write_file
from meshkit._version import __version__
from meshkit.cli.script import prog

__all__ = ["Report", "Table", "Target", "add_json_flag", "dumps", "json_file", "machine",
           "met", "source_commit"]

#: A table cell: text or a number in the column's unit (``None``: not measured).
Cell = str | int | float | bool | None

#: Where meshkit's source tree would be (the folder holding ``meshkit/``).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: Changes here do not make a run dirty: the reports themselves are written there.
REPORTS_DIR = "docs/benchmarks"
_GIT_TIMEOUT_S = 30


@dataclasses.dataclass
class Table:
    """One table of a report: its title, column names, rows and notes."""

    title: str
    columns: list[str]
    rows: list[list[Cell]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, *cells: Cell) -> None:
        """Append a row (one cell per column).

        Raises:
            ValueError: the row has not one cell per column.
        """
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: a row of {len(cells)} cells, "
                             f"{len(self.columns)} columns {self.columns}")
        self.rows.append(list(cells))


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal a benchmark checks: the measured figure, the limit as text, and whether it
    was met (``None``: only reported, or not measured)."""

    name: str
    measured: float | None
    limit: str
    met: bool | None


_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_COMPARE = re.compile(rf"^\s*(<=|>=|<|>|≤|≥)\s*{_NUMBER}")
_WITHIN = re.compile(rf"^\s*within\s+{_NUMBER}\s*±\s*{_NUMBER}")


def met(measured: float | None, limit: str) -> bool | None:
    """Whether ``measured`` meets ``limit`` (``<= X``, ``>= X``, ``< X``, ``> X`` or
    ``within C ± D``, read from the limit's start), ``None`` when nothing was measured or
    the limit is none of these (a figure only reported).

    Example:
        >>> met(0.48, "<= 0.5"), met(1.2, "within 1 ± 0.1"), met(3.0, "(report)")
        (True, False, None)
    """
    if measured is None or not math.isfinite(measured):
        return None
    if m := _COMPARE.match(limit):
        op, bound = m.group(1), float(m.group(2))
        return {"<=": measured <= bound, "≤": measured <= bound, ">=": measured >= bound,
                "≥": measured >= bound, "<": measured < bound, ">": measured > bound}[op]
    if m := _WITHIN.match(limit):
        return abs(measured - float(m.group(1))) <= float(m.group(2))
    return None


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: Path = SOURCE_ROOT) -> tuple[str | None, bool | None]:
    """The short commit of the git checkout meshkit runs from, and whether it has changes
    outside :data:`REPORTS_DIR`; ``(None, None)`` when ``root`` is not a checkout's top
    (an installed package, even one inside some other repository's folder).

    Args:
        root: the folder holding the ``meshkit`` package.

    Returns:
        ``(commit, dirty)``.

    Example:
        >>> import tempfile
        >>> source_commit(Path(tempfile.gettempdir()))
        (None, None)
    """
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None, None
    commit = _git(root, "rev-parse", "--short", "HEAD")
    status = _git(root, "status", "--porcelain", "--", ".", f":(exclude){REPORTS_DIR}")
    return commit, None if status is None else status != ""


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _jax_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(*, devices: bool = True) -> dict[str, Any]:
    """This machine: system, CPU model, cores this process may use, memory, Python, JAX,
    and (``devices``) JAX's default backend and device count as this process sees them.

    Args:
        devices: ask JAX for its backend and devices (``False`` where this process does
            not run the measured programs itself: both ``None``).

    Returns:
        The report's ``machine`` object.
    """
    backend = count = None
    if devices:
        import jax

        backend, count = jax.default_backend(), jax.device_count()
    affinity = getattr(os, "sched_getaffinity", None)
    return {"system": f"{platform.system()} {platform.machine()}", "cpu": _cpu_model(),
            "cores": len(affinity(0)) if affinity else os.cpu_count(),
            "memory_gib": _memory_gib(), "python": platform.python_version(),
            "jax": _jax_version(), "backend": backend, "devices": count}


def json_file(text: str) -> str:
    """An argparse ``type`` for ``--json FILE``: ``-``, or a file that can be written.

    Raises:
        argparse.ArgumentTypeError: the file cannot be written (argparse names the flag).

    Example:
        >>> json_file("-")
        '-'
    """
    if text != "-":
        problem = cannot_write(text)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {problem}")
    return text


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--json FILE`` (the report; ``-``: stdout) to a benchmark's parser."""
    parser.add_argument("--json", metavar="FILE", type=json_file, default=None,
                        help="also write the report as JSON (tables, targets, commit, "
                        "machine) to FILE; '-': to stdout, the tables' text to stderr")


#: Significant digits a float keeps in the report (timings are noisier than that).
DIGITS = 6


def _finite(value: Any) -> Any:
    """``value`` with floats to :data:`DIGITS` significant digits, every non-finite one
    replaced by ``None``, tuples as lists."""
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(value: Any, indent: str = "") -> str:
    """JSON, indented by one space a level, with every list of plain values (a table's
    row, its columns) on one line.

    Example:
        >>> print(dumps({"rows": [[1, "a"], [2, None]], "n": {}}))
        {
         "rows": [
          [1, "a"],
          [2, null]
         ],
         "n": {}
        }
    """
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {dumps(v, inner)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return ("[\n" + ",\n".join(inner + dumps(v, inner) for v in value)
                + f"\n{indent}]")
    return json.dumps(value, ensure_ascii=False)


class Report:
    """A benchmark's report, filled as it runs and written at the end (module docstring).

    Args:
        benchmark: the benchmark's name (``groups``).
        argv: its arguments (``None``: ``sys.argv[1:]``), for the ``command`` field.
        path: ``--json``'s value: a file, ``-`` (stdout) or ``None`` (write nothing).
        devices: whether this process runs the measured programs (the ``machine``'s
            backend and devices are asked of JAX at the end).
    """

    def __init__(self, benchmark: str, argv: Sequence[str] | None, path: str | None, *,
                 devices: bool = True) -> None:
        self.benchmark = benchmark
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.path = path
        self.devices = devices
        self.tables: list[Table] = []
        self.targets: list[Target] = []
        #: The benchmark's own fields beyond the tables (written as ``data`` if any).
        self.data: dict[str, Any] = {}
        self._date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._start = time.perf_counter()

    def table(self, title: str, columns: Sequence[str], *,
              notes: Sequence[str] = ()) -> Table:
        """A new table, in the report's order; fill it with :meth:`Table.add`."""
        table = Table(title, list(columns), notes=list(notes))
        self.tables.append(table)
        return table

    def target(self, name: str, measured: float | None, limit: str,
               is_met: bool | None = None) -> Target:
        """Record a target; ``is_met`` defaults to :func:`met` of the limit's text."""
        target = Target(name, measured, limit,
                        met(measured, limit) if is_met is None else is_met)
        self.targets.append(target)
        return target

    @contextlib.contextmanager
    def printing(self) -> Iterator[None]:
        """The benchmark's printing: to stderr while the report goes to stdout."""
        if self.path != "-":
            yield
            return
        with contextlib.redirect_stdout(sys.stderr):
            yield

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON object (module docstring)."""
        commit, dirty = source_commit()
        doc: dict[str, Any] = {
            "benchmark": self.benchmark,
            "command": shlex.join([*prog(self.benchmark).split(), *self.argv]),
            "commit": commit, "dirty": dirty, "version": __version__, "date": self._date,
            "machine": machine(devices=self.devices),
            "wall_s": round(time.perf_counter() - self._start, 1),
            "tables": [dataclasses.asdict(t) for t in self.tables],
            "targets": [dataclasses.asdict(t) for t in self.targets],
        }
        if self.data:
            doc["data"] = self.data
        return _finite(doc)

    def write(self) -> None:
        """Write the report to its path (nothing without one); say where on stderr."""
        if self.path is None:
            return
        text = dumps(self.to_dict()) + "\n"
        if self.path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        write_file(self.path, text, flag="--json")
        sys.stderr.write(f"wrote {self.path}\n")
