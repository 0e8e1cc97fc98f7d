"""YAML as meshkit reads it (configs, topology files): private helpers.

PyYAML is imported on first use: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import re
from typing import IO, Any


class YAMLFileError(ValueError):
    """Invalid YAML, in one line: ``<where>: invalid YAML: <problem> (line L, column C)``."""


@functools.cache
def _loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML 1.2 floats (``3e-3`` is a number, not a string); duplicate keys refused."""

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
            seen: set[str] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key.value!r}", key.start_mark)
                    seen.add(key.value)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return Loader


def _problem(e: BaseException) -> str:
    """One line for a YAML error: PyYAML's own messages span several lines."""
    import yaml

    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        what = " ".join(str(e.problem or e.context or "error").split())
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(e, yaml.reader.ReaderError):
        return f"unacceptable character {e.character!r} at position {e.position}"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return " ".join(str(e).split())


def load_yaml(source: str | IO[str], *, where: str) -> Any:
    """Parse YAML safely, with YAML 1.2 floats and duplicate keys refused.

    Args:
        source: YAML text, or an open text file.
        where: what the error names first (a file, an override's key).

    Returns:
        The plain data the YAML holds.

    Raises:
        YAMLFileError: invalid YAML, a duplicate key, an impossible date or nesting too
            deep for Python, as one line naming ``where``.

    Example:
        >>> load_yaml("lr: 3e-4", where="x")
        {'lr': 0.0003}
        >>> load_yaml("{a: 1, a: 2}", where="x.yaml")
        Traceback (most recent call last):
        meshkit._yamlfile.YAMLFileError: x.yaml: invalid YAML: duplicate key 'a' (line 1, column 8)
    """
    import yaml

    try:
        return yaml.load(source, Loader=_loader())  # a SafeLoader
    # Besides YAMLError, PyYAML lets through ValueError (an impossible date such as
    # 2024-13-01, an int over Python's digit limit) and RecursionError (deep nesting).
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise YAMLFileError(f"{where}: invalid YAML: {_problem(e)}") from None
