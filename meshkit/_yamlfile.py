"""YAML as meshkit reads it (configs, topology files): private helpers.

PyYAML is imported on first use: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import re
from typing import IO, Any


class YAMLFileError(ValueError):
    """Invalid YAML, in one line: ``<where>: invalid YAML: <problem> (line L, column C)``."""


#: How many values aliases (``*name``) may add to a document beyond those written in it.
#: Anchors and aliases stay allowed (``yaml.safe_dump`` writes them for a value shared by
#: two keys), but a "billion laughs" document, a few lines that expand to billions of
#: values, is refused before anything walks, validates or prints the expanded value.
#: No config or topology file comes near: a whole config is about a hundred values.
MAX_ALIAS_EXPANSION = 10_000


def _check_expansion(root: Any) -> None:
    """Refuse a composed document whose aliases expand too far, or refer to themselves."""
    import yaml

    written: set[int] = set()
    sizes: dict[int, int] = {}  # id(node) -> values it expands to, itself included
    open_: set[int] = set()  # nodes being counted: meeting one again is a cycle

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to its own anchor (a recursive value)",
                node.start_mark)
        written.add(key)
        if isinstance(node, yaml.ScalarNode):
            sizes[key] = 1
            return 1
        open_.add(key)
        children = (node.value if isinstance(node, yaml.SequenceNode)
                    else [part for pair in node.value for part in pair])
        total = 1
        for child in children:
            total += size(child)
            # Stop counting at once: the total of a bomb is astronomically large.
            if total - len(written) > MAX_ALIAS_EXPANSION:
                raise yaml.composer.ComposerError(
                    None, None, f"aliases expand the document by more than "
                    f"{MAX_ALIAS_EXPANSION:,} values (an alias bomb?)", child.start_mark)
        open_.discard(key)
        sizes[key] = total
        return total

    size(root)


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

        def compose_document(self) -> Any:
            node = super().compose_document()
            _check_expansion(node)  # before any value is built from it
            return node

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
        YAMLFileError: invalid YAML, a duplicate key, an impossible date, nesting too
            deep for Python, or aliases that expand beyond :data:`MAX_ALIAS_EXPANSION`
            values or into themselves, as one line naming ``where``.

    Examples:
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
