"""A run's loss curves and expert load, from its ``metrics.jsonl``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from meshkit.errors import MissingFile, UsageError
from meshkit.plot.figure import pyplot, save

__all__ = ["plot_metrics"]


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

    Examples:
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
    from meshkit.training.metrics import read_metrics

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
    plt = pyplot()
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
        save(fig, path)
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
