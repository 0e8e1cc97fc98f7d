"""Training metrics: ``metrics.jsonl`` (one JSON object a line) and TensorBoard.

Only process 0 writes (every process computes the same global metrics). On resume, lines
for steps after the restored checkpoint are dropped first, so the file always describes
exactly one run history with no duplicated or orphaned steps.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from meshkit.errors import MissingFile, UsageError

__all__ = ["MetricsWriter", "read_metrics"]

_log = logging.getLogger(__name__)


def read_metrics(
    path: str | os.PathLike[str],
    *,
    allow_partial_last_line: bool = False,
    on_bad_line: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file (or the one in a workdir).

    Args:
        path: the file, or a workdir holding ``metrics.jsonl``.
        allow_partial_last_line: skip a last line cut off mid-write (a run killed while
            writing it) instead of raising.
        on_bad_line: if given, a line that is not a JSON object is skipped and this is
            called with a message naming it, instead of raising.

    Returns:
        One dict per line, in order.

    Raises:
        MissingFile: no metrics file there (a ``FileNotFoundError``).
        UsageError: the file cannot be read, or a line is not a JSON object (its number
            is named); both are ``ValueError``.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as workdir:
        ...     with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        ...         print('{"step": 10, "loss": 2.3}', file=f)
        ...         print('{"step": 20, "loss": 1.9}', file=f)
        ...     rows = read_metrics(workdir)
        >>> rows[-1]["loss"]
        1.9
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    rows = []
    try:
        # Undecodable bytes become U+FFFD, so such a line fails as JSON and is named.
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise MissingFile(f"no metrics file {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            if allow_partial_last_line and i == len(lines) and not line.endswith("\n"):
                break
            problem = f"{path}:{i}: not JSON: {e}"
        else:
            if isinstance(row, dict):
                rows.append(row)
                continue
            problem = f"{path}:{i}: expected a JSON object"
        if on_bad_line is None:
            raise UsageError(problem)
        on_bad_line(problem)
    return rows


def _warn(problem: str) -> None:
    _log.warning(f"meshkit: warning: {problem}; dropped it")


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MetricsWriter:
    """Append metrics rows to ``<workdir>/metrics.jsonl`` and TensorBoard (if available).

    Args:
        workdir: the run directory.
        resume_step: the step the run resumes from; rows after it are removed.
        enabled: write anything at all (False on processes other than 0).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as workdir:
        ...     w = MetricsWriter(workdir, resume_step=0)
        ...     w.write({"step": 10, "loss": 2.3})
        ...     w.close()
        ...     read_metrics(workdir)
        [{'step': 10, 'loss': 2.3}]
    """

    def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool = True) -> None:
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._enabled = enabled
        self._tb: Any = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path):
            # A damaged line (a disk that filled up, a hand edit) loses that line only:
            # the run it logs is intact, so resuming beats refusing.
            rows = read_metrics(self.path, allow_partial_last_line=True, on_bad_line=_warn)
            kept = []
            for r in rows:
                step = r.get("step", 0)
                if not _is_step(step):
                    _warn(f"{self.path}: a row's step {step!r} is not an integer")
                elif step <= resume_step:
                    kept.append(r)
            # Replace atomically: a crash here must not lose the rows being kept.
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            pass
        else:
            # purge_step hides events a crashed run logged after the checkpoint.
            self._tb = SummaryWriter(
                os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1
            )

    def write(self, row: Mapping[str, Any]) -> None:
        """Append one row (must hold ``step``); scalars also go to TensorBoard.

        Args:
            row: JSON-serialisable metrics with an int ``step``.
        """
        if not self._enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(dict(row)) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        """Flush and close TensorBoard files."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
