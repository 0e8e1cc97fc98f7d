"""The config documented: the docs' configuration reference and the JSON schema for editors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshkit.config.sections import SECTIONS, Config


def _format_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_format_default(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_format_default(v) for v in value) + "]"
    return str(value)


def format_reference() -> str:
    """A markdown table of every config key, its default and its meaning.

    Returns:
        The table, one row per key, for the docs' configuration reference.

    Examples:
        >>> format_reference().splitlines()[0]
        '| key | default | meaning |'
    """
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, cls in SECTIONS.items():
        for key, field in cls.model_fields.items():
            meaning = (field.description or "").replace("|", "/")
            rows.append(f"| `{name}.{key}` | `{_format_default(field.default)}` | {meaning} |")
    return "\n".join(rows) + "\n"


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file, for editors to complete and check YAML configs.

    Every section may be left out or empty (``null``: all defaults), as in a file.

    Returns:
        A JSON schema (draft 2020-12) as plain data; ``json.dumps`` writes it.

    Examples:
        >>> schema = json_schema()
        >>> schema["additionalProperties"], list(schema["properties"])[:2]
        (False, ['mesh', 'parallel'])
    """
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              **Config.model_json_schema(), "title": "meshkit config"}
    for name, prop in schema["properties"].items():
        schema["properties"][name] = {"anyOf": [{"$ref": prop["$ref"]}, {"type": "null"}]}
    return schema
