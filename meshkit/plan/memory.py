"""Memory of a config: one device's bytes of a training step, and a host's lower bound.

:func:`device_memory` is the one count behind the planner (:mod:`meshkit.plan.planner`) and
the trainer's start-up check (:func:`meshkit.training.preflight.check_memory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from meshkit.config import Config, ModelConfig
from meshkit.exchange.capacity import capacity

__all__ = ["WORD", "DeviceMemory", "MemoryEstimate", "device_memory", "estimate_memory",
           "host_memory"]

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

    Parameters are split as :class:`meshkit.sharding.rules.ShardingRules` splits them: heads
    and vocabulary over the tensor ways, the model width over fsdp, experts over the
    expert ways, layers over the pipeline; norm scales replicated. Activations are counted
    at one float32 copy each (the real peak is higher: temporaries, fusion buffers). The
    one function behind :func:`estimate_memory` and the planner (:mod:`meshkit.plan.planner`).

    Args:
        model: the model section.
        sequences: sequences per device per step (the global batch over the batch ways).
        seq_len: tokens per sequence.
        tensor, fsdp, pipeline, expert: how many ways each role splits (the product of
            its axes' sizes).
        microbatches: pipeline microbatches per step.

    Returns:
        The :class:`DeviceMemory`.

    Examples:
        >>> from meshkit.config import ModelConfig
        >>> m = device_memory(ModelConfig(), sequences=4, seq_len=64, expert=8)
        >>> m.params, m.optimizer == 2 * m.params
        (341248, True)
    """
    v, d, f, e, k = model.vocab_size, model.d_model, model.d_ff, model.num_experts, model.top_k
    layers = model.num_layers // pipeline  # the blocks of one pipeline stage
    n = sequences * seq_len
    # q and the output d×d each; k and v d×(kv heads · head width) each (GQA).
    attention = (2 * d * d + 2 * d * model.kv_heads * (d // model.num_heads)) // (tensor * fsdp)
    # The first dense_layers of an MoE model are dense (no pipeline then), all of a dense one.
    moe_layers = max(layers - model.dense_layers, 0) if e else 0
    mlp = (3 if model.mlp == "swiglu" else 2) * d * f // (tensor * fsdp)
    moe_rest = d * e // fsdp + 3 * d * model.num_shared_experts * f // fsdp  # router, shared
    blocks = layers * (attention + 2 * d) + (layers - moe_layers) * mlp + moe_layers * moe_rest
    dense = 2 * v * d // (tensor * fsdp) + d + blocks  # embedding, head, final norm
    experts = moe_layers * 3 * e * d * f // (expert * fsdp)
    params = (dense + experts) * WORD
    moe_tokens = n // (microbatches * tensor)  # what one device routes per microbatch
    slots = (capacity(moe_tokens, num_experts=e, top_k=k, capacity_factor=model.capacity_factor)
             if moe_tokens and e else 0)
    return DeviceMemory(
        params=params,
        optimizer=2 * params,
        gradients=params,
        logits=n * v // tensor * WORD,
        attention=layers * sequences * model.num_heads // tensor * seq_len**2 * WORD,
        expert_buffers=moe_layers * microbatches * e * slots * (d + 2 * f) * WORD,
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

    Examples:
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
        # Each context device holds T/c of every sequence (a lower bound: the attention
        # of its T/c queries over T/c keys at a time).
        config.model, sequences=t.batch_size // config.batch_devices,
        seq_len=t.seq_len // config.context_devices,
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

    Examples:
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
