"""Config values: the error and the field types, strict (a bool is not an int, a str is
never a number) but for what YAML users expect: ``1e3`` is an int. Containers are frozen.
"""

from __future__ import annotations

import difflib
import numbers
import os
import reprlib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NoReturn

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator, WithJsonSchema

from meshkit.errors import UsageError

INT32_MAX = 2**31 - 1
"""Upper bound of sizes and step counts: JAX indexes and counts them in int32."""
UINT32_MAX = 2**32 - 1
"""Upper bound of seeds (PRNG keys are built from 32-bit words)."""
_MAX_RANK_DIMS = 64  # numpy's limit on array dimensions


class ConfigError(UsageError):
    """A bad config, naming the dotted key at fault; the CLI exits with status 2.

    Examples:
        >>> from meshkit.config import load_config
        >>> load_config(None, ["train.steps=x"])
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: train.steps: input should be a valid integer, got 'x'
    """


def _bounded_repr() -> reprlib.Repr:
    # Bounded while it is built, not cut afterwards: a value from aliases may hold
    # thousands of items, and its full repr must never be made just to be shortened.
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 6, 40, 40, 40, 40
    r.maxstring = r.maxother = 200
    return r


_REPR = _bounded_repr()


def show(value: Any) -> str:
    """``repr(value)``, with huge integers shortened (``1.000e+300``, not 301 digits) and
    long containers and strings cut while the text is built (at most about 200
    characters)."""
    if isinstance(value, int) and not isinstance(value, bool) and len(str(abs(value))) > 24:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    text = _REPR.repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def unknown(key: str, candidates: Sequence[str]) -> ConfigError:
    """The error for an unknown key, naming the closest of ``candidates`` if any is close."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {show(key)}{hint}")


def _number(value: Any) -> Any:
    """Integral floats (YAML's ``1e3``) and numpy ints as ints; pydantic judges the rest."""
    if (isinstance(value, float) and value.is_integer()) or (
            isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return int(value)
    return value


def _axis_names(value: Any) -> str | tuple[str, ...]:
    names = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"expected a mesh axis name or a list of them, got {show(value)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"axes named twice: {twice}")
    return value if isinstance(value, str) else tuple(names)


class FrozenDict(dict[str, Any]):
    """A read-only, hashable dict whose equality respects the key order (a config's
    mappings: ``mesh.axes``, ``parallel.logical_axes``, ``model.factory_kwargs``)."""

    _what = "a config's mapping"

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{self._what} is read-only; build a new config with with_overrides()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and list(self.items()) == list(other.items())

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self.items()),))


class FrozenAxes(FrozenDict):
    """``mesh.axes``: a read-only, hashable dict whose equality respects the axis order."""

    _what = "mesh.axes"


def freeze(value: Any) -> Any:
    """Hashable containers, the inverse of :func:`thaw`: mappings -> FrozenDict, lists ->
    tuples.

    Examples:
        >>> thaw(freeze({"a": [1, {"b": 2}]})), hash(freeze({"a": [1]})) is not None
        ({'a': [1, {'b': 2}]}, True)
    """
    if isinstance(value, Mapping):
        return FrozenDict((k, freeze(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def _ranks(value: Any, depth: int = 1) -> Any:
    """Nested lists of rank ids as nested tuples (hashable)."""
    if depth == 1 and value is not None and not isinstance(value, list | tuple):
        raise ValueError(f"expected a nested list of rank ids, got {show(value)}")
    if isinstance(value, list | tuple):
        if depth > _MAX_RANK_DIMS:
            raise ValueError(f"nested more than {_MAX_RANK_DIMS} levels deep")
        return tuple(_ranks(v, depth + 1) for v in value)
    if depth > 1 and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"rank ids must be integers, got {show(value)}")
    return value


def _identifier(name: str) -> bool:
    """A Python identifier in ASCII (what the JSON schema's pattern accepts)."""
    return name.isidentifier() and name.isascii()


def _import_path(value: str) -> str:
    """``module.path:attribute`` (the attribute may be dotted: ``pkg.mod:Class.make``)."""
    module, sep, attribute = value.partition(":")
    if not (sep and all(map(_identifier, module.split(".")))
            and all(map(_identifier, attribute.split(".")))):
        raise ValueError(f"expected an import path module:attribute (e.g. mypkg.gpt:make), "
                         f"got {show(value)}")
    return value


def _mapping(value: Any) -> Any:
    """``null`` is the empty mapping; anything but a mapping with string keys is refused."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"expected a mapping of names, got {show(value)}")
    return value


def _keyword_arguments(value: Any) -> FrozenDict:
    value = _mapping(value)
    bad = [k for k in value if not _identifier(k)]
    if bad:
        raise ValueError(f"keyword argument names must be identifiers, got {show(bad[0])}")
    return freeze(value)


def _logical_axes(value: Any) -> FrozenDict:
    value = _mapping(value)
    out: dict[str, Any] = {}
    for name, target in value.items():
        if not _identifier(name):
            raise ValueError(f"logical name {show(name)} must be an identifier")
        try:
            out[name] = None if target is None else _axis_names(target)
        except ValueError:
            # Named down to the entry: the fuzz and the user both want the exact key.
            raise ConfigError(
                f"parallel.logical_axes.{name}: expected a role, a logical name, mesh axis "
                f"names or null, got {show(target)}") from None
        if out[name] == ():
            raise ConfigError(f"parallel.logical_axes.{name}: an empty list; write null "
                              "for a replicated dimension")
    return FrozenDict(out)


def _step_range(value: tuple[int, int]) -> tuple[int, int]:
    if value[0] < 1:
        raise ValueError(f"start must be >= 1 (steps count from 1), got {list(value)}")
    if value[1] <= value[0]:
        raise ValueError(f"start must be below stop, got {list(value)}")
    return value


def thaw(value: Any) -> Any:
    """Plain YAML-safe containers: mappings -> dict, tuples -> list."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


_NAME = {"type": "string", "minLength": 1}
Integer = Annotated[int, BeforeValidator(_number), Field(strict=True)]
# Every integer is bounded: past int32 it would only fail later, inside JAX.
Int = Annotated[Integer, Field(le=INT32_MAX)]
Seed = Annotated[Integer, Field(ge=0, le=UINT32_MAX)]
Float = Annotated[float, BeforeValidator(_number), Field(strict=True, allow_inf_nan=False)]
Str = Annotated[str, Field(strict=True, min_length=1)]
Bool = Annotated[bool, Field(strict=True)]
# As a shell would: `train.workdir=~/run` means the home directory's run (the CLI gets the
# "~" unexpanded after the "="), not a directory named "~".
Path = Annotated[Str, AfterValidator(os.path.expanduser)]
AxisField = Annotated[
    str | tuple[str, ...],
    PlainValidator(_axis_names),
    WithJsonSchema({"anyOf": [_NAME, {"type": "array", "items": _NAME, "uniqueItems": True},
                              {"type": "null"}]}),
]
"""One mesh axis name, or several (a fused axis); ``()`` for none (``[]`` or ``null``)."""
Axes = Annotated[Mapping[Str, Integer], Field(min_length=1), AfterValidator(FrozenAxes)]
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENTIFIER}(\.{_IDENTIFIER})*"
_NAMES = {"type": "object", "propertyNames": {"pattern": f"^{_IDENTIFIER}$"}}
ImportPath = Annotated[
    Str, AfterValidator(_import_path),
    WithJsonSchema({"type": "string", "pattern": f"^{_DOTTED}:{_DOTTED}$"}),
]
"""``module.path:attribute``, checked for its form here and imported by the section."""
Kwargs = Annotated[
    Mapping[str, Any], PlainValidator(_keyword_arguments),
    WithJsonSchema({"anyOf": [_NAMES, {"type": "null"}]}),
]
"""Keyword arguments: identifier -> any YAML value (``null``: none)."""
_TARGET = {"anyOf": [_NAME, {"type": "array", "items": _NAME, "minItems": 1, "uniqueItems": True},
                     {"type": "null"}]}
LogicalAxes = Annotated[
    Mapping[str, Any], PlainValidator(_logical_axes),
    WithJsonSchema({"anyOf": [{**_NAMES, "additionalProperties": _TARGET}, {"type": "null"}]}),
]
"""A model's logical axis names -> a role, a logical name, mesh axes or ``None``."""
Ranks = Annotated[tuple[Any, ...] | None, PlainValidator(_ranks),
                  WithJsonSchema({"anyOf": [{"type": "array"}, {"type": "null"}]})]
"""A nested tuple of rank ids (the ``mesh.ranks`` array)."""
StageLayers = Annotated[tuple[Annotated[Int, Field(ge=1)], ...], Field(min_length=1)] | None
"""Layers per pipeline stage, first to last."""
StepRange = Annotated[tuple[Int, Int], AfterValidator(_step_range)] | None
"""``[start, stop]``: the steps ``start, ..., stop - 1``, as Python's ``range``."""
