"""One line with the fix for the sharding errors JAX and Flax raise from a user's model.

A model brought from elsewhere often names mesh axes itself: bonsai writes
``jax.lax.with_sharding_constraint(x, P("fsdp", None, "tp", None))`` and
``jnp.zeros(..., out_sharding=P(...))``. Those specs go to JAX directly, so meshkit's
rules (``rules.extend(fsdp=...)``) cannot reach them: JAX offers no public hook that
renames the axes of a ``PartitionSpec`` a model passes it. On a mesh without those axes,
or on meshkit's Auto mesh, JAX's message names neither the fix nor (for a missing axis)
the call site. :func:`explain` turns each into one line that does; meshkit's boundaries
(the trainer's calls into user code, :class:`meshkit.FSDP`) raise it.
"""

from __future__ import annotations

import os
import re
import types

__all__ = ["call_site", "explain"]

_EAGER = "An auto mesh context or metadata is required"
_MISSING = re.compile(r"Resource axis: (\S+) of (P\(.*?\)) is not found in mesh: \((.*?)\)")
_AUTO = re.compile(r"PartitionSpec passed to (\S+) cannot contain axis names that are of type "
                   r"Auto or Manual\. Got PartitionSpec: (P\(.*?\)) with axis name: (\S+) of "
                   r"type: AxisType\.(\w+)")
_SOURCE = re.compile(r"at source:\s*(\S+?):(\d+)(?::\d+)? \((\w+)\)")


def _library(path: str) -> bool:
    """A file of JAX, Flax or meshkit: frames a call site skips."""
    parts = set(os.path.normpath(path).split(os.sep))
    return bool(parts & {"jax", "jaxlib", "flax", "meshkit", "contextlib.py"})


def call_site(error: BaseException) -> str | None:
    """``file:line (function)`` of the innermost frame of the user's code in a traceback.

    Args:
        error: the exception.

    Returns:
        The call site, or ``None`` when every frame is JAX's, Flax's or meshkit's.

    Examples:
        >>> try:
        ...     {}["x"]
        ... except KeyError as e:
        ...     site = call_site(e)
        >>> "<doctest" in site
        True
    """
    found = None
    tb: types.TracebackType | None = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _library(code.co_filename):
            found = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    return found


def explain(error: BaseException) -> str | None:
    """One line naming the culprit and the fix, for a sharding error from a model.

    Args:
        error: what JAX or Flax raised while building or tracing the model.

    Returns:
        The line, or ``None`` for an error this does not know.

    Examples:
        >>> explain(ValueError("Resource axis: fsdp of P('fsdp', None) is not found in "
        ...                    "mesh: ('dp', 'tp')."))[:67]
        "the model names mesh axis 'fsdp' in P('fsdp', None), which the mesh"
        >>> explain(ValueError("something else")) is None
        True
    """
    text = str(error)
    site = call_site(error)
    if _EAGER in text:
        return ("a parameter with sharding names was created outside a mesh"
                + (f" at {site}" if site else "") + ": build the model under "
                "`with nnx.use_eager_sharding(False):` and place it with "
                "meshkit.shard_model(model, mesh, rules), or let the trainer place it")
    missing = _MISSING.search(text)
    if missing:
        axis, spec, axes = missing.groups()
        return (f"the model names mesh axis {axis!r} in {spec}, which the mesh ({axes}) "
                "lacks" + (f", at {site}" if site else "") + ": name the dimensions by "
                "logical names there, meshkit.constrain(x, 'batch', ...), whose rules "
                "(rules.extend / parallel.logical_axes) map them, or name a mesh axis "
                f"{axis!r} (mesh.axes); a PartitionSpec passed to JAX directly does not go "
                "through the rules")
    auto = _AUTO.search(text)
    if auto:
        fn, spec, axis, kind = auto.groups()
        source = _SOURCE.search(text)
        where = f"{source[1]}:{source[2]} ({source[3]})" if source else site
        return (f"{fn}(out_sharding={spec})" + (f" at {where}" if where else "")
                + f" names mesh axis {axis}, which is {kind} on this mesh (out_sharding "
                "needs Explicit axes): drop out_sharding there and shard the result with "
                "meshkit.constrain(x, 'batch', ...) by logical names")
    return None
