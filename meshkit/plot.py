"""Pictures: the rank grid coloured by groups, the exchange's stages, and loss curves.

matplotlib is an optional extra (``pip install 'meshkit[plot]'``); every function here
raises a clear ``ImportError`` naming that command when it is missing.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from meshkit.strategy import Strategy

__all__ = ["plot_metrics", "plot_strategy"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - exercised via a subprocess test
        raise ImportError(
            "meshkit.plot needs matplotlib: pip install 'meshkit[plot]'"
        ) from e
    if not os.environ.get("DISPLAY") and "inline" not in matplotlib.get_backend():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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

    Example:
        >>> fig = plot_strategy(Strategy.from_axes({"node": 2, "device": 4}), "node")
    """
    axis = strategy.axis_names[-1] if axis is None else axis
    groups = strategy.groups(axis)
    plt = _pyplot()
    group_of = np.empty(strategy.size, dtype=np.int64)
    group_of[groups.ravel()] = np.repeat(np.arange(len(groups)), groups.shape[1])
    panels, labels, note = _panels(strategy)
    n, rows, cols = panels.shape
    fig, axes = plt.subplots(
        1, n, figsize=(max(3.0, 0.8 * cols + 1) * n, 0.8 * rows + 1.6), squeeze=False
    )
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    for i, ax in enumerate(axes[0]):
        grid = panels[i]
        colours = cmap(group_of[grid] % cmap.N)
        ax.imshow(colours, aspect="equal")
        for (r, c), rank in np.ndenumerate(grid):
            ax.text(c, r, str(rank), ha="center", va="center", fontsize=10)
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
        ax.set_xlabel(labels[2])
        ax.set_ylabel(labels[1])
        if n > 1:
            ax.set_title(f"{labels[0]} = {i}", fontsize=9)
    fused = axis if isinstance(axis, str) else "+".join(axis)
    heading = title or f"{strategy!r}: colour = group over {fused} ({len(groups)} groups)"
    fig.suptitle(heading + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_metrics(
    workdir_or_rows: str | os.PathLike[str] | list[dict[str, Any]],
    *,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """Draw the training loss, the eval loss and the source's entropy rate by step.

    A second panel shows the per-expert load of the last logged step (each layer's
    fraction of assignments per expert; 1/E is perfect balance).

    Args:
        workdir_or_rows: a run directory (reads ``metrics.jsonl``) or its rows.
        path: if given, save the figure there.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        FileNotFoundError: no ``metrics.jsonl`` in the workdir.
        ValueError: the metrics hold no loss rows.

    Example:
        >>> fig = plot_metrics("runs/default", path="runs/default/loss.png")  # doctest: +SKIP
    """
    from meshkit.metrics import read_metrics

    rows = (
        workdir_or_rows if isinstance(workdir_or_rows, list) else read_metrics(workdir_or_rows)
    )
    rows = [r for r in rows if "loss" in r]
    if not rows:
        raise ValueError("no metrics rows with a loss to plot")
    plt = _pyplot()
    load = next((r["expert_load"] for r in reversed(rows) if "expert_load" in r), None)
    fig, axes = plt.subplots(1, 2 if load else 1, figsize=(11 if load else 6.5, 4),
                             squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                label="eval loss")
    entropy = next((r["entropy_rate"] for r in rows if "entropy_rate" in r), None)
    if entropy is not None:
        ax.axhline(entropy, color="k", ls="--", lw=1,
                   label=f"entropy rate {entropy:.3f} (best possible)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if load:
        loads = np.atleast_2d(np.asarray(load))
        ax2 = axes[0][1]
        width = 0.8 / len(loads)
        for layer, fractions in enumerate(loads):
            ax2.bar(np.arange(len(fractions)) + layer * width, fractions, width,
                    label=f"layer {layer}")
        ax2.axhline(1 / loads.shape[1], color="k", ls="--", lw=1, label="balanced")
        ax2.set_xlabel("expert")
        ax2.set_ylabel("fraction of assignments")
        ax2.set_title(f"expert load at step {rows[-1]['step']}")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
