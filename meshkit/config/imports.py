"""A config's import paths (``model.factory``, ``model.loss``): imported and checked at once.

A config names a user's own model by import path, ``module.path:attribute``, so that
``meshkit train`` can train it from the command line. The section imports it when the
config is built (:class:`meshkit.config.ModelConfig`), and checks with
:func:`inspect.signature` that it can be called the way the trainer will call it: a
missing module, a missing attribute, something that is not callable, or a signature that
does not fit is a :class:`~meshkit.config.ConfigError` naming the key, before JAX starts
or anything compiles.

JAX-free itself; the user's module imports whatever it imports.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from meshkit.config.values import ConfigError, show, thaw

__all__ = ["check_call", "import_object"]


def import_object(path: str, *, key: str) -> Any:
    """The object an import path ``module.path:attribute`` names.

    Args:
        path: ``module.path:attribute``; the attribute may be dotted (``Class.method``).
        key: the config key that holds ``path``, for errors.

    Returns:
        The object.

    Raises:
        ConfigError: no such module, the module fails to import, or no such attribute;
            one line starting with ``key``.

    Examples:
        >>> import_object("math:sqrt", key="model.loss")(4.0)
        2.0
        >>> import_object("math:root", key="model.loss")
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: model.loss: module 'math' has no attribute 'root'
    """
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise ConfigError(f"{key}: no module named {e.name!r} (from {path!r}); is its "
                              "directory on sys.path (PYTHONPATH)?") from None
        raise ConfigError(f"{key}: importing {module_name!r} failed: {_one_line(e)}") from None
    # The user's module may raise anything while it imports: name it, in one line.
    except Exception as e:
        raise ConfigError(f"{key}: importing {module_name!r} failed: {_one_line(e)}") from None
    value: Any = module
    where = module_name
    for part in attribute.split("."):
        if not hasattr(value, part):
            what = "module" if value is module else "object"
            raise ConfigError(f"{key}: {what} {where!r} has no attribute {part!r}")
        value = getattr(value, part)
        where = f"{where}:{part}" if value is module else f"{where}.{part}"
    return value


def check_call(fn: Any, *, key: str, path: str, args: tuple[str, ...],
               kwargs: Mapping[str, Any] | None = None,
               kwargs_key: str | None = None) -> Callable[..., Any]:
    """Check that ``fn`` is callable with these positional and keyword arguments.

    Uses :func:`inspect.signature`; a callable whose signature Python cannot read
    (some builtins) passes.

    Args:
        fn: the imported object.
        key: the config key of the import path, named when ``fn`` is not callable or
            does not take the positional arguments.
        path: the import path, for the message.
        args: the names of the positional arguments the trainer passes (``("rngs",)``).
        kwargs: the keyword arguments the trainer passes too.
        kwargs_key: the config key of ``kwargs``, named when only they do not fit.

    Returns:
        ``fn``.

    Raises:
        ConfigError: ``fn`` is not callable, or cannot be called so; one line naming
            the key.

    Examples:
        >>> check_call(len, key="model.loss", path="builtins:len", args=("model", "batch"))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: model.loss: builtins:len cannot be called as ...
    """
    if not callable(fn):
        raise ConfigError(f"{key}: {path} is {_a(type(fn).__name__)}, not a function or class")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no signature to check: the call itself will tell
    name = path.rpartition(":")[2].rpartition(".")[2]
    positional = [object()] * len(args)
    given = thaw(kwargs or {})
    try:
        signature.bind(*positional, **given)
        return fn
    except TypeError as e:
        problem = str(e)
    try:
        # Too many positional arguments is the function's fault, not the keywords'.
        signature.bind_partial(*positional)
        blamed = kwargs_key if given and kwargs_key else key
    except TypeError:
        blamed = key
    shown = [*args, *(f"{k}={show(v)}" for k, v in given.items())]
    raise ConfigError(f"{blamed}: {path} cannot be called as {name}({', '.join(shown)}): "
                      f"{problem}")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
