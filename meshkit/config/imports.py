"""A config's import paths (``model.factory``, ``model.loss``): imported only when used.

A config names a user's own model by import path, ``module.path:attribute``, so that
``meshkit train`` can train it from the command line. Importing a module runs its code,
so a config is code: building or showing a config never imports (``meshkit config`` and
``meshkit mesh`` are safe to run on a config from anyone), and the commands that do
import say so on stderr first, naming the file (``importing model.factory gpt:make from
./gpt.py``: a file of the current directory, which ``meshkit train`` searches last).

What is imported must also have been written for meshkit, so that a config cannot turn
a library function into a command: a factory is called as ``factory(rngs=...,
**model.factory_kwargs)`` and must have a parameter named ``rngs``; a loss is called as
``loss(model=..., batch=...)`` and must have parameters named ``model`` and ``batch``.
``timeit:timeit``, ``os:system``, ``builtins:eval`` and ``subprocess:run`` have none of
them, so they are refused before they are called. Each check names the key.

JAX-free itself; the user's module imports whatever it imports.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from meshkit.config.values import ConfigError, show, thaw

__all__ = ["FACTORY_PARAMETERS", "LOSS_PARAMETERS", "import_callable", "import_object"]

FACTORY_PARAMETERS = ("rngs",)
"""The keyword arguments meshkit calls ``model.factory`` with (and its kwargs)."""
LOSS_PARAMETERS = ("model", "batch")
"""The keyword arguments meshkit calls ``model.loss`` with."""

_log = logging.getLogger(__name__)


def import_object(path: str, *, key: str) -> Any:
    """The object an import path ``module.path:attribute`` names.

    A module not imported yet is announced first on the ``meshkit`` logger (which
    ``meshkit`` commands show on stderr): ``importing KEY PATH from FILE``.

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
    origin = None if module_name in sys.modules else _origin(module_name)
    if origin is not None:  # else there is nothing to run: imported, or not found
        _log.info(f"meshkit: importing {key} {path} from {origin}")
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


def import_callable(path: str, *, key: str, parameters: tuple[str, ...],
                    kwargs: Mapping[str, Any] | None = None,
                    kwargs_key: str | None = None) -> Callable[..., Any]:
    """Import ``path`` and check that it was written to be called by keyword with
    ``parameters`` (and ``kwargs``): every one of ``parameters`` is a parameter's name.

    Args:
        path: the import path, ``module:attribute``.
        key: the config key of the import path, named when the object is not callable
            or lacks one of ``parameters``.
        parameters: the names meshkit passes (:data:`FACTORY_PARAMETERS`,
            :data:`LOSS_PARAMETERS`).
        kwargs: the user's keyword arguments, passed too.
        kwargs_key: the config key of ``kwargs``, named when only they do not fit.

    Returns:
        The imported callable; call it by keyword.

    Raises:
        ConfigError: it does not import, is not callable, has a signature Python cannot
            read, lacks a parameter, or cannot take ``kwargs``; one line naming the key.

    Examples:
        >>> import_callable("timeit:timeit", key="model.factory", parameters=("rngs",))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: model.factory: timeit:timeit has no parameter ...
    """
    fn = import_object(path, key=key)
    if not callable(fn):
        raise ConfigError(f"{key}: {path} is {_a(type(fn).__name__)}, not a function or class")
    call = ", ".join(f"{name}=..." for name in parameters)
    try:
        signature = _signature(fn)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {path} has no signature Python can read, so meshkit cannot "
                          f"check that it takes {call}; name a function of your own that "
                          "calls it") from None
    for name in parameters:
        parameter = signature.parameters.get(name)
        if parameter is None or parameter.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY):
            raise ConfigError(f"{key}: {path} has no parameter named {name!r}: meshkit calls "
                              f"it as {_name(path)}({call}), and only a function written "
                              "for meshkit takes that")
    given = thaw(kwargs or {})
    taken = sorted(set(given) & set(parameters))
    if taken:
        raise ConfigError(f"{kwargs_key or key}: {taken[0]!r} is meshkit's to pass")
    try:
        signature.bind(**dict.fromkeys(parameters), **given)
    except TypeError as e:
        shown = [f"{name}=..." for name in parameters] + [f"{k}={show(v)}"
                                                          for k, v in given.items()]
        raise ConfigError(f"{kwargs_key or key}: {path} cannot be called as "
                          f"{_name(path)}({', '.join(shown)}): {e}") from None
    return fn


def _signature(fn: Any) -> inspect.Signature:
    """``fn``'s signature; for a class, its ``__init__``'s without ``self`` (a metaclass
    such as Flax NNX's hides it behind ``(*args, **kwargs)``)."""
    init_method = getattr(fn, "__init__", None) if isinstance(fn, type) else None
    if init_method is not None and init_method is not object.__init__:
        init = inspect.signature(init_method)
        return init.replace(parameters=list(init.parameters.values())[1:])
    return inspect.signature(fn)


def _origin(module_name: str) -> str | None:
    """The file ``module_name`` would be imported from, found without importing it (a
    parent package of a dotted name is looked up on its search path, not imported);
    ``None`` where there is no such module."""
    parts = module_name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                return "an unknown location"
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return "an unknown location"
    if spec is None:
        return None
    if not spec.origin or not os.path.isabs(spec.origin):
        return spec.origin or "a namespace package"
    # The current directory's own files read as ./name.py: the case to notice.
    here = os.path.relpath(spec.origin)
    return f"./{here}" if not here.startswith("..") else spec.origin


def _name(path: str) -> str:
    return path.rpartition(":")[2].rpartition(".")[2]


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
