"""Start-up checks of a training run, before anything compiles.

:func:`meshkit.train.train` calls these first, so that a run which cannot finish says so
in one line (a :class:`~meshkit.config.ConfigError` naming the key or path) instead of
failing after minutes of compiling and training:

* :func:`check_workdir`: ``train.workdir`` is (or can become) a writable directory; what a
  previous run left there — ``checkpoints/``, ``config.yaml``, ``metrics.jsonl``,
  ``tensorboard/`` — is of the right kind, the checkpoints come with their config, that
  config parses and describes the same model, and every checkpoint is complete.
* :func:`check_memory`: a lower bound of the memory the run needs on this host, against
  the host's memory.

JAX-free: the caller passes the platform and device counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from fractions import Fraction

from meshkit._fs import unwritable
from meshkit.config import Config, ConfigError, ModelConfig, read_config_file

__all__ = [
    "DeviceMemory",
    "MemoryEstimate",
    "check_memory",
    "check_workdir",
    "device_memory",
    "estimate_memory",
    "host_memory",
]

# What a run keeps in its workdir.
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
# orbax writes this last into a step's folder: without it the step is not a checkpoint.
_CHECKPOINT_MARKER = "_CHECKPOINT_METADATA"

# Keys whose change breaks "a resumed run continues exactly as if never stopped".
_EXACT_RESUME_KEYS = ("data.", "train.seed", "train.batch_size", "train.seq_len")


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
            not parse or describes another model; an incomplete checkpoint. Each message
            names the path.

    Example:
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
    incomplete = [s for s in steps if not os.path.isfile(
        os.path.join(checkpoints, str(s), _CHECKPOINT_MARKER))]
    if incomplete:
        folder = os.path.join(checkpoints, str(incomplete[0]))
        what = ("an empty directory" if os.path.isdir(folder) and not os.listdir(folder)
                else f"no {_CHECKPOINT_MARKER} in it")
        complete = [s for s in steps if s not in incomplete]
        then = f"resume from step {complete[-1]}" if complete else "start afresh"
        also = f" (and {len(incomplete) - 1} more such)" if len(incomplete) > 1 else ""
        raise _fail(
            f"checkpoint {folder} is incomplete ({what}){also}: delete it to {then}"
        )


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
    model = [c for c in changed if c[0].startswith("model.")]
    if model:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in model)
        raise ConfigError(
            f"workdir {workdir} holds a run with a different model ({detail}); "
            "use another train.workdir or the same model settings"
        )
    inexact = [c for c in changed if c[0].startswith(_EXACT_RESUME_KEYS)]
    if inexact and lead:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in inexact)
        print(f"meshkit train: warning: resuming {workdir} with changed {detail}; the run "
              "will not continue exactly as the saved one would have", file=sys.stderr)


# ---------------------------------------------------------------------------- memory


WORD = 4  # float32 parameters, gradients and moments; activations counted at float32 too


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device holds during a training step, in bytes, as its roles split it.

    Attributes:
        params: the parameters.
        optimizer: the AdamW moments (two per parameter).
        gradients: one gradient per parameter.
        logits: the output logits of the device's tokens (its vocabulary share).
        attention: the attention weights of every layer of the stage.
        expert_buffers: the MoE dispatch buffers and expert hidden states.
        residual: the residual stream of every layer of the stage (two per layer).
    """

    params: int
    optimizer: int
    gradients: int
    logits: int
    attention: int
    expert_buffers: int
    residual: int

    @property
    def state(self) -> int:
        """Parameters and optimizer moments: what ``init_state`` places on the device."""
        return self.params + self.optimizer

    @property
    def activations(self) -> int:
        """Logits, attention weights, expert buffers and residual activations."""
        return self.logits + self.attention + self.expert_buffers + self.residual

    @property
    def total(self) -> int:
        """Everything: state, gradients and activations."""
        return self.state + self.gradients + self.activations


def device_memory(
    model: ModelConfig,
    *,
    sequences: int,
    seq_len: int,
    tensor: int = 1,
    fsdp: int = 1,
    pipeline: int = 1,
    expert: int = 1,
    microbatches: int = 1,
) -> DeviceMemory:
    """One device's bytes of a training step, split as each role splits them.

    Parameters are split as :class:`meshkit.sharding.ShardingRules` splits them: heads
    and vocabulary over the tensor ways, the model width over fsdp, experts over the
    expert ways, layers over the pipeline; norm scales replicated. Activations are counted
    at one float32 copy each (the real peak is higher: temporaries, fusion buffers). The
    one function behind :func:`estimate_memory` and the planner (:mod:`meshkit.plan`).

    Args:
        model: the model section.
        sequences: sequences per device per step (the global batch over the batch ways).
        seq_len: tokens per sequence.
        tensor, fsdp, pipeline, expert: how many ways each role splits (the product of
            its axes' sizes).
        microbatches: pipeline microbatches per step.

    Returns:
        The :class:`DeviceMemory`.

    Example:
        >>> from meshkit.config import ModelConfig
        >>> m = device_memory(ModelConfig(), sequences=4, seq_len=64, expert=8)
        >>> m.params, m.optimizer == 2 * m.params
        (341248, True)
    """
    v, d, f, e, k = model.vocab_size, model.d_model, model.d_ff, model.num_experts, model.top_k
    layers = model.num_layers // pipeline  # the blocks of one pipeline stage
    n = sequences * seq_len
    per_layer = (4 * d * d // (tensor * fsdp) + d * e // fsdp + 2 * d  # attention, router, norms
                 + 3 * d * model.num_shared_experts * f // fsdp)  # shared experts
    dense = 2 * v * d // (tensor * fsdp) + d + layers * per_layer  # embedding, head, norm
    experts = layers * 3 * e * d * f // (expert * fsdp)
    params = (dense + experts) * WORD
    # Slots per expert on one device for one microbatch, as meshkit.moe.capacity computes
    # them (exactly, so a capacity factor of 1e300 gives a huge int, not an OverflowError);
    # dropless (0) sizes every expert for all the tokens.
    moe_tokens = n // (microbatches * tensor)  # what one device routes per microbatch
    if model.capacity_factor == 0:
        capacity = moe_tokens
    else:
        capacity = math.ceil(Fraction(str(model.capacity_factor)) * moe_tokens * k / e)
    return DeviceMemory(
        params=params,
        optimizer=2 * params,
        gradients=params,
        logits=n * v // tensor * WORD,
        attention=layers * sequences * model.num_heads // tensor * seq_len**2 * WORD,
        expert_buffers=layers * microbatches * e * capacity * (d + 2 * f) * WORD,
        residual=layers * 2 * n * d * WORD,
    )


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A lower bound of the bytes a run holds on one host, term by term.

    Attributes:
        terms: ``(what, the config keys that set it, bytes)``, largest first.
        total: the sum of the terms.
    """

    terms: tuple[tuple[str, str, int], ...]
    total: int


def estimate_memory(config: Config, *, platform: str, local_devices: int) -> MemoryEstimate:
    """A lower bound of the host memory one process of a run needs.

    Counted: the global batch each process builds on the host; and, when the devices are
    the host's own CPU cores (``platform == "cpu"``), each device's parameters, gradients
    and AdamW moments (split as each axis's role splits them: experts over the expert
    devices, heads and vocabulary over the tensor axes, the width over fsdp, layers over
    the pipeline), logits, attention weights, expert buffers and residual activations, at
    one copy each. The real peak is higher (temporaries, fusion buffers), so a run this
    estimate rejects could never run.

    Args:
        config: the run's config.
        platform: ``jax.devices()[0].platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``).
        local_devices: the mesh's devices in this process.

    Returns:
        The estimate.

    Example:
        >>> e = estimate_memory(Config(), platform="cpu", local_devices=8)
        >>> [what for what, _, _ in e.terms][:2], round(e.total / 2**20, 1)
        (['expert buffers', 'parameters, gradients and AdamW moments'], 29.1)
        >>> estimate_memory(Config(), platform="gpu", local_devices=8).terms[0][0]
        'the global batch'
    """
    t, shape = config.train, config.strategy().shape

    def ways(role: str) -> int:
        return math.prod(shape[a] for a in config.axes_with_role(role))

    mem = device_memory(
        config.model, sequences=t.batch_size // config.batch_devices, seq_len=t.seq_len,
        tensor=ways("tensor"), fsdp=ways("fsdp"), pipeline=ways("pipeline"),
        expert=config.num_expert_devices, microbatches=config.parallel.microbatches,
    )
    host_batch = ("the global batch", "train.batch_size × train.seq_len",
                  t.batch_size * (t.seq_len + 1) * 8)
    terms = [host_batch]
    if platform == "cpu":
        per_device = [
            ("parameters, gradients and AdamW moments",
             "model.d_model, model.d_ff, model.num_experts, model.vocab_size, "
             "model.num_layers", mem.state + mem.gradients),
            ("logits", "train.batch_size × train.seq_len × model.vocab_size", mem.logits),
            ("attention weights",
             "train.batch_size × train.seq_len² × model.num_heads × model.num_layers",
             mem.attention),
            ("expert buffers",
             "model.capacity_factor × train.batch_size × train.seq_len × model.top_k × "
             "model.d_model, model.d_ff", mem.expert_buffers),
            ("residual activations",
             "train.batch_size × train.seq_len × model.d_model × model.num_layers",
             mem.residual),
        ]
        terms += [(what, keys, local_devices * size) for what, keys, size in per_device]
    terms.sort(key=lambda term: -term[2])
    return MemoryEstimate(tuple(terms), sum(size for _, _, size in terms))


def host_memory() -> int | None:
    """This host's memory in bytes, capped by a cgroup (container) limit; ``None`` if
    unknown.

    Returns:
        The smaller of the physical memory and the cgroup v2 or v1 memory limit.

    Example:
        >>> (host_memory() or 1) > 0
        True
    """
    sizes = []
    with contextlib.suppress(ValueError, OSError, AttributeError):  # not on every OS
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            sizes.append(int(text))
    return min(sizes) if sizes else None


def _format_bytes(n: int) -> str:
    if n.bit_length() > 70:
        return f"about 2^{n.bit_length() - 1} bytes"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{size:,.1f} EiB"


def check_memory(
    config: Config,
    *,
    platform: str,
    local_devices: int,
    host_bytes: int | None = None,
) -> MemoryEstimate:
    """Refuse a run whose memory lower bound exceeds this host's memory.

    Args:
        config: the run's config.
        platform: the devices' platform (see :func:`estimate_memory`).
        local_devices: the mesh's devices in this process.
        host_bytes: the host's memory (default :func:`host_memory`; unknown: no check).

    Returns:
        The estimate.

    Raises:
        ConfigError: the estimate exceeds ``host_bytes``; the message starts with the
            key of the largest term and lists what it counted.

    Example:
        >>> check_memory(Config(), platform="cpu", local_devices=8, host_bytes=2**34).total > 0
        True
    """
    estimate = estimate_memory(config, platform=platform, local_devices=local_devices)
    host_bytes = host_memory() if host_bytes is None else host_bytes
    if host_bytes is not None and estimate.total > host_bytes:
        what, keys, size = estimate.terms[0]
        key = keys.split(" ")[0].rstrip(",")
        raise ConfigError(
            f"{key}: the run needs at least {_format_bytes(estimate.total)} of memory on this "
            f"host, which has {_format_bytes(host_bytes)}; the largest part is {what} "
            f"({_format_bytes(size)}, from {keys})"
        )
    return estimate
