"""Pictures: the rank grid coloured by groups, the exchange's stages, its cost model, and
loss curves.

matplotlib is an optional extra (``pip install 'meshkit[plot]'``); every function here
that draws raises a clear ``ImportError`` naming that command when it is missing.
:func:`exchange_stages` is plain numpy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshkit._fs import unwritable
from meshkit.choices import EXCHANGE_ORDERS
from meshkit.errors import MissingExtra, MissingFile, UsageError
from meshkit.strategy.ranks import Strategy
from meshkit.units import format_bytes

__all__ = [
    "EXCHANGE_PLANS",
    "exchange_stages",
    "node_crossings",
    "output_path",
    "plot_cost",
    "plot_exchange",
    "plot_metrics",
    "plot_node_crossings",
    "plot_strategy",
]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - exercised via a subprocess test
        raise MissingExtra(
            "meshkit.plot.figures needs matplotlib: pip install 'meshkit[plot]'"
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

    Example:
        >>> output_path("mesh")
        'mesh.png'
        >>> output_path("missing_dir/mesh.png")
        Traceback (most recent call last):
        ...
        meshkit.errors.UsageError: cannot write missing_dir/mesh.png: no directory missing_dir
    """
    plt = _pyplot()
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


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    # A tight bounding box keeps multi-line titles and axis labels inside the image.
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.15)


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
    heading = title or f"{strategy!r}: colour = group over {fused} ({_count(len(groups), 'group')})"
    fig.suptitle(heading + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
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
        workdir_or_rows: a run directory (reads its ``metrics.jsonl``), a
            ``metrics.jsonl`` file, or the rows themselves.
        path: if given, save the figure there.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        MissingExtra: matplotlib is not installed (an ``ImportError``).
        MissingFile: no such path, or no ``metrics.jsonl`` in the run directory (a
            ``FileNotFoundError``).
        UsageError: the metrics hold no loss rows, a line is not a JSON object, or a
            row's ``step``, losses or expert load are not numbers (a ``ValueError``).

    Example:
        >>> import tempfile
        >>> rows = [{"step": 10, "loss": 2.3},
        ...         {"step": 20, "loss": 1.9, "eval_loss": 2.0,
        ...          "expert_load": [[0.3, 0.2, 0.25, 0.25]]}]
        >>> with tempfile.TemporaryDirectory() as workdir:
        ...     fig = plot_metrics(rows, path=os.path.join(workdir, "loss.png"))
        ...     os.path.getsize(os.path.join(workdir, "loss.png")) > 0
        True
        >>> [ax.get_title() for ax in fig.axes]
        ['loss', 'expert load at step 20']
    """
    from meshkit.train.metrics import read_metrics

    if isinstance(workdir_or_rows, list):
        rows = workdir_or_rows
    else:
        source = os.fspath(workdir_or_rows)
        if os.path.isdir(source) and not os.path.exists(os.path.join(source, "metrics.jsonl")):
            raise MissingFile(
                f"no metrics.jsonl in {source}: train a run with train.workdir={source} first"
            )
        if not os.path.exists(source):
            raise MissingFile(f"no run directory or metrics file at {source}")
        rows = read_metrics(source)
    rows = [r for r in rows if "loss" in r]
    if not rows:
        raise UsageError("no metrics rows with a loss to plot")
    _check_rows(rows)
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
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("nats / token")
    ax.set_title("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if load:
        loads = np.atleast_2d(np.asarray(load))
        ax2 = axes[0][1]
        width = 0.8 / len(loads)
        experts = np.arange(loads.shape[1])
        for layer, fractions in enumerate(loads):
            ax2.bar(experts + (layer - (len(loads) - 1) / 2) * width, fractions, width,
                    label=f"layer {layer}")
        ax2.set_xticks(experts)
        ax2.axhline(1 / loads.shape[1], color="k", ls="--", lw=1, label="balanced")
        ax2.set_xlabel("expert")
        ax2.set_ylabel("fraction of assignments")
        ax2.set_title(f"expert load at step {rows[-1]['step']}")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_rows(rows: list[dict[str, Any]]) -> None:
    """Every value the plot reads is a number, so matplotlib never sees a string."""
    for i, row in enumerate(rows, 1):
        for key in ("step", "loss", "eval_loss", "entropy_rate"):
            if key in row and not _is_number(row[key]):
                raise UsageError(
                    f"metrics row {i} (step {row.get('step')!r}): {key} is not a number: "
                    f"{row[key]!r}"
                )
        if "expert_load" in row:
            try:
                load = np.asarray(row["expert_load"], dtype=np.float64)
            except (ValueError, TypeError):
                load = None
            if load is None or load.ndim not in (1, 2) or load.size == 0:
                raise UsageError(
                    f"metrics row {i} (step {row['step']!r}): expert_load is not a "
                    "[layers, experts] array of numbers"
                )


# ------------------------------------------------------------------ the exchange

_NODE_COLOURMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys")
_MAX_DRAWN_DEVICES = 64
_MAX_LABELLED_DEVICES = 16


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _count(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _stage_titles(order: str) -> tuple[str, str, str]:
    first, second = ("node", "device") if order == "node_first" else ("device", "node")
    return "before", f"after {first} stage", f"after {second} stage"


def exchange_stages(
    nodes: int, devices: int, *, order: str = "node_first"
) -> dict[str, np.ndarray]:
    """Where every labelled piece sits before and after each stage (numpy reference).

    ``P = nodes · devices`` devices; device ``p = n·M + m`` is device ``m`` of node ``n``
    (rank ``p`` of the row-major ``node × device`` strategy). Before the exchange, slot
    ``q`` of device ``p`` holds the piece that ``p`` sends to device ``q``, labelled
    ``p·P + q`` (decode with ``divmod(label, P)`` as ``(source, destination)``). The two
    stages follow the layout documented in
    :func:`meshkit.exchange.two_stage.hierarchical_all_to_all`:

    * node stage: device ``(n, m)`` sends its ``M`` pieces for node ``n'`` to device
      ``(n', m)``; slots become ``[source node][destination local device]``;
    * device stage: the piece in slot ``j`` goes to local device ``j mod M``; slots
      become ``[source node][source local device]``, i.e. slot ``q`` holds the piece
      from device ``q``: the flat all-to-all's result.

    With ``order="device_first"`` the device stage runs first (slots become
    ``[destination node][source local device]``), then the node stage.

    Args:
        nodes: ``N``, the number of nodes.
        devices: ``M``, the devices per node.
        order: ``"node_first"`` or ``"device_first"``.

    Returns:
        ``{"before": a0, "after node stage": a1, "after device stage": a2}`` (keys in
        the stages' order), each an int array ``[P, P]``: row = device, column = slot,
        value = piece label.

    Raises:
        ValueError: ``nodes`` or ``devices`` not an int >= 1, or an unknown ``order``.

    Example:
        >>> stages = exchange_stages(2, 2)
        >>> # device (0, 1) now holds what devices 1 and 3 (local index 1) sent to node 0
        >>> [divmod(label, 4) for label in stages["after node stage"][1].tolist()]
        [(1, 0), (1, 1), (3, 0), (3, 1)]
        >>> stages["after device stage"][1].tolist()  # device 1 holds "q -> 1" from all q
        [1, 5, 9, 13]
    """
    n, m = _check_count(nodes, "nodes"), _check_count(devices, "devices")
    if order not in EXCHANGE_ORDERS:
        raise ValueError(f"order must be one of {EXCHANGE_ORDERS}, got {order!r}")
    p = n * m
    # a[n, m, a, b]: device (n, m), slot (a, b).
    before = np.arange(p * p).reshape(n, m, n, m)

    def node_stage(a: np.ndarray) -> np.ndarray:
        # Between devices with the same local index: swap device node <-> slot node.
        return a.transpose(2, 1, 0, 3)

    def device_stage(a: np.ndarray) -> np.ndarray:
        # Inside each node: swap device local index <-> slot local index.
        return a.transpose(0, 3, 2, 1)

    first, second = (node_stage, device_stage) if order == "node_first" else (
        device_stage, node_stage)
    middle = first(before)
    after = second(middle)
    titles = _stage_titles(order)
    return {t: a.reshape(p, p) for t, a in zip(titles, (before, middle, after), strict=True)}


def _destination_colours(n: int, m: int, plt: Any) -> np.ndarray:
    """RGBA per destination device: hue = its node, shade = its local index."""
    if n > len(_NODE_COLOURMAPS):
        cmap = plt.get_cmap("tab20")
        return np.array([cmap(i % cmap.N) for i in range(n * m)])
    shades = np.linspace(0.3, 0.8, m) if m > 1 else np.array([0.55])
    return np.array([plt.get_cmap(_NODE_COLOURMAPS[i])(s) for i in range(n) for s in shades])


def _check_stages(stages: Any, p: int) -> dict[str, np.ndarray]:
    if not isinstance(stages, Mapping) or not stages:
        raise ValueError("stages must be a non-empty mapping of title -> labels array")
    out = {}
    for title, value in stages.items():
        arr = np.asarray(value)
        if arr.size != p * p or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"stage {title!r}: expected {p}x{p} integer piece labels (one row per "
                f"device), got dtype {arr.dtype} and shape {arr.shape}"
            )
        arr = arr.reshape(p, p)
        counts = np.bincount(np.clip(arr.ravel(), 0, p * p), minlength=p * p + 1)
        if np.any(arr < 0) or np.any(arr >= p * p) or np.any(counts[: p * p] != 1):
            missing = np.flatnonzero(counts[: p * p] == 0).tolist()
            raise ValueError(
                f"stage {title!r} does not hold every piece label 0..{p * p - 1} exactly "
                f"once (missing {missing[:8]}): an exchange only moves data"
            )
        out[str(title)] = arr
    return out


def plot_exchange(
    nodes: int,
    devices: int,
    stages: Mapping[str, Any] | None = None,
    *,
    order: str = "node_first",
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
) -> Any:
    """Draw which labelled pieces every device holds before and after each exchange stage.

    One panel per stage. Rows are devices, grouped by node; columns are the slots of a
    device's buffer, in groups of ``M``. Each cell is a piece, labelled
    ``source → destination`` and coloured by its destination (hue = destination node,
    shade = device in that node), so the last panel, where every row is one colour, shows
    that each device received exactly its own pieces.

    Args:
        nodes: ``N``, the number of nodes.
        devices: ``M``, the devices per node (``P = N·M`` at most 64).
        stages: ``title -> labels``, each ``[P, P]`` (or ``P·P`` in device order) integer
            piece labels ``source·P + destination``, e.g. the arrays a ``jax.shard_map``
            program returns after each stage. Default :func:`exchange_stages`.
        order: the stage order, for the default stages and the slot descriptions.
        path: if given, save the figure there.
        title: figure title.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: bad ``nodes``/``devices``/``order``, ``P`` over 64, or a stage that
            is not ``P×P`` integer labels holding each piece exactly once.

    Example:
        >>> fig = plot_exchange(2, 4)  # add path="exchange.png" to save it
        >>> len(fig.axes)  # before, after the node stage, after the device stage
        3
    """
    n, m = _check_count(nodes, "nodes"), _check_count(devices, "devices")
    p = n * m
    if p > _MAX_DRAWN_DEVICES:
        raise ValueError(f"{p} devices are too many to draw (at most {_MAX_DRAWN_DEVICES})")
    default = exchange_stages(n, m, order=order)
    panels = _check_stages(default if stages is None else stages, p)
    plt = _pyplot()
    colours = _destination_colours(n, m, plt)
    middle_slots = ("(source node, destination device)" if order == "node_first"
                    else "(destination node, source device)")
    slot_meaning = dict(zip(
        _stage_titles(order),
        ("destination (node, device)", middle_slots, "source (node, device)"),
        strict=True,
    ))
    messages = {
        "after node stage": f"each device sent {_count(n - 1, 'message')} of {m} pieces "
                            "across nodes",
        "after device stage": f"each device sent {_count(m - 1, 'message')} of {n} pieces "
                              "in its node",
    }
    cell = 0.42 if p <= _MAX_LABELLED_DEVICES else 0.2
    fig, axes = plt.subplots(
        1, len(panels), figsize=(len(panels) * (cell * p + 1.3) + 0.4, cell * p + 2.0),
        squeeze=False,
    )
    for ax, (name, labels) in zip(axes[0], panels.items(), strict=True):
        dst = labels % p
        ax.imshow(colours[dst], aspect="equal", interpolation="nearest")
        if p <= _MAX_LABELLED_DEVICES:
            for (r, c), label in np.ndenumerate(labels):
                src, d = divmod(int(label), p)
                rgb = colours[d][:3]
                dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.55
                ax.text(c, r, f"{src}→{d}", ha="center", va="center",
                        fontsize=6.5 if p > 8 else 7.5, color="white" if dark else "black")
        for k in range(1, n):
            ax.axhline(k * m - 0.5, color="k", lw=2)
        for k in range(1, p // m):
            ax.axvline(k * m - 0.5, color="k", lw=0.8, ls=":")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"{r}: node {r // m} dev {r % m}" for r in range(p)], fontsize=7)
        ax.set_xticks(range(p))
        ax.tick_params(axis="x", labelsize=7)
        meaning = slot_meaning.get(name)
        ax.set_xlabel("slot" + (f" = {meaning}" if meaning else ""), fontsize=8)
        note = messages.get(name)
        ax.set_title(name + (f"\n{note}" if note else ""), fontsize=9)
    heading = title or (
        f"two-stage all-to-all on {n} nodes × {m} devices: cell = piece 'source→destination'"
        f", colour = destination (hue: node, shade: device)"
    )
    fig.suptitle(heading, fontsize=10)
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig


# ------------------------------------------------------------------ the cost model

_DEFAULT_GPUS = (16, 128, 1024)
_TEXT_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.5}


def _break_even(topology: Any, sizes: np.ndarray) -> list[float]:
    """Sizes where :func:`meshkit.exchange.cost.choose` switches method, refined by bisection."""
    from meshkit.exchange import cost

    def gain(size: float) -> float:
        return cost.predict("flat", size, topology) - cost.predict("hierarchical", size, topology)

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
    two-stage speed-up ``T_flat / T_hierarchical``; above 1 :func:`meshkit.exchange.cost.choose`
    picks the two-stage exchange. Each break-even size (where the choice flips) is
    marked and labelled.

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

    Example:
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
    m = _check_count(devices_per_node, "devices_per_node")
    counts = [_check_count(g, "gpus") for g in gpus]
    bad = [g for g in counts if g % m]
    if not counts or bad:
        raise ValueError(
            f"gpus must be non-empty multiples of devices_per_node={m}, got {list(gpus)}"
        )
    plt = _pyplot()
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
                bottom.plot(x, 1.0, "o", color=colour, ms=7, mec="k", zorder=3)
                for ax in (top, bottom):
                    ax.axvline(x, color=colour, lw=0.8, ls=":")
        handles += [Line2D([], [], color="k", lw=1.8, label="flat"),
                    Line2D([], [], color="k", lw=1.8, ls="--", label="two-stage")]
        top.set_title(f"{name}: predicted all-to-all time (● break-even)", fontsize=10)
        top.set_ylabel("time (ms)")
        top.grid(alpha=0.3, which="major")
        top.legend(handles=handles, fontsize=8)
        bottom.axhline(1.0, color="k", lw=1)
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
        _save(fig, path)
    return fig


# ------------------------------------------------------------------ what crosses nodes
#: The MoE exchange plans :func:`node_crossings` and :func:`plot_node_crossings` compare.
EXCHANGE_PLANS = ("flat", "two-stage", "dedup")


def node_crossings(
    expert_index: Any, *, nodes: int, devices: int, num_experts: int
) -> dict[str, list[tuple[int, int, int]]]:
    """The token rows that leave node 0 under each MoE exchange plan (plain numpy).

    Node ``i`` holds experts ``[i·E/N, (i+1)·E/N)``, device ``j`` of it the ``j``-th
    ``E/(N·M)`` of those. The tokens are node 0's (on its devices round-robin).

    Args:
        expert_index: ``[tokens, k]`` expert ids of node 0's tokens.
        nodes: ``N``.
        devices: ``M``, devices per node.
        num_experts: ``E``, divisible by ``N·M``.

    Returns:
        ``plan -> [(token, destination node, destination device), ...]``, one entry per
        row crossing the node boundary: ``flat`` and ``two-stage`` send one per
        assignment on another node (to the expert's device, or first to the peer
        device with the token's local index); ``dedup`` one per (token, other node),
        to the peer device, which fans it out inside its node.

    Raises:
        ValueError: bad sizes, or ``expert_index`` not ``[tokens, k]`` ids in ``[0, E)``.

    Example:
        >>> rows = node_crossings([[4, 5, 6, 7], [0, 4, 1, 6]], nodes=2, devices=2,
        ...                       num_experts=8)
        >>> {plan: len(r) for plan, r in rows.items()}
        {'flat': 6, 'two-stage': 6, 'dedup': 2}
    """
    n, m = _check_count(nodes, "nodes"), _check_count(devices, "devices")
    e = _check_count(num_experts, "num_experts")
    if e % (n * m):
        raise ValueError(f"num_experts={e} is not divisible by {n}×{m} devices")
    idx = np.asarray(expert_index)
    if idx.ndim != 2 or not np.issubdtype(idx.dtype, np.integer) or idx.size == 0:
        raise ValueError(f"expert_index must be a non-empty [tokens, k] integer array, "
                         f"got shape {idx.shape} and dtype {idx.dtype}")
    if idx.min() < 0 or idx.max() >= e:
        raise ValueError(f"expert ids must be in [0, {e}), got {idx.min()}..{idx.max()}")
    per_node, per_device = e // n, e // (n * m)
    out: dict[str, list[tuple[int, int, int]]] = {plan: [] for plan in EXCHANGE_PLANS}
    for t, row in enumerate(idx):
        here = t % m  # the token's device on node 0
        for node in sorted({int(x) // per_node for x in row} - {0}):
            out["dedup"].append((t, node, here))
        for x in row:
            node, device = divmod(int(x) // per_device, m)
            if node:
                out["flat"].append((t, node, device))
                out["two-stage"].append((t, node, here))
    return out


def plot_node_crossings(
    expert_index: Any,
    *,
    nodes: int = 2,
    devices: int = 4,
    num_experts: int = 16,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """Draw, per exchange plan, the rows that cross from node 0 to the other nodes.

    One panel per plan (:data:`EXCHANGE_PLANS`). Node 0's tokens stand on the left,
    the other nodes' devices on the right, the dashed line is the node boundary. Every
    line across it is one token row on the inter-node network: flat and two-stage send
    one per assignment on another node (two-stage to the peer device, which forwards it
    inside its node: grey lines), dedup one per (token, node), fanned out there.

    Args:
        expert_index: ``[tokens, k]`` expert ids of node 0's tokens (at most 16 tokens).
        nodes, devices, num_experts: as in :func:`node_crossings`.
        path: if given, save the figure there.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: as :func:`node_crossings`, or more than 16 tokens.

    Example:
        >>> fig = plot_node_crossings([[8, 9, 12, 1], [3, 10, 11, 14]])
        >>> [ax.get_title().split(":")[0] for ax in fig.axes]
        ['flat', 'two-stage', 'dedup']
    """
    rows = node_crossings(expert_index, nodes=nodes, devices=devices, num_experts=num_experts)
    idx = np.asarray(expert_index)
    if len(idx) > 16:
        raise ValueError(f"at most 16 tokens can be drawn, got {len(idx)}")
    plt = _pyplot()
    per_device = num_experts // (nodes * devices)
    tokens = len(idx)
    remote = [(node, d) for node in range(1, nodes) for d in range(devices)]
    y_of = {key: (len(remote) - 1 - i) / max(len(remote) - 1, 1) for i, key in enumerate(remote)}
    y_tok = {t: (tokens - 1 - t) / max(tokens - 1, 1) for t in range(tokens)}
    fig, axes = plt.subplots(1, len(EXCHANGE_PLANS), figsize=(4.2 * len(EXCHANGE_PLANS), 4.2))
    colours = plt.get_cmap("tab10")
    for ax, plan in zip(axes, EXCHANGE_PLANS, strict=True):
        ax.axvline(0.5, color="k", ls="--", lw=1)
        for t in range(tokens):
            ax.plot(0, y_tok[t], "o", color=colours(t % 10))
            ax.text(-0.06, y_tok[t], f"token {t}", ha="right", va="center", fontsize=7)
        for (node, d), y in y_of.items():
            ax.plot(1, y, "s", color="0.3")
            ax.text(1.06, y, f"node {node} dev {d}", ha="left", va="center", fontsize=7)
        seen: dict[tuple[int, int, int], int] = {}
        for t, node, d in rows[plan]:
            # Repeated rows to one device are drawn side by side, so each one shows.
            n_before = seen.get((t, node, d), 0)
            seen[t, node, d] = n_before + 1
            bend = 0.04 * n_before
            ax.plot([0, 0.5, 1], [y_tok[t], (y_tok[t] + y_of[node, d]) / 2 + bend,
                                  y_of[node, d]], color=colours(t % 10), lw=1.2, alpha=0.8)
        if plan != "flat":
            # Inside the node: the landing device forwards to each expert's device.
            for t, row in enumerate(idx):
                for x in row:
                    node, d = divmod(int(x) // per_device, devices)
                    here = t % devices
                    if node and d != here:
                        ax.annotate("", xy=(1.0, y_of[node, d]), xytext=(1.0, y_of[node, here]),
                                    arrowprops={"arrowstyle": "->", "color": "0.6", "lw": 0.8,
                                                "connectionstyle": "arc3,rad=0.4"})
        ax.set_xlim(-0.45, 1.5)
        ax.set_ylim(-0.1, 1.1)
        ax.axis("off")
        ax.set_title(f"{plan}: {_count(len(rows[plan]), 'row')} cross nodes", fontsize=9)
    fig.suptitle(f"node 0's tokens, top-{idx.shape[1]} of {num_experts} experts on "
                 f"{nodes} nodes × {devices} devices: what crosses the node boundary",
                 fontsize=10)
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig
