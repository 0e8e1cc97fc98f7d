"""Only the command line prints: library modules log or return values (docstrings aside).

The command line is ``meshkit/cli`` and the benchmarks (``meshkit/benchmarks``), which
``meshkit bench NAME`` runs as programs of their own.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "meshkit"


def _prints(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that call ``print`` (examples in docstrings are strings, not calls)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print"]


COMMAND_LINE = ("cli", "benchmarks")


def test_no_module_outside_cli_prints():
    found = {str(p.relative_to(PACKAGE.parent)): lines
             for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] not in COMMAND_LINE and (lines := _prints(p))}
    assert found == {}, f"print( outside meshkit/cli (log, or return the text): {found}"


def test_the_scan_finds_a_print_and_skips_docstrings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Example:\n\n    >>> print(1)\n"""\n\n\ndef f():\n    print("x")\n')
    assert _prints(path) == [8]
