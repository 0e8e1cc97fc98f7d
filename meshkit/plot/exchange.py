"""The two-stage exchange's stages (plain numpy) and their picture; what crosses nodes
under each MoE exchange plan."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshkit.choices import EXCHANGE_ORDERS
from meshkit.plot.figure import check_count, plural, pyplot, save

__all__ = [
    "EXCHANGE_PLANS",
    "exchange_stages",
    "node_crossings",
    "plot_exchange",
    "plot_node_crossings",
]


_NODE_COLOURMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys")
_MAX_DRAWN_DEVICES = 64
_MAX_LABELLED_DEVICES = 16


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

    Examples:
        >>> stages = exchange_stages(2, 2)
        >>> # device (0, 1) now holds what devices 1 and 3 (local index 1) sent to node 0
        >>> [divmod(label, 4) for label in stages["after node stage"][1].tolist()]
        [(1, 0), (1, 1), (3, 0), (3, 1)]
        >>> stages["after device stage"][1].tolist()  # device 1 holds "q -> 1" from all q
        [1, 5, 9, 13]
    """
    n, m = check_count(nodes, "nodes"), check_count(devices, "devices")
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

    Examples:
        >>> fig = plot_exchange(2, 4)  # add path="exchange.png" to save it
        >>> len(fig.axes)  # before, after the node stage, after the device stage
        3
    """
    n, m = check_count(nodes, "nodes"), check_count(devices, "devices")
    p = n * m
    if p > _MAX_DRAWN_DEVICES:
        raise ValueError(f"{p} devices are too many to draw (at most {_MAX_DRAWN_DEVICES})")
    default = exchange_stages(n, m, order=order)
    panels = _check_stages(default if stages is None else stages, p)
    plt = pyplot()
    colours = _destination_colours(n, m, plt)
    middle_slots = ("(source node, destination device)" if order == "node_first"
                    else "(destination node, source device)")
    slot_meaning = dict(zip(
        _stage_titles(order),
        ("destination (node, device)", middle_slots, "source (node, device)"),
        strict=True,
    ))
    messages = {
        "after node stage": f"each device sent {plural(n - 1, 'message')} of {m} pieces "
                            "across nodes",
        "after device stage": f"each device sent {plural(m - 1, 'message')} of {n} pieces "
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
        save(fig, path)
    return fig


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

    Examples:
        >>> rows = node_crossings([[4, 5, 6, 7], [0, 4, 1, 6]], nodes=2, devices=2,
        ...                       num_experts=8)
        >>> {plan: len(r) for plan, r in rows.items()}
        {'flat': 6, 'two-stage': 6, 'dedup': 2}
    """
    n, m = check_count(nodes, "nodes"), check_count(devices, "devices")
    e = check_count(num_experts, "num_experts")
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

    Examples:
        >>> fig = plot_node_crossings([[8, 9, 12, 1], [3, 10, 11, 14]])
        >>> [ax.get_title().split(":")[0] for ax in fig.axes]
        ['flat', 'two-stage', 'dedup']
    """
    rows = node_crossings(expert_index, nodes=nodes, devices=devices, num_experts=num_experts)
    idx = np.asarray(expert_index)
    if len(idx) > 16:
        raise ValueError(f"at most 16 tokens can be drawn, got {len(idx)}")
    plt = pyplot()
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
        ax.set_title(f"{plan}: {plural(len(rows[plan]), 'row')} cross nodes", fontsize=9)
    fig.suptitle(f"node 0's tokens, top-{idx.shape[1]} of {num_experts} experts on "
                 f"{nodes} nodes × {devices} devices: what crosses the node boundary",
                 fontsize=10)
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig
