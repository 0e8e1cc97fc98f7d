"""Shared by every picture: matplotlib on demand, the output path checked before drawing.

matplotlib is an optional extra (``pip install 'meshkit[plot]'``); every function that draws
raises a clear ``ImportError`` naming that command when it is missing.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from meshkit._fs import unwritable, write_file
from meshkit.errors import MissingExtra, UsageError

__all__ = ["output_path"]


def pyplot() -> Any:
    """``matplotlib.pyplot``, headless (Agg) without a display; an error naming the extra."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - exercised via a subprocess test
        raise MissingExtra(
            "meshkit.plot needs matplotlib: pip install 'meshkit[plot]'"
        ) from e
    if not os.environ.get("DISPLAY") and "inline" not in matplotlib.get_backend():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def output_path(path: str | os.PathLike[str]) -> str:
    """The file a figure saved to ``path`` will be, checked before anything is drawn.

    matplotlib appends the default format's suffix (``.png``) to a name without one, so
    the returned name is the one to report.

    Args:
        path: where the caller wants the picture.

    Returns:
        ``path`` with ``~`` expanded and, when it has no suffix, ``.png`` appended.

    Raises:
        MissingExtra: matplotlib is not installed.
        UsageError: an image format matplotlib cannot write, a directory at ``path``, or
            a parent directory that is missing or not writable (the path is named).

    Examples:
        >>> output_path("mesh")
        'mesh.png'
        >>> output_path("missing_dir/mesh.png")
        Traceback (most recent call last):
        ...
        meshkit.errors.UsageError: cannot write missing_dir/mesh.png: no directory missing_dir
    """
    plt = pyplot()
    out = os.path.expanduser(os.fspath(path))
    suffix = os.path.splitext(out)[1].lower().lstrip(".")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if not suffix:
        suffix = plt.rcParams["savefig.format"]
        out = f"{out}.{suffix}"
    if suffix not in formats:
        raise UsageError(
            f"cannot write {out}: matplotlib has no image format {suffix!r} "
            f"(use one of {', '.join(sorted(formats))})"
        )
    if os.path.isdir(out):
        raise UsageError(f"cannot write {out}: it is a directory")
    parent = os.path.dirname(out) or "."
    if not os.path.isdir(parent):
        what = "not a directory" if os.path.exists(parent) else "no directory"
        raise UsageError(f"cannot write {out}: {what} {parent}")
    reason = unwritable(parent)
    if reason is not None:
        raise UsageError(f"cannot write {out}: directory {parent} is not writable ({reason})")
    return out


def save(fig: Any, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` to ``path`` (a PNG at 120 dpi), whole or not at all.

    Raises:
        UsageError: the file cannot be written (a full disk), naming it.
    """
    out = os.fspath(path)
    suffix = os.path.splitext(out)[1].lstrip(".").lower()
    if not suffix:  # as savefig names a file without one
        suffix = pyplot().rcParams["savefig.format"]
        out = f"{out}.{suffix}"
    image = io.BytesIO()
    # A tight bounding box keeps multi-line titles and axis labels inside the image.
    fig.savefig(image, format=suffix, dpi=120, bbox_inches="tight", pad_inches=0.15)
    write_file(out, image.getvalue())


def check_count(value: Any, name: str) -> int:
    """``value`` as an int >= 1; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def plural(k: int, noun: str) -> str:
    """``plural(2, "group")`` is ``"2 groups"``."""
    return f"{k} {noun}" + ("" if k == 1 else "s")
