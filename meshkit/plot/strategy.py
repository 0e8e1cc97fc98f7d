"""The rank grid of a strategy, coloured by the groups of an axis."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from meshkit.plot.figure import plural, pyplot, save
from meshkit.strategy.ranks import Strategy

__all__ = ["plot_strategy"]


def _panels(strategy: Strategy) -> tuple[np.ndarray, list[str], str | None]:
    """Reshape the rank array to [panels, rows, cols] with axis labels and a note."""
    names, sizes = strategy.axis_names, strategy.axis_sizes
    ranks = strategy.ranks
    if ranks.ndim == 1:
        return ranks.reshape(1, 1, -1), ["", "", names[0]], None
    if ranks.ndim == 2:
        return ranks[None], ["", names[0], names[1]], None
    if ranks.ndim == 3:
        return ranks, list(names), None
    outer = "×".join(names[:-2])
    note = f"{ranks.ndim}-D strategy drawn as panels over the flattened axes {outer}"
    return ranks.reshape(math.prod(sizes[:-2]), *sizes[-2:]), [outer, *names[-2:]], note


def plot_strategy(
    strategy: Strategy,
    axis: str | tuple[str, ...] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
) -> Any:
    """Draw the rank grid, each cell coloured by its group over ``axis``.

    2-D strategies are one grid (rows = outer axis); 3-D ones one panel per outer
    coordinate; larger ones are drawn as panels over the flattened outer axes, with a
    note saying so.

    Args:
        strategy: the strategy to draw.
        axis: the axis (or fused axes) whose groups give the colours; default the
            innermost axis.
        path: if given, save the figure there (PNG by extension).
        title: figure title; default the strategy's repr and the axis.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``axis`` is not an axis of the strategy.

    Examples:
        >>> fig = plot_strategy(Strategy.from_axes({"node": 2, "device": 4}), "node")
    """
    axis = strategy.axis_names[-1] if axis is None else axis
    groups = strategy.groups(axis)
    plt = pyplot()
    group_of = np.empty(strategy.size, dtype=np.int64)
    group_of[groups.ravel()] = np.repeat(np.arange(len(groups)), groups.shape[1])
    panels, labels, note = _panels(strategy)
    n, rows, cols = panels.shape
    # Sized so the grid's height binds: spare width is cropped on saving, spare height
    # would sit between the title and the grid.
    height = 0.8 * rows + (1.5 if note else 1.0 if rows > 1 else 0.8)
    fig, axes = plt.subplots(
        1, n, figsize=(max(3.0, 0.8 * cols + 1.4) * n, height), squeeze=False
    )
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    for i, ax in enumerate(axes[0]):
        grid = panels[i]
        colours = cmap(group_of[grid] % cmap.N)
        ax.imshow(colours, aspect="equal")
        for (r, c), rank in np.ndenumerate(grid):
            ax.text(c, r, str(rank), ha="center", va="center", fontsize=10)
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows) if labels[1] else [])
        ax.set_xlabel(labels[2])
        ax.set_ylabel(labels[1])
        if n > 1:
            outer = strategy.axis_names[:-2]
            where = np.unravel_index(i, strategy.axis_sizes[:-2])
            ax.set_title(", ".join(f"{a} = {c}" for a, c in zip(outer, where, strict=True)),
                         fontsize=9)
    fused = axis if isinstance(axis, str) else "+".join(axis)
    heading = title or f"{strategy!r}: colour = group over {fused} ({plural(len(groups), 'group')})"
    fig.suptitle(heading + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig
