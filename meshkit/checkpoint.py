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

from meshkit.errors import UsageError

__all__ = ["CheckpointError", "Checkpointer"]


class CheckpointError(UsageError):
    """A checkpoint that cannot be saved or restored as asked (the message names it).

    A ``ValueError``; the CLI reports it in one line with exit code 2.
    """


class Checkpointer:
    """Save and restore training states by step.

    Args:
        directory: where the step folders live (created if missing).
        keep: how many of the newest checkpoints to keep (≥ 1).

    Attributes:
        directory: the absolute path of ``directory``.

    Raises:
        ValueError: ``keep`` < 1.

    Example:
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

        Example:
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

        Example:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=3)
            >>> for step in (1, 3, 5):
            ...     ckpt.save(step, {"w": jnp.ones(2)})
            >>> ckpt.all_steps()
            [1, 3, 5]
        """
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Write ``state`` as checkpoint ``step`` (overwriting nothing).

        Args:
            step: the training step the state is *after*.
            state: a pytree of arrays.

        Raises:
            CheckpointError: a checkpoint for ``step`` or a later step exists already
                (steps only grow: orbax would otherwise skip the save without a word).
            RuntimeError: orbax declined to write the checkpoint.

        Example:
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
        saved = self._manager.save(step, args=ocp.args.StandardSave(state))
        self._manager.wait_until_finished()
        if not saved:
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")

    def restore(self, step: int, target: Any) -> Any:
        """Read checkpoint ``step`` onto the shapes, dtypes and shardings of ``target``.

        Args:
            step: a step from :meth:`all_steps`.
            target: a pytree of arrays or ``jax.ShapeDtypeStruct`` with shardings.

        Returns:
            The restored pytree, sharded like ``target``.

        Raises:
            CheckpointError: no checkpoint at ``step``, or one whose structure or shapes
                differ from ``target``'s (a different model config).

        Example:
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
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except (ValueError, KeyError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this model: {first}"
            ) from e

    def close(self) -> None:
        """Finish pending work and release the manager; the object is unusable after.

        Example:
            >>> import tempfile, jax.numpy as jnp
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> ckpt.save(1, {"w": jnp.ones(2)})
            >>> ckpt.close()
        """
        self._manager.wait_until_finished()
        self._manager.close()
