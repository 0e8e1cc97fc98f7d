"""Orbax checkpoints of a sharded training state.

A thin wrapper over ``orbax.checkpoint.CheckpointManager``: save a pytree of (possibly
sharded, possibly multi-process) arrays under ``<workdir>/checkpoints/<step>``, keep the
newest few, and restore onto the shardings of an abstract target, so a checkpoint
written by one process layout restores into another with the same global shapes.
Saves are synchronous: when :meth:`Checkpointer.save` returns, the step is on disk
(a run that dies right after never loses a checkpoint it reported).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save and restore training states by step.

    Args:
        directory: where the step folders live (created if missing).
        keep: how many of the newest checkpoints to keep (≥ 1).

    Raises:
        ValueError: ``keep`` < 1.

    Example:
        >>> ckpt = Checkpointer("/tmp/run/checkpoints", keep=2)  # doctest: +SKIP
        >>> ckpt.save(100, {"params": params})  # doctest: +SKIP
        >>> ckpt.restore(ckpt.latest_step(), abstract)  # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1, got {keep}")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` if there is none.

        Returns:
            A step number or ``None``.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every kept checkpoint's step, oldest first.

        Returns:
            Sorted step numbers.
        """
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Write ``state`` as checkpoint ``step`` (overwriting nothing).

        Args:
            step: the training step the state is *after*.
            state: a pytree of arrays.

        Raises:
            ValueError: a checkpoint for ``step`` exists already.
        """
        if step in self._manager.all_steps():
            raise ValueError(f"a checkpoint for step {step} exists already in {self.directory}")
        self._manager.save(step, args=ocp.args.StandardSave(state))
        self._manager.wait_until_finished()

    def restore(self, step: int, target: Any) -> Any:
        """Read checkpoint ``step`` onto the shapes, dtypes and shardings of ``target``.

        Args:
            step: a step from :meth:`all_steps`.
            target: a pytree of arrays or ``jax.ShapeDtypeStruct`` with shardings.

        Returns:
            The restored pytree, sharded like ``target``.

        Raises:
            ValueError: no checkpoint at ``step``, or one whose structure or shapes
                differ from ``target``'s (a different model config).
        """
        if step not in self._manager.all_steps():
            raise ValueError(
                f"no checkpoint for step {step} in {self.directory} "
                f"(have {self.all_steps()})"
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint {step} in {self.directory} does not match this model: {e}"
            ) from e

    def close(self) -> None:
        """Finish pending work and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
