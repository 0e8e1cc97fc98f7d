"""The docs' code blocks: find them, run them, and check or regenerate what they show.

Markdown fences in ``README.md`` and ``docs/**/*.md``:

- ```` ```python ````: runs in the tests (``tests/test_docs.py``), each block in a fresh
  working directory. With ``title="NAME"`` it is also written to ``NAME`` in the page's
  working directory, as is a ```` ```yaml title="NAME" ```` block.
- ```` ```console ````: ``$ COMMAND`` lines, each followed by what it prints (stdout and
  stderr together). A line ``...`` alone stands for any number of lines. Numbers that
  vary from run to run (:data:`VOLATILE`: times, rates) are masked on both sides before
  comparing. A command may fail (to show an error) only where its output is shown; one
  shown without output must exit 0. The blocks of one page run in order in one working
  directory, after the page's titled files are written; ``configs/`` is the repository's.
- A console block right after a ``<!-- slow -->`` line (training, benchmarks,
  compiling a plan) is regenerated here but not run by the tests.

Usage::

    python tools/docs_console.py --check [FILE ...]       # compare; exit 1 on a difference
    python tools/docs_console.py --write [FILE ...]       # regenerate the shown output
    python tools/docs_console.py --write --skip-slow [FILE ...]  # the tests' blocks only
    python tools/docs_console.py --check --slow docs/guides/training.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Numbers followed by one of these units are masked before comparing: they vary from
#: run to run on one machine.
VOLATILE_UNITS = (r"tokens/s", r"[kMGT]?FLOP/s", r"[kMG]i?B/s", r"ms", r"µs", r"us", r"s",
                  r"min", r"it/s", r"steps/s")
VOLATILE = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?=\s?(?:model |XLA )?(?:"
                      + "|".join(VOLATILE_UNITS) + r")(?!\w))")
#: The only commands a ``<!-- slow -->`` block may run.
SLOW_COMMANDS = ("meshkit train", "meshkit bench", "meshkit launch", "meshkit calibrate",
                 "meshkit plan --model", "meshkit plot")
SLOW_MARK = "<!-- slow -->"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)"
                   r"^(?P=indent)```[ \t]*$", re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    title: str | None
    body: str  # dedented, ends with a newline
    slow: bool
    span: tuple[int, int]  # the body's character span in the page (indented)
    indent: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        indent = match["indent"]
        body = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in match["body"].splitlines(keepends=True))
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        title = TITLE.search(match["attrs"])
        out.append(Block(page=page, line=text.count("\n", 0, match.start()) + 1,
                         lang=match["lang"], title=title[1] if title else None, body=body,
                         slow=before == SLOW_MARK, span=match.span("body"), indent=indent))
    return out


@dataclasses.dataclass
class Command:
    """A ``$`` line of a console block and the output shown under it."""

    line: str
    shown: list[str]


def commands(block: Block) -> list[Command]:
    """The console block's commands, each with its shown output lines."""
    out: list[Command] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            out.append(Command(line[2:], []))
        elif out:
            out[-1].shown.append(line)
        elif line.strip():
            raise ValueError(f"{block.where}: a console block starts with a `$ ` command")
    return out


def mask(text: str) -> str:
    """``text`` with its volatile numbers replaced by ``#``."""
    return VOLATILE.sub("#", text)


def matches(shown: list[str], printed: str) -> bool:
    """Whether the printed output is what the block shows, volatile numbers aside."""
    pattern = []
    for line in shown:
        pattern.append(r"(?:[^\n]*\n)*?" if line.strip() == "..." else
                       re.escape(mask(line.rstrip())) + r"[ \t]*\n")
    printed = "\n".join(mask(line.rstrip()) for line in printed.splitlines())
    return re.fullmatch("".join(pattern), printed + "\n" if printed else "") is not None


def workdir(page: Path, into: Path) -> Path:
    """A working directory for ``page``'s blocks: ``configs/`` and its titled files."""
    (into / "configs").symlink_to(ROOT / "configs")
    for block in blocks(page):
        if block.title:
            (into / block.title).parent.mkdir(parents=True, exist_ok=True)
            (into / block.title).write_text(block.body)
    return into


def run(command: str, cwd: Path) -> tuple[int, str]:
    """Run one shown command as a user would, in ``cwd``: exit code and output."""
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "COLUMNS": "100", "PATH": bindir + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, timeout=1800, check=False)
    return done.returncode, done.stdout


def console_blocks(page: Path, *, slow: bool) -> Iterator[Block]:
    for block in blocks(page):
        if block.lang == "console" and (slow or not block.slow):
            yield block


def check(page: Path, *, slow: bool = False) -> list[str]:
    """Run ``page``'s console blocks; return one message per command that differs."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="meshkit-docs-") as tmp:
        cwd = workdir(page, Path(tmp))
        for block in console_blocks(page, slow=slow):
            for command in commands(block):
                code, printed = run(command.line, cwd)
                if code != 0 and not command.shown:
                    problems.append(f"{block.where}: `{command.line}` exited {code}:\n{printed}")
                elif not matches(command.shown, printed):
                    problems.append(f"{block.where}: `{command.line}` printed:\n{printed}"
                                    f"but the page shows:\n" + "\n".join(command.shown))
    return problems


def write(page: Path, *, slow: bool = True) -> list[str]:
    """Regenerate the output of ``page``'s console blocks in place (slow ones too, unless
    ``slow`` is false).

    A block that elides lines with ``...`` is checked, not rewritten.
    """
    problems, text = [], page.read_text()
    edits = []
    with tempfile.TemporaryDirectory(prefix="meshkit-docs-") as tmp:
        cwd = workdir(page, Path(tmp))
        for block in console_blocks(page, slow=slow):
            lines, elided = [], False
            for command in commands(block):
                code, printed = run(command.line, cwd)
                if code != 0 and not printed:
                    problems.append(f"{block.where}: `{command.line}` exited {code}, silently")
                elided |= any(line.strip() == "..." for line in command.shown)
                if elided and not matches(command.shown, printed):
                    problems.append(f"{block.where}: `{command.line}` differs (the block "
                                    f"elides lines: edit it by hand):\n{printed}")
                lines += [f"$ {command.line}", *printed.rstrip("\n").splitlines()]
            if not elided:
                body = "".join(f"{block.indent}{line}".rstrip() + "\n" for line in lines)
                edits.append((block.span, body))
    for (start, end), body in reversed(edits):
        text = text[:start] + body + text[end:]
    page.write_text(text)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare; exit 1 on a difference")
    mode.add_argument("--write", action="store_true", help="regenerate the shown output")
    parser.add_argument("--slow", action="store_true", help="--check the slow blocks too")
    parser.add_argument("--skip-slow", action="store_true",
                        help="--write the blocks the tests run, not the slow ones")
    parser.add_argument("files", nargs="*", type=Path, help="pages (default: all)")
    args = parser.parse_args(argv)
    problems = []
    for page in [p.resolve() for p in args.files] or pages():
        problems += (write(page, slow=not args.skip_slow) if args.write
                     else check(page, slow=args.slow))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
