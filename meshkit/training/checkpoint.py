"""Orbax checkpoints of a sharded training state.

A thin wrapper over ``orbax.checkpoint.CheckpointManager``: save a pytree of (possibly
sharded, possibly multi-process) arrays under ``<workdir>/checkpoints/<step>``, keep the
newest few, and restore onto the shardings of an abstract target, so a checkpoint
written by one process layout restores into another with the same global shapes.
Saves are synchronous: when :meth:`Checkpointer.save` returns, the step is on disk
(a run that dies right after never loses a checkpoint it reported), with a record of its
files' checksums (:mod:`meshkit.training.integrity`) so that damage is found before a restore,
and a hash of every array's bits (:func:`fingerprints`) inside orbax's own metadata, so
that a checkpoint whose record never got written can still be verified after a restore.
A full disk during a save is a :class:`CheckpointError`: once every writer thread orbax
started for the step has ended, the partial checkpoint is removed, and the writers'
own reports of the full disk are held back.
A checkpoint that cannot be read is :class:`CheckpointCorrupt`, told apart from one
that belongs to another model (:class:`CheckpointError`); :meth:`Checkpointer.move_aside`
renames a damaged one to ``corrupt-<step>-<time>`` next to the others, never deleting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import glob
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from types import CoroutineType, FrameType
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from meshkit.errors import UsageError
from meshkit.runtime.interrupt import raise_interrupt
from meshkit.training.integrity import RECORD_PREFIX, record_checksums

__all__ = ["CheckpointCorrupt", "CheckpointError", "Checkpointer", "fingerprints"]

# TensorStore status codes (the start of its ValueError messages) that mean the bytes on
# disk are damaged or missing, as opposed to a request that does not fit the checkpoint.
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")
# orbax wraps a failed TensorStore chunk read in a bare Exception with this message
# (orbax/checkpoint/_src/serialization/serialization.py), the TensorStore error as cause.
_ORBAX_READ_ERROR = "Encountered error while reading array index"


_FINGERPRINTS = "meshkit_fingerprints"  # their key in orbax's custom metadata
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_GOLDEN = 2654435761  # Knuth's multiplicative hash: a different weight for every position


def _fingerprintable(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (jnp.issubdtype(dtype, jax.dtypes.prng_key)
                                  or jnp.issubdtype(dtype, jnp.bool_)
                                  or dtype.itemsize in _UNSIGNED)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    bits = (x.astype(jnp.uint32) if jnp.issubdtype(x.dtype, jnp.bool_)
            else jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32))
    flat = bits.reshape(-1)
    weights = jnp.arange(flat.size, dtype=jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(1)
    return jnp.sum(flat * weights, dtype=jnp.uint32)  # wraps around: a hash, not a sum


# One jitted function for every call (a fresh lambda per call would compile each time).
_hash_leaves = jax.jit(lambda xs: jnp.stack([_leaf_fingerprint(x) for x in xs]))


def fingerprints(state: Any) -> dict[str, int]:
    """A 32-bit, position-weighted hash of every leaf's bits, by the leaf's path.

    Computed on the devices over the global arrays, so every process gets the same
    numbers without gathering the state; saved inside each checkpoint's orbax metadata
    (written when orbax finalizes the step), so a checkpoint without its file checksums
    can still be verified after a restore.

    Args:
        state: a pytree of arrays (leaves of other dtypes, e.g. complex, are left out).

    Returns:
        ``{jax.tree_util.keystr(path): hash}``.

    Examples:
        >>> a = fingerprints({"w": jnp.arange(4.0)})
        >>> a == fingerprints({"w": jnp.arange(4.0)}), a == fingerprints({"w": jnp.ones(4)})
        (True, False)
    """
    leaves = [(jax.tree_util.keystr(path), x)
              for path, x in jax.tree_util.tree_leaves_with_path(state) if _fingerprintable(x)]
    if not leaves:
        return {}
    hashes = jax.device_get(_hash_leaves([x for _, x in leaves]))
    return {name: int(h) for (name, _), h in zip(leaves, hashes, strict=True)}


class CheckpointError(UsageError):
    """A checkpoint that cannot be saved or restored as asked (the message names it).

    A ``ValueError``; the CLI reports it in one line with exit code 2.
    """


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are damaged, truncated or missing (the message names it).

    Attributes:
        step: the checkpoint's step.
        reason: what is wrong, in a few words (no traceback).
    """

    def __init__(self, message: str, *, step: int, reason: str) -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def _disk_full(e: BaseException) -> str | None:
    """The path (or ``''``), when ``e`` or an exception behind it is a full disk or
    quota; else ``None``. orbax's async writes may end in another error (``Event loop
    is closed``) with the real one as its cause or context."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _DISK_FULL:
            return str(x.filename or "")
        if any(text in str(x) for text in _DISK_FULL_TEXT):
            return ""
        x = x.__cause__ or x.__context__
    return None


# How long a failed save waits for orbax's other writer threads of that step to end.
_WRITERS_GRACE_S = 60.0
# The loggers on which orbax's writers (absl) and their abandoned asyncio futures
# ("exception was never retrieved") report a failed write.
_NOISY_LOGGERS = ("absl", "asyncio")


# Where orbax's source files lie: code (a frame, a coroutine) that is orbax's own.
_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"


def _orbax_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if type(t).__module__.startswith("orbax.")}


def _close_abandoned_writes() -> None:
    """Close the coroutines of orbax's tasks left in a closed event loop, quietly.

    A failed save's event loop is closed under its other writes (orbax's
    ``run_until_complete`` does not cancel them): their tasks stay referenced by
    TensorStore's futures for the rest of the process and are finalized at interpreter
    exit, where each one's ``finally`` fails to import (``sys.meta_path is None``) and
    prints its traceback after the save's one line; the never-started ones warn "never
    awaited" whenever they are collected. A task whose loop is closed can never run
    again: closed here, its coroutine runs its ``finally`` now, while imports work, and
    finalizes silently. Tasks of a loop still open (another thread's) are left alone."""
    gc.collect()
    for task in [o for o in gc.get_objects() if isinstance(o, asyncio.Task)]:
        coro = task.get_coro()
        if (not task.done() and task.get_loop().is_closed()
                and isinstance(coro, CoroutineType) and _ORBAX_SOURCE in coro.cr_code.co_filename):
            with contextlib.suppress(Exception):
                coro.close()


def _from_orbax(e: BaseException) -> bool:
    """Whether ``e`` was raised in orbax's code or names a folder orbax is writing (a
    TensorStore error set on a future has no traceback)."""
    if ".orbax-checkpoint-tmp" in str(e):
        return True
    tb = e.__traceback__
    while tb is not None:
        if _ORBAX_SOURCE in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _closed_loop_callback(args: Any) -> bool:
    """A TensorStore write completing after its asyncio loop was closed (nothing else
    raises this through :data:`sys.unraisablehook` without an object)."""
    return (args.object is None and isinstance(args.exc_value, RuntimeError)
            and str(args.exc_value) == "Event loop is closed")


class _DiskFullNoise(logging.Filter):
    """Drops the records of orbax's writes failing on a full disk (the save reports it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return e is None or _disk_full(e) is None or not _from_orbax(e)


class _DropClosedLoopCallbacks:
    """An unraisable hook that drops :func:`_closed_loop_callback` s, passing on the rest."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, args: Any) -> None:
        if not _closed_loop_callback(args):
            self.previous(args)


_DISK_FULL_NOISE = _DiskFullNoise()


@contextlib.contextmanager
def _writers_held() -> Iterator[None]:
    """Run a save; if it fails, wait for every writer thread orbax started for it, so
    that nothing writes into the step's folder once it is removed; on a full disk, close
    the writes it abandoned (:func:`_close_abandoned_writes`).

    orbax saves from several threads and a synchronous save waits on them in turn: the
    first that fails ends the wait while the others still write. On a full disk each of
    those fails too, logging its traceback, and its event loop is closed under
    TensorStore writes still in flight, whose completions raise ``RuntimeError: Event
    loop is closed`` through :data:`sys.unraisablehook`, some after the save has
    returned. They all repeat the one error the save reports, so they are dropped (the
    late ones for the rest of the process); anything else is passed on.
    """
    before = _orbax_threads()
    held: list[Any] = []
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(_DISK_FULL_NOISE)
    previous, sys.unraisablehook = sys.unraisablehook, held.append
    disk_full = False
    try:
        yield
    except Exception as e:
        disk_full = _disk_full(e) is not None
        deadline = time.monotonic() + _WRITERS_GRACE_S
        for thread in _orbax_threads() - before:
            thread.join(max(0.0, deadline - time.monotonic()))
        if disk_full:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                _close_abandoned_writes()
        raise
    finally:
        sys.unraisablehook = previous
        for args in held:
            if not (disk_full and _closed_loop_callback(args)):
                previous(args)
        if disk_full:
            if not isinstance(previous, _DropClosedLoopCallbacks):
                sys.unraisablehook = _DropClosedLoopCallbacks(previous)
        else:
            for logger in loggers:
                logger.removeFilter(_DISK_FULL_NOISE)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _damage(e: Exception) -> str | None:
    """The reason, when ``e`` from an orbax restore means damaged files; else ``None``."""
    if isinstance(e, UnicodeDecodeError | json.JSONDecodeError):  # damaged metadata
        return f"unreadable metadata: {_first_line(e)}"
    cause = e.__cause__ if str(e).startswith(_ORBAX_READ_ERROR) else e
    if isinstance(cause, ValueError) and str(cause).startswith(_DAMAGE_CODES):
        return _first_line(cause)
    return None


def _check_shardings(target: Any, step: int) -> None:
    """Every leaf of a restore target says where it goes, all on the same devices.

    orbax restores a leaf where its target says: one without a sharding, or one left on
    a single device (an optax counter made outside ``jax.jit``), lands on one device,
    where the next step over the mesh refuses it ("incompatible devices").
    """
    devices: dict[frozenset[Any], str] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        where = jax.tree_util.keystr(path)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise CheckpointError(
                f"cannot restore checkpoint {step} onto a target whose leaf {where} has no "
                "sharding: give every leaf one (an array, or a jax.ShapeDtypeStruct with "
                "sharding=)")
        devices.setdefault(frozenset(sharding.device_set), where)
    if len(devices) > 1:
        (few, first), (many, other) = sorted(devices.items(), key=lambda d: len(d[0]))[:2]
        raise CheckpointError(
            f"cannot restore checkpoint {step} onto a target whose leaves lie on different "
            f"devices: {first} on {len(few)}, {other} on {len(many)}; give every leaf a "
            "sharding on the same mesh (jax.sharding.NamedSharding(mesh, P()) for a "
            "replicated counter)")


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C back until the block has finished, then let it act; a second one
    acts at once. (Main thread only: elsewhere Python delivers no signals.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if got:  # a second Ctrl-C acts now, even where Python would drop the exception
            raise_interrupt(signum, frame)
            return
        got.append(signum)

    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, or not Python's to handle: leave it so
        yield
        return
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        previous(signal.SIGINT, None)  # default_int_handler: KeyboardInterrupt, now


class Checkpointer:
    """Save and restore training states by step.

    Args:
        directory: where the step folders live (created if missing).
        keep: how many of the newest checkpoints to keep (≥ 1).
        metadata: JSON values saved with every checkpoint, by key, inside orbax's own
            metadata (:meth:`saved_metadata` reads them back): what a restore must know
            about the state besides its shapes, e.g. the order of stacked layers.

    Attributes:
        directory: the absolute path of ``directory``.

    Raises:
        ValueError: ``keep`` < 1.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
        >>> for step in (100, 200, 300):
        ...     ckpt.save(step, {"w": jnp.full(3, step / 100)})
        >>> ckpt.all_steps()  # the oldest was deleted
        [200, 300]
        >>> ckpt.restore(ckpt.latest_step(), {"w": jnp.zeros(3)})["w"].tolist()
        [3.0, 3.0, 3.0]
        >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2, *,
                 metadata: Mapping[str, Any] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1, got {keep}")
        if metadata is not None and _FINGERPRINTS in metadata:
            raise ValueError(f"metadata key {_FINGERPRINTS!r} is the checkpoint's own")
        self.directory = os.path.abspath(directory)
        self._metadata = dict(metadata or {})
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` if there is none.

        Returns:
            A step number or ``None``.

        Examples:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.latest_step() is None
            True
            >>> ckpt.save(7, {"w": jnp.ones(2)})
            >>> ckpt.latest_step()
            7
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every kept checkpoint's step, oldest first.

        Returns:
            Sorted step numbers (empty if there is no checkpoint).

        Examples:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=3)
            >>> for step in (1, 3, 5):
            ...     ckpt.save(step, {"w": jnp.ones(2)})
            >>> ckpt.all_steps()
            [1, 3, 5]
        """
        return sorted(self._manager.all_steps())

    def step_names(self) -> list[int]:
        """Every step with an entry of its name on disk, oldest first, whatever it is.

        orbax's :meth:`all_steps` leaves out some damage (a file where a step's folder
        belongs); :mod:`meshkit.training.recovery` checks these too.

        Returns:
            Sorted step numbers.

        Examples:
            >>> import tempfile
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = open(ckpt.step_dir(4), "w").write("not a folder")
            >>> ckpt.step_names(), ckpt.all_steps()
            ([4], [])
        """
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit() and n.isascii())

    def save(self, step: int, state: Any) -> None:
        """Write ``state`` as checkpoint ``step`` (overwriting nothing).

        Args:
            step: the training step the state is *after*.
            state: a pytree of arrays.

        Raises:
            CheckpointError: a checkpoint for ``step`` or a later step exists already
                (steps only grow: orbax would otherwise skip the save without a word); or
                the disk or quota is full (the partial checkpoint is removed, the
                previous ones are left intact).
            RuntimeError: orbax declined to write the checkpoint.

        Examples:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(10, {"w": jnp.arange(3.0), "step": jnp.int32(10)})
            >>> ckpt.all_steps()
            [10]
        """
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(
                f"cannot save step {step}: a checkpoint for step {latest} exists already "
                f"in {self.directory}"
            )
        # Ctrl-C waits for the save: orbax's threads would write on behind an interrupted
        # one (a *.orbax-checkpoint-tmp left, "cannot schedule new futures" at exit).
        with _ctrl_c_after(), self._saving(step):
            self._save(step, state)

    @contextlib.contextmanager
    def _saving(self, step: int) -> Iterator[None]:
        try:
            yield
        except KeyboardInterrupt:  # a second Ctrl-C, which does not wait
            self._interrupted(step)
            raise

    def _save(self, step: int, state: Any) -> None:
        try:
            # The hashes go into orbax's own metadata file, written as the step is
            # finalized: no checkpoint exists without them (the file checksums come after).
            with _writers_held():
                saved = self._manager.save(
                    step, args=ocp.args.StandardSave(state),
                    custom_metadata={**self._metadata, _FINGERPRINTS: fingerprints(state)})
                self._manager.wait_until_finished()
            if not saved:
                raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
            # orbax's finalize barrier has passed: the folder is complete on every process.
            record_checksums(self.step_dir(step), part=jax.process_index(),
                             parts=jax.process_count())
        except Exception as e:
            where = _disk_full(e)
            if where is None:
                raise
            self._remove_partial(step)
            before = [s for s in self.all_steps() if s < step]
            raise CheckpointError(
                f"no space left on device while saving checkpoint {step} in "
                f"{self.directory}" + (f" (writing {where})" if where else "") + ": free "
                "some space or lower train.keep_checkpoints, then rerun to resume; the "
                "partial checkpoint was removed"
                + (f" and checkpoints {before} are intact" if before else "")) from None

    def _interrupted(self, step: int) -> None:
        """A second Ctrl-C cut the save of ``step`` short: give orbax's threads the time
        to end, keep the checkpoint if they finalized it, else remove what they left."""
        try:
            self._manager.wait_until_finished()
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, still clean up
            pass
        except Exception:  # the save failed: what it left is removed below
            pass
        if not os.path.isdir(self.step_dir(step)) or glob.glob(os.path.join(
                glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")):
            self._remove_partial(step)
        else:  # finalized: complete, with its hashes; its file checksums are cheap
            with contextlib.suppress(Exception):
                record_checksums(self.step_dir(step), part=jax.process_index(),
                                 parts=jax.process_count())

    def _remove_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` left: orbax's temporary folder, and a
        half-written checksum record (a finalized step itself stays: it has its hashes)."""
        leftovers = glob.glob(os.path.join(glob.escape(self.directory),
                                           f"{step}.orbax-checkpoint-tmp*"))
        leftovers += glob.glob(os.path.join(glob.escape(self.step_dir(step)),
                                            f"{RECORD_PREFIX}-*.tmp*"))
        for path in leftovers:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)  # other processes remove it too
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def saved_fingerprints(self, step: int) -> dict[str, int] | None:
        """The :func:`fingerprints` saved with checkpoint ``step``, or ``None`` (a
        checkpoint of an older meshkit, or metadata that cannot be read).

        Args:
            step: a step number.

        Returns:
            ``{leaf path: hash}`` or ``None``.

        Examples:
            >>> import tempfile
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(3, {"w": jnp.ones(2)})
            >>> ckpt.saved_fingerprints(3) == fingerprints({"w": jnp.ones(2)})
            True
        """
        try:
            saved = self._custom_metadata(step)[_FINGERPRINTS]
            return {str(k): int(v) for k, v in saved.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def saved_metadata(self, step: int, key: str) -> Any:
        """The value of ``key`` in the ``metadata`` saved with checkpoint ``step``, or
        ``None`` (saved without it, or metadata that cannot be read).

        Args:
            step: a step number.
            key: a key of the ``metadata`` the checkpoint was saved with.

        Returns:
            The JSON value, or ``None``.

        Examples:
            >>> import tempfile
            >>> ckpt = Checkpointer(tempfile.mkdtemp(), metadata={"order": [1, 0]})
            >>> ckpt.save(3, {"w": jnp.ones(2)})
            >>> ckpt.saved_metadata(3, "order"), ckpt.saved_metadata(3, "other")
            ([1, 0], None)
        """
        try:
            return self._custom_metadata(step).get(key)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _custom_metadata(self, step: int) -> dict[str, Any]:
        with open(os.path.join(self.step_dir(step), "_CHECKPOINT_METADATA"),
                  encoding="utf-8") as f:
            custom = json.load(f)["custom_metadata"]
        if not isinstance(custom, dict):
            raise TypeError("custom_metadata is not a mapping")
        return custom

    def step_dir(self, step: int) -> str:
        """The folder of checkpoint ``step`` (whether or not it exists).

        Args:
            step: a step number.

        Returns:
            ``<directory>/<step>``.

        Examples:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).step_dir(30).endswith("/30")
            True
        """
        return os.path.join(self.directory, str(step))

    def move_aside(self, step: int) -> str:
        """Rename checkpoint ``step`` to ``corrupt-<step>-<UTC time>`` (never delete it).

        Call it on one process only; then :meth:`reload` on every process.

        Args:
            step: a step from :meth:`all_steps`.

        Returns:
            The new path.

        Examples:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(5, {"w": jnp.ones(2)})
            >>> os.path.basename(ckpt.move_aside(5)).startswith("corrupt-5-")
            True
            >>> ckpt.reload(); ckpt.all_steps()
            []
        """
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = os.path.join(self.directory, f"corrupt-{step}-{stamp}")
        n = 1
        while os.path.lexists(target):  # moved aside twice within a second
            n += 1
            target = os.path.join(self.directory, f"corrupt-{step}-{stamp}-{n}")
        os.rename(self.step_dir(step), target)
        return target

    def reload(self) -> None:
        """Read the list of checkpoints from disk again (after :meth:`move_aside`).

        Examples:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).reload()
        """
        self._manager.reload()

    def restore(self, step: int, target: Any) -> Any:
        """Read checkpoint ``step`` onto the shapes, dtypes and shardings of ``target``.

        Args:
            step: a step from :meth:`all_steps`.
            target: a pytree of arrays or ``jax.ShapeDtypeStruct`` with shardings.

        Returns:
            The restored pytree, sharded like ``target``.

        Raises:
            CheckpointCorrupt: a file of the checkpoint is damaged, truncated or missing
                as far as orbax can tell while reading (see :mod:`meshkit.training.integrity` for
                the check before reading).
            CheckpointError: no checkpoint at ``step``, one whose structure or shapes
                differ from ``target``'s (a different model config), or a target leaf
                without a sharding or on other devices than the rest.

        Examples:
            >>> import tempfile, jax, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(10, {"w": jnp.arange(3.0)})
            >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            >>> target = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding)}
            >>> ckpt.restore(10, target)["w"].tolist()
            [0.0, 1.0, 2.0]
        """
        if step not in self._manager.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory} (have {self.all_steps()})"
            )
        _check_shardings(target, step)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # A bare Exception is what orbax raises for a failed chunk read (see
        # _ORBAX_READ_ERROR); _damage recognises it by message and cause, and anything
        # else that is not a ValueError, KeyError or TypeError is raised unchanged.
        except Exception as e:
            # A failed read leaves orbax's other reads in a closed event loop, as a
            # failed save leaves its writes.
            _close_abandoned_writes()
            reason = _damage(e)
            if reason is not None:
                raise CheckpointCorrupt(
                    f"checkpoint {self.step_dir(step)} is damaged: {reason}",
                    step=step, reason=reason,
                ) from e
            if not isinstance(e, ValueError | KeyError | TypeError):
                raise
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this model: "
                f"{_first_line(e)}"
            ) from e

    def close(self) -> None:
        """Finish pending work and release the manager; the object is unusable after.

        Examples:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(1, {"w": jnp.ones(2)})
            >>> ckpt.close()
        """
        self._manager.wait_until_finished()
        self._manager.close()
