"""Config values: the error, how messages show values, and the field types.

A field type coerces as a YAML user expects and no further: ``1e3`` is an int, an int is a
float, a bool is neither, a string is never a number. Containers come out frozen.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NoReturn

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator, WithJsonSchema

from meshkit.errors import UsageError

INT32_MAX = 2**31 - 1
"""Upper bound of sizes and step counts: JAX indexes and counts them in int32."""
UINT32_MAX = 2**32 - 1
"""Upper bound of seeds (PRNG keys are built from 32-bit words)."""
_MAX_DIGITS_SHOWN = 24
_MAX_RANK_DIMS = 64  # numpy's limit on array dimensions


class ConfigError(UsageError):
    """A bad config, naming the dotted key at fault; the CLI exits with status 2.

    Example:
        >>> from meshkit.config import load_config
        >>> load_config(None, ["train.steps=0"])
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: train.steps: must be >= 1, got 0
    """


class Invalid(ValueError):
    """A bad field value; the error names the field's key followed by ``at`` (``[0]``)."""

    def __init__(self, message: str, at: str = "") -> None:
        super().__init__(message)
        self.at = at


def show(value: Any) -> str:
    """``repr(value)``, with huge integers shortened (``1.000e+300``, not 301 digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(abs(value))
        if len(digits) > _MAX_DIGITS_SHOWN:
            sign = "-" if value < 0 else ""
            return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def type_name(value: Any) -> str:
    """``show(value)`` and its type: ``'8' (str)``."""
    return f"{show(value)} ({type(value).__name__})"


def unknown(key: str, candidates: Sequence[str]) -> ConfigError:
    """The error for an unknown key, naming the closest of ``candidates`` if any is close."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {show(key)}{hint}")


def _expected(what: str, value: Any, at: str = "") -> NoReturn:
    raise Invalid(f"expected {what}, got {type_name(value)}", at)


def as_int(value: Any, at: str = "") -> int:
    """An int (numpy ints too); an integral float such as ``1e3`` counts, a bool does not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _expected("an integer", value, at)
    return int(value)


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _expected("a number", value)
    try:
        out = float(value)
    except OverflowError:  # an int past 1.8e308
        out = math.inf
    if not math.isfinite(out):
        raise Invalid(f"expected a finite number, got {show(value)}")
    return out


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        _expected("a string", value)
    if not value:
        raise Invalid("must not be empty")
    return value


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        _expected("true or false", value)
    return value


def _as_axis_names(value: Any) -> str | tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return _as_str(value)
    if not isinstance(value, list | tuple):
        _expected("a mesh axis name or a list of them", value)
    names = tuple(_as_str(v) for v in value)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise Invalid(f"axes named twice: {twice}")
    return names


class FrozenAxes(dict[str, int]):
    """A read-only, hashable, order-sensitive ``name -> size`` mapping (``mesh.axes``)."""

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("mesh.axes is read-only; build a new config with with_overrides()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return list(self.items()) == list(other.items())

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    # dict declares itself unhashable; these frozen axes are hashable on purpose.
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self.items()),))

    def __repr__(self) -> str:
        return repr(dict(self))


def as_axes(value: Any) -> FrozenAxes:
    """``mesh.axes``: a non-empty mapping of axis name to integer size."""
    if not isinstance(value, Mapping) or not value:
        _expected("a non-empty mapping of axis name to size, e.g. {node: 2, device: 4}", value)
    for name in value:
        if not isinstance(name, str) or not name:
            raise Invalid(f"axis names must be non-empty strings, got {show(name)}")
    return FrozenAxes([(name, as_int(size, f".{name}")) for name, size in value.items()])


def _as_ranks(value: Any) -> tuple[Any, ...] | None:
    def freeze(v: Any, depth: int) -> Any:  # lists become tuples: hashable
        if isinstance(v, list | tuple):
            if depth > _MAX_RANK_DIMS:
                raise Invalid(f"nested more than {_MAX_RANK_DIMS} levels deep")
            return tuple(freeze(x, depth + 1) for x in v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise Invalid(f"rank ids must be integers, got {type_name(v)}")
        return v

    if value is not None and not isinstance(value, list | tuple):
        _expected("a nested list of rank ids", value)
    return None if value is None else freeze(value, 1)


def _as_step_range(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        _expected("[start, stop] (two step numbers) or null", value)
    start, stop = as_int(value[0], "[0]"), as_int(value[1], "[1]")
    if start < 1:
        raise Invalid(f"start must be >= 1 (steps count from 1), got {start}")
    if stop <= start:
        raise Invalid(f"start must be below stop, got [{start}, {stop}]")
    return start, stop


def thaw(value: Any) -> Any:
    """Plain YAML-safe containers: mappings -> dict, tuples -> list."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def _nullable(schema: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


_NAME = {"type": "string", "minLength": 1}
# Every integer is bounded: past int32 it would only fail later, inside JAX.
Int = Annotated[int, BeforeValidator(as_int), Field(le=INT32_MAX)]
Seed = Annotated[int, BeforeValidator(as_int), Field(ge=0, le=UINT32_MAX)]
Float = Annotated[float, BeforeValidator(_as_float)]
Str = Annotated[str, BeforeValidator(_as_str)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
# As a shell would: `train.workdir=~/run` means the home directory's run (the CLI gets the
# "~" unexpanded after the "="), not a directory named "~".
Path = Annotated[str, BeforeValidator(_as_str), AfterValidator(os.path.expanduser)]
AxisNames = Annotated[
    str | tuple[str, ...],
    PlainValidator(_as_axis_names),
    _nullable({"anyOf": [_NAME, {"type": "array", "items": _NAME, "uniqueItems": True}]}),
]
"""One mesh axis name, or several (a fused axis); ``()`` for none (``[]`` or ``null``)."""
Axes = Annotated[
    Mapping[str, int],
    PlainValidator(as_axes),
    WithJsonSchema({"type": "object", "additionalProperties": {"type": "integer"},
                    "propertyNames": _NAME, "minProperties": 1}),
]
Ranks = Annotated[
    tuple[Any, ...] | None, PlainValidator(_as_ranks), _nullable({"type": "array"})
]
"""A nested tuple of rank ids (the ``mesh.ranks`` array)."""
StepRange = Annotated[
    tuple[int, int] | None,
    PlainValidator(_as_step_range),
    _nullable({"type": "array", "items": {"type": "integer", "minimum": 1},
               "minItems": 2, "maxItems": 2}),
]
"""``[start, stop]``: the steps ``start, ..., stop - 1``, as Python's ``range``."""
