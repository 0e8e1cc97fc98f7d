"""Start-up checks of a training run, before anything compiles.

:func:`meshkit.training.train` calls these first, so that a run which cannot finish says so
in one line (a :class:`~meshkit.config.ConfigError` naming the key or path) instead of
failing after minutes of compiling and training:

* :func:`check_workdir`: ``train.workdir`` is (or can become) a writable directory; what a
  previous run left there — ``checkpoints/``, ``config.yaml``, ``metrics.jsonl``,
  ``tensorboard/`` — is of the right kind, the checkpoints come with their config, that
  config parses and describes the same model (a damaged checkpoint is not refused here:
  :mod:`meshkit.training.recovery` moves it aside).
* :func:`check_memory`: a lower bound of the memory the run needs on this host, against
  the host's memory. For meshkit's transformer the lower bound is
  :func:`meshkit.plan.memory.estimate_memory`'s; for a user's model, whose activations
  meshkit cannot know, it is the batch and the real bytes of the parameters, their
  gradients and the optimizer state (:class:`StateBytes`, from the abstract state).

JAX-free: the caller passes the platform and device counts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from meshkit._fs import unwritable
from meshkit.config import Config, ConfigError, read_config_file
from meshkit.plan.memory import MemoryEstimate, estimate_memory, host_memory
from meshkit.units import format_bytes

__all__ = ["StateBytes", "check_memory", "check_workdir"]

_log = logging.getLogger(__name__)

# What a run keeps in its workdir.
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"

# Keys whose change breaks "a resumed run continues exactly as if never stopped".
_EXACT_RESUME_KEYS = ("data.", "train.seed", "train.batch_size", "train.seq_len", "model.loss")
# Keys of the model section that do not change the model (its parameters).
_NOT_THE_MODEL = ("model.loss", "model.flops_per_token")


def _fail(message: str) -> ConfigError:
    return ConfigError(f"train.workdir: {message}")


def check_workdir(config: Config, *, lead: bool = True) -> str:
    """Check ``train.workdir`` and what a previous run left in it, then create it.

    Args:
        config: the run's config.
        lead: whether this is process 0 (only it prints warnings).

    Returns:
        The workdir's absolute path (which exists when this returns).

    Raises:
        ConfigError: the workdir or a folder above it is not a directory, or is not
            writable; ``checkpoints``, ``metrics.jsonl`` or ``tensorboard`` is of the
            wrong kind; checkpoints without ``config.yaml``; a ``config.yaml`` that does
            not parse or describes another model. Each message names the path.

    Examples:
        >>> import tempfile
        >>> workdir = os.path.join(tempfile.mkdtemp(), "run")
        >>> check_workdir(Config().replace(train={"workdir": workdir})) == workdir
        True
    """
    workdir = os.path.abspath(config.train.workdir)
    _check_creatable(workdir)
    if os.path.isdir(workdir):
        _check_contents(workdir, config, lead=lead)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:  # a race with another process, or a full disk
        raise _fail(f"cannot create {workdir}: {e.strerror}") from None
    return workdir


def _check_creatable(workdir: str) -> None:
    if os.path.exists(workdir):
        if not os.path.isdir(workdir):
            raise _fail(f"{workdir} exists and is not a directory")
        reason = unwritable(workdir)
        if reason is not None:
            raise _fail(f"{workdir} is not writable ({reason})")
        return
    parent = os.path.dirname(workdir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _fail(f"cannot create {workdir}: {parent} is not a directory")
    reason = unwritable(parent)
    if reason is not None:
        raise _fail(f"cannot create {workdir}: {parent} is not writable ({reason})")


def _check_contents(workdir: str, config: Config, *, lead: bool) -> None:
    checkpoints = os.path.join(workdir, CHECKPOINTS_DIR)
    saved = os.path.join(workdir, CONFIG_FILE)
    metrics = os.path.join(workdir, METRICS_FILE)
    tensorboard = os.path.join(workdir, TENSORBOARD_DIR)
    for path, kind in ((checkpoints, "directory"), (tensorboard, "directory"),
                       (metrics, "file"), (saved, "file")):
        if os.path.lexists(path) and not (os.path.isdir(path) if kind == "directory"
                                          else os.path.isfile(path)):
            raise _fail(f"{path} is not a {kind}: move it away, or use another train.workdir")
    steps = _checkpoint_steps(checkpoints)
    if os.path.isdir(checkpoints):
        reason = unwritable(checkpoints)
        if reason is not None:
            raise _fail(f"{checkpoints} is not writable ({reason})")
    if os.path.exists(saved):
        _check_saved_config(saved, config, workdir, lead=lead)
    elif steps:
        raise _fail(
            f"{checkpoints} holds checkpoints {steps} but {saved} is missing, so nothing "
            "says which model they belong to; restore config.yaml or use another "
            "train.workdir"
        )
    # A damaged or unfinished checkpoint is no reason to refuse the run: the restore
    # moves it aside and resumes from the previous one (meshkit.training.recovery).


def _checkpoint_steps(checkpoints: str) -> list[int]:
    """The step folders orbax would list (names that are numbers), oldest first."""
    if not os.path.isdir(checkpoints):
        return []
    return sorted(int(name) for name in os.listdir(checkpoints)
                  if name.isdigit() and name.isascii())


def _check_saved_config(path: str, config: Config, workdir: str, *, lead: bool) -> None:
    """Refuse a damaged config.yaml or another model; warn about inexact resumption."""
    try:
        saved = read_config_file(path)
    except ConfigError as e:
        raise _fail(f"the saved config is damaged: {e}") from None
    current = config.to_dict()
    problem = None
    if not isinstance(saved, Mapping):
        problem = f"a {type(saved).__name__}, not a mapping of sections"
    else:
        # A section another meshkit version did not write may be absent; one that is
        # there must be a mapping, and the model must be there to compare it.
        empty = [s for s in current if (s in saved or s == "model")
                 and not isinstance(saved.get(s), Mapping)]
        if empty:
            problem = f"section {empty[0]!r} is missing or empty"
        else:
            try:
                Config.from_dict(saved)
            except ConfigError as e:
                problem = str(e)
    if problem is not None:
        raise _fail(
            f"the saved config {path} is damaged ({problem}); repair it, or use another "
            "train.workdir"
        )
    changed = [
        (f"{section}.{key}", saved[section][key], value)
        for section, keys in current.items()
        for key, value in keys.items()
        if key in saved.get(section, {}) and saved[section][key] != value
    ]
    model = [c for c in changed if c[0].startswith("model.") and c[0] not in _NOT_THE_MODEL]
    if model:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in model)
        raise ConfigError(
            f"workdir {workdir} holds a run with a different model ({detail}); "
            "use another train.workdir or the same model settings"
        )
    inexact = [c for c in changed if c[0].startswith(_EXACT_RESUME_KEYS)]
    if inexact and lead:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in inexact)
        _log.warning(f"meshkit: warning: resuming {workdir} with changed {detail}; "
                     "the run will not continue exactly as the saved one would have")


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """One device's bytes of a model's training state (the device holding the most).

    Attributes:
        params: the model's variables (its parameters, and any other state).
        optimizer: the optimizer's state (moments, counters).

    Examples:
        >>> StateBytes(params=4, optimizer=8).total  # a gradient per parameter too
        16
    """

    params: int
    optimizer: int

    @property
    def total(self) -> int:
        """Parameters, one gradient per parameter, and the optimizer state."""
        return 2 * self.params + self.optimizer


def check_memory(
    config: Config,
    *,
    platform: str,
    local_devices: int,
    host_bytes: int | None = None,
    state: StateBytes | None = None,
) -> MemoryEstimate:
    """Refuse a run whose memory lower bound exceeds this host's memory.

    Args:
        config: the run's config.
        platform: the devices' platform (see :func:`estimate_memory`).
        local_devices: the mesh's devices in this process.
        host_bytes: the host's memory (default :func:`host_memory`; unknown: no check).
        state: for a model other than meshkit's transformer, one device's bytes of its
            state (:func:`meshkit.training.programs.state_bytes`): then the lower bound is
            the global batch and, on CPU devices, the parameters, gradients and optimizer
            state of each local device; activations are not counted, since meshkit
            cannot know them (``None``: meshkit's transformer, estimated from
            ``config.model``).

    Returns:
        The estimate.

    Raises:
        ConfigError: the estimate exceeds ``host_bytes``; the message starts with the
            key of the largest term and lists what it counted.

    Examples:
        >>> check_memory(Config(), platform="cpu", local_devices=8, host_bytes=2**34).total > 0
        True
        >>> check_memory(Config(), platform="cpu", local_devices=8, host_bytes=2**20,
        ...              state=StateBytes(params=2**20, optimizer=2**21))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshkit.config.values.ConfigError: model.factory: the run needs at least 32.0 MiB ...
    """
    if state is None:
        estimate = estimate_memory(config, platform=platform, local_devices=local_devices)
    else:
        estimate = _state_estimate(config, state, platform=platform,
                                   local_devices=local_devices)
    host_bytes = host_memory() if host_bytes is None else host_bytes
    if host_bytes is not None and estimate.total > host_bytes:
        what, keys, size = estimate.terms[0]
        key = keys.split(" ")[0].rstrip(",")
        raise ConfigError(
            f"{key}: the run needs at least {format_bytes(estimate.total)} of memory on this "
            f"host, which has {format_bytes(host_bytes)}; the largest part is {what} "
            f"({format_bytes(size)}, from {keys})"
        )
    return estimate


def _state_estimate(config: Config, state: StateBytes, *, platform: str,
                    local_devices: int) -> MemoryEstimate:
    """The lower bound for a model meshkit knows only by its state's bytes."""
    t = config.train
    terms = [("the global batch", "train.batch_size × train.seq_len",
              t.batch_size * (t.seq_len + 1) * 8)]
    if platform == "cpu":
        terms.append(("parameters, gradients and optimizer state", "model.factory",
                      local_devices * state.total))
    terms.sort(key=lambda term: -term[2])
    return MemoryEstimate(tuple(terms), sum(size for _, _, size in terms))
