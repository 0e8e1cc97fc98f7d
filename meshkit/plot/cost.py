"""The cost model's flat vs two-stage prediction over message sizes, with break-even points."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshkit.plot.figure import check_count, pyplot, save
from meshkit.units import format_bytes

__all__ = ["plot_cost"]


_DEFAULT_GPUS = (16, 128, 1024)
_TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.5}


def _break_even(topology: Any, sizes: np.ndarray) -> list[float]:
    """Sizes where :func:`meshkit.exchange.cost.choose` switches method, refined by bisection:
    where the two-stage exchange's predicted speed-up is ``1 + CHOOSE_MARGIN``."""
    from meshkit.exchange import cost

    def gain(size: float) -> float:
        return cost.predict("flat", size, topology) - (
            1 + cost.CHOOSE_MARGIN) * cost.predict("hierarchical", size, topology)

    found = []
    picks = [cost.choose(float(s), topology) for s in sizes]
    for i in range(len(sizes) - 1):
        if picks[i] == picks[i + 1]:
            continue
        lo, hi = math.log(sizes[i]), math.log(sizes[i + 1])
        sign = gain(sizes[i]) > 0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (gain(math.exp(mid)) > 0) == sign:
                lo = mid
            else:
                hi = mid
        found.append(math.exp((lo + hi) / 2))
    return found


def plot_cost(
    presets: Sequence[str] | None = None,
    sizes: Sequence[float] | np.ndarray | None = None,
    gpus: Sequence[int] = _DEFAULT_GPUS,
    *,
    devices_per_node: int = 8,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """Plot the cost model's flat vs two-stage all-to-all time against message size.

    One column per preset. Top: predicted time (:func:`meshkit.exchange.cost.predict`) of the flat
    (solid) and the two-stage (dashed) exchange for each cluster size. Bottom: the
    two-stage speed-up ``T_flat / T_hierarchical``; above ``1 + CHOOSE_MARGIN`` (1.05)
    :func:`meshkit.exchange.cost.choose` picks the two-stage exchange. Each break-even
    size (where the choice flips) is marked and labelled.

    Args:
        presets: names from :data:`meshkit.exchange.cost.PRESETS` (default all of them).
        sizes: bytes per device (the whole buffer one device sends), all > 0; default
            97 log-spaced sizes from 1 KiB to 4 GiB.
        gpus: total device counts, one curve each; multiples of ``devices_per_node``.
        devices_per_node: ``M``; ``nodes = gpus // devices_per_node``.
        path: if given, save the figure there.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: an unknown preset, no or non-positive sizes, or a GPU count that is
            not a positive multiple of ``devices_per_node``.

    Examples:
        >>> fig = plot_cost(["a100-8x200g"], gpus=[16, 2048])  # add path="cost.png" to save
        >>> len(fig.axes)  # predicted times above, speed-up below
        2
    """
    from meshkit.exchange import cost

    names = list(cost.PRESETS if presets is None else presets)
    if not names or isinstance(presets, str):
        raise ValueError(f"presets must be a non-empty list of names from {cost.PRESETS}")
    for name in names:
        if name not in cost.PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(cost.PRESETS)}")
    grid = np.logspace(10, 32, 97, base=2.0) if sizes is None else np.asarray(sizes, float)
    if grid.ndim != 1 or grid.size < 2 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError(f"sizes must be at least two finite byte counts > 0, got {sizes!r}")
    grid = np.unique(grid)
    m = check_count(devices_per_node, "devices_per_node")
    counts = [check_count(g, "gpus") for g in gpus]
    bad = [g for g in counts if g % m]
    if not counts or bad:
        raise ValueError(
            f"gpus must be non-empty multiples of devices_per_node={m}, got {list(gpus)}"
        )
    plt = pyplot()
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, len(names), figsize=(5.4 * len(names) + 0.6, 7.6),
                             squeeze=False, sharex=True)
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(counts)))
    ticks = [2.0**k for k in range(10, 41, 4) if grid[0] <= 2.0**k <= grid[-1]]
    for col, name in enumerate(names):
        top, bottom = axes[0][col], axes[1][col]
        handles = []
        for g, colour in zip(counts, colours, strict=True):
            topology = cost.preset(name, g // m, m)
            flat = np.array([cost.predict("flat", s, topology) for s in grid])
            hier = np.array([cost.predict("hierarchical", s, topology) for s in grid])
            top.loglog(grid, flat * 1e3, color=colour, lw=1.8)
            top.loglog(grid, hier * 1e3, color=colour, lw=1.8, ls="--")
            crossings = _break_even(topology, grid)
            where = ", ".join(format_bytes(x, digits=3) for x in crossings) or (
                "none: " + ("two-stage" if hier[0] < flat[0] else "flat") + " always faster")
            label = f"{g} GPUs ({g // m} nodes × {m}): break-even {where}"
            bottom.loglog(grid, flat / hier, color=colour, lw=1.8, label=label)
            handles.append(Line2D([], [], color=colour, lw=1.8, label=f"{g} GPUs"))
            for x in crossings:
                top.plot(x, cost.predict("flat", x, topology) * 1e3, "o", color=colour,
                         ms=7, mec="k", zorder=3)
                bottom.plot(x, 1 + cost.CHOOSE_MARGIN, "o", color=colour, ms=7, mec="k",
                            zorder=3)
                for ax in (top, bottom):
                    ax.axvline(x, color=colour, lw=0.8, ls=":")
        handles += [Line2D([], [], color="k", lw=1.8, label="flat"),
                    Line2D([], [], color="k", lw=1.8, ls="--", label="two-stage")]
        top.set_title(f"{name}: predicted all-to-all time (● break-even)", fontsize=10)
        top.set_ylabel("time (ms)")
        top.grid(alpha=0.3, which="major")
        top.legend(handles=handles, fontsize=8)
        bottom.axhline(1.0, color="k", lw=1)
        bottom.axhline(1 + cost.CHOOSE_MARGIN, color="k", lw=0.8, ls="--")
        low, high = bottom.get_ylim()
        high = max(high * 1.4, 2.0)  # headroom for the labels
        bottom.set_ylim(min(low, 0.5), high)
        shown = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if min(low, 0.5) <= t <= high]
        bottom.set_yticks(shown, [f"{t:g}×" for t in shown])
        bottom.text(0.02, 0.97, "two-stage faster ↑", transform=bottom.transAxes,
                    ha="left", va="top", fontsize=8, bbox=_TEXT_BOX)
        bottom.text(0.98, 0.03, "flat faster ↓", transform=bottom.transAxes, ha="right",
                    va="bottom", fontsize=8, bbox=_TEXT_BOX)
        bottom.set_title("two-stage speed-up = T_flat / T_two-stage", fontsize=10)
        bottom.set_ylabel("speed-up")
        bottom.set_xlabel("bytes per device (the whole buffer one device sends)")
        bottom.set_xticks(ticks, [format_bytes(t, digits=3) for t in ticks])
        bottom.minorticks_off()
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=7.5, loc="lower left")
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig
