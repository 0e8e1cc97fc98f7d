"""Resume from the newest intact checkpoint; move damaged ones aside.

:func:`restore_newest_intact` is what :func:`meshkit.training.train` calls at start-up. From
the newest checkpoint back, it:

1. checks the step's folder as a whole (a file in its place, unreadable, empty, or without
   orbax's ``_CHECKPOINT_METADATA``, which orbax writes last), then its files against the
   checksums recorded at save time
   (:mod:`meshkit.training.integrity`; each process checks a share), and the processes agree on
   the first damaged file;
2. if none is damaged, restores; a read error orbax raises (possible for a checkpoint
   without checksum records) counts as damage in a one-process run, and a checkpoint
   without records is only trusted once its restored values have the target's shapes
   and are all finite (orbax reads some overwritten bytes as wrong numbers);
3. if damaged: process 0 logs one warning naming the checkpoint and the reason and
   renames the folder to ``corrupt-<step>-<time>`` (never deleting it), every process
   waits for that, and the previous checkpoint is tried.

If every checkpoint was damaged, it raises :class:`NoIntactCheckpoint` (exit code 2, one
line naming the checkpoint directory); the damaged ones are kept, moved aside, and a
rerun starts from step 0.

Every process makes the same decisions in the same order: the only inputs that could
differ between processes (each one's share of the checks) are combined by
:func:`meshkit.runtime.agree.agree_max` before anyone acts. The one case that cannot be agreed
safely is a read error inside orbax's restore on some processes only (orbax's restore
ends with a barrier the failed process never reaches), so with several processes that
case is an error naming the checkpoint, not a silent retry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from meshkit.errors import EXIT_USAGE
from meshkit.training.checkpoint import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    fingerprints,
)
from meshkit.training.integrity import check_file, first_damaged, read_checksums

__all__ = ["NoIntactCheckpoint", "restore_newest_intact"]

# orbax writes one of these last into a step's folder (the name differs between orbax
# versions): without it the save never finished.
_MARKERS = ("_CHECKPOINT_METADATA", "CHECKPOINT_METADATA")
_NONE = 2**31 - 1  # "no damaged file" in the agreement: larger than any index
Agree = Callable[[Sequence[int]], list[int]]
_log = logging.getLogger(__name__)


class NoIntactCheckpoint(CheckpointError):
    """Every checkpoint of a run is damaged; each was moved aside (the message lists them)."""

    exit_code: ClassVar[int] = EXIT_USAGE


def _single(values: Sequence[int]) -> list[int]:
    return [int(v) for v in values]


def _shape_damage(folder: str) -> str | None:
    """What is wrong with a step's folder as a whole (before any file is checked), or
    ``None``: not a folder, unreadable, empty, or without orbax's completion marker."""
    if not os.path.isdir(folder):
        return "it is a file, not a folder" if os.path.lexists(folder) else "it is gone"
    try:
        names = os.listdir(folder)
        for name in names:  # root reads a chmod 000 folder; its files' metadata too
            os.stat(os.path.join(folder, name))
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not names:
        return "it is an empty folder (a save that never wrote anything)"
    if not any(marker in names for marker in _MARKERS):
        return f"no {_MARKERS[0]} in it (a save that never finished)"
    return None


def _damage(ckpt: Checkpointer, step: int, *, agree: Agree, part: int, parts: int) -> str | None:
    """The agreed reason checkpoint ``step`` is damaged, or ``None`` if its files are intact."""
    folder = ckpt.step_dir(step)
    whole = _shape_damage(folder)
    if agree([int(whole is not None)])[0]:
        return whole or "its folder is damaged on another process"
    try:
        entries = read_checksums(folder)
        unreadable = None
    except ValueError as e:
        entries, unreadable = [], str(e)
    found = first_damaged(folder, entries, part=part, parts=parts)
    # Agree on the smallest damaged index (as the max of negatives) and on whether any
    # process could not read the records.
    neg_index, bad_records = agree([-(_NONE if found is None else found),
                                    int(unreadable is not None)])
    if bad_records:
        return unreadable or "a checksum record is unreadable on another process"
    if -neg_index == _NONE:
        return None
    # Every process re-checks that one file, so they all know the reason.
    return check_file(folder, entries[-neg_index]) or (
        f"{entries[-neg_index].path} did not match its checksum when first checked")


_all_finite = jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def _has_record(folder: str) -> bool:
    try:
        return bool(read_checksums(folder))
    except ValueError:  # an unreadable record was found damaged before the restore
        return True


def _invalid(state: Any, target: Any, saved: dict[str, int] | None) -> str | None:
    """Why a restored ``state`` without a checksum record cannot be trusted, or ``None``:
    a leaf of another shape than ``target``'s; a leaf whose hash differs from the one
    saved with it (``saved``); without saved hashes (an older meshkit), a NaN or inf (a
    run saves only finite states). The same answer on every process: the checks are over
    the global arrays."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    for (path, got), want in zip(leaves, jax.tree.leaves(target), strict=True):
        shape, wanted = tuple(getattr(got, "shape", ())), tuple(getattr(want, "shape", ()))
        if shape != wanted:
            return (f"no checksum record, and {jax.tree_util.keystr(path)} has shape "
                    f"{shape}, not {wanted}")
    if saved is not None:
        now = fingerprints(state)
        wrong = sorted(name for name in saved if now.get(name) != saved[name])
        return None if not wrong else (
            f"no checksum record, and its restored {wrong[0]} differs from the hash saved "
            "with it" + (f" ({len(wrong) - 1} more such)" if len(wrong) > 1 else ""))
    inexact = [(path, x) for path, x in leaves
               if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jax.device_get(_all_finite([x for _, x in inexact])) if inexact else []
    for (path, _), ok in zip(inexact, finite, strict=True):
        if not ok:
            return (f"no checksum record, and its restored {jax.tree_util.keystr(path)} "
                    "holds NaN or inf")
    return None


def restore_newest_intact(
    ckpt: Checkpointer,
    target: Any,
    *,
    agree: Agree | None = None,
    process: tuple[int, int] = (0, 1),
    warn: Callable[[str], object] | None = None,
    adapt: Callable[[int], tuple[Any, Callable[[Any], Any]] | None] | None = None,
) -> tuple[int, Any]:
    """Restore the newest intact checkpoint onto ``target``, moving damaged ones aside.

    Args:
        ckpt: the run's checkpoints.
        target: the state to restore onto (its shapes, dtypes and shardings).
        agree: :func:`meshkit.runtime.agree.agree_max`, or ``None`` for one process.
        process: ``(index, count)`` of this process.
        warn: called with each of process 0's warnings instead of logging it (on the
            ``meshkit.training.recovery`` logger).
        adapt: called with the step of an intact checkpoint before it is restored:
            ``None`` to restore it onto ``target``, or ``(saved, convert)`` to restore it
            onto ``saved`` (the checkpoint's own shapes) and return ``convert`` of that
            (e.g. the stacked layers moved into another order,
            :mod:`meshkit.training.layout`).

    Returns:
        ``(step, state)``; ``(0, target)`` when there is no checkpoint.

    Raises:
        NoIntactCheckpoint: there were checkpoints and every one was damaged.
        CheckpointCorrupt: with several processes, orbax failed to read a checkpoint
            whose files passed the checksum check (or had no record).
        CheckpointError: a checkpoint of another model, or a damaged one that process 0
            could not rename (the reason is named).

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=3)
        >>> for step in (10, 20):
        ...     ckpt.save(step, {"w": jnp.full(2, step)})
        >>> import glob; [open(f, "r+b").write(b"\\xff" * 4)
        ...               for f in glob.glob(ckpt.step_dir(20) + "/default/**/d/*")][:1]
        [4]
        >>> warnings = []
        >>> step, state = restore_newest_intact(ckpt, {"w": jnp.zeros(2)}, warn=warnings.append)
        >>> step, state["w"].tolist(), ckpt.all_steps()
        (10, [10.0, 10.0], [10])
        >>> print(warnings[0].replace(ckpt.directory, "DIR"))  # doctest: +ELLIPSIS
        meshkit: warning: checkpoint DIR/20 is damaged (default/...: its CRC-32 ...
    """
    agree = agree or _single
    index, count = process
    lead = index == 0
    moved: list[str] = []
    # orbax leaves out a file where a step's folder belongs: that is damage too.
    for step in sorted(set(ckpt.all_steps()) | set(ckpt.step_names()), reverse=True):
        reason = _damage(ckpt, step, agree=agree, part=index, parts=count)
        if reason is None:
            adapted = None if adapt is None else adapt(step)
            saved, convert = adapted if adapted is not None else (target, None)
            try:
                state = ckpt.restore(step, saved)
            except CheckpointCorrupt as e:
                if count > 1:
                    raise CheckpointCorrupt(
                        f"{e}; with {count} processes meshkit cannot skip it safely: move "
                        f"{ckpt.step_dir(step)} aside and rerun", step=step, reason=e.reason,
                    ) from e
                reason = e.reason
            else:
                # Without a record, bytes overwritten inside a chunk read as wrong numbers
                # without an error: only values that a run could have saved pass.
                unrecorded = agree([int(not _has_record(ckpt.step_dir(step)))])[0]
                reason = _invalid(state, saved, ckpt.saved_fingerprints(step)
                                  ) if unrecorded else None
                if reason is None:
                    return step, state if convert is None else convert(state)
        where = f"corrupt-{step}-<time> (moved by process 0)"
        failed = None
        if lead:
            try:
                where = ckpt.move_aside(step)
            except OSError as e:
                failed = e.strerror or str(e)
            else:
                (warn or _log.warning)(
                    f"meshkit: warning: checkpoint {ckpt.step_dir(step)} is damaged "
                    f"({reason}); moved it to {where}; trying the previous one")
        # Everyone waits until process 0 has moved it, and learns whether it could.
        if agree([int(failed is not None)])[0]:
            raise CheckpointError(
                f"checkpoint {ckpt.step_dir(step)} is damaged ({reason}) and could not be "
                f"moved aside ({failed or 'on process 0'}); move it away and rerun")
        moved.append(where)
        ckpt.reload()
    if moved:
        raise NoIntactCheckpoint(
            f"no intact checkpoint in {ckpt.directory}: every one was damaged and moved "
            f"aside ({', '.join(moved)}); rerun to start from step 0, or move one back"
        )
    return 0, target
