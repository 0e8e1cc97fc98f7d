"""Model FLOPs of one training token, counted term by term for meshkit's transformer.

This is the "6·N" accounting (Kaplan et al. 2020, §2.1; PaLM, Chowdhery et al. 2022,
appendix B) made exact for :class:`meshkit.model.transformer.Transformer`. A matrix product
``[m, k] @ [k, n]`` costs ``2·m·k·n`` FLOPs; the backward pass costs twice the forward
(one product for the input gradient and one for the weight gradient), so a training
token costs ``3×`` its forward FLOPs. Per token and per block, with ``d = d_model``,
``T = seq_len``, ``E`` experts, ``k = top_k``, ``f = d_ff`` and ``S`` shared experts:

===============  ==================  ==================================================
term             forward FLOPs       why
===============  ==================  ==================================================
attention        ``8·d²``            QKV projection ``6·d²`` and output projection ``2·d²``
scores           ``4·T·d``           ``q·kᵀ`` and ``weights·v`` over all ``T`` positions:
                                     the model computes the full square and masks it,
                                     so the causal half is counted too (as PaLM does)
router           ``2·d·E``           the gating logits
routed experts   ``k · 6·d·f``       a SwiGLU (gate, up, down) per chosen expert
shared experts   ``S · 6·d·f``       one dense SwiGLU of width ``S·f``
===============  ==================  ==================================================

plus the output head ``2·d·V`` once per token. The embedding lookup, norms, rotary,
softmax and the exchange's data movement are not model FLOPs. Nor is capacity padding:
an MoE that pads its buffers to ``capacity_factor`` does extra arithmetic that is not
counted, so MFU measures useful work.

Numbers only: no JAX at import, so the planner (:mod:`meshkit.plan.planner`) can use it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshkit.config import ModelConfig

# bf16 dense tensor-core peak per device, FLOP/s, without sparsity, from the vendors'
# data sheets: A100 SXM 312 TFLOP/s (NVIDIA A100 Tensor Core GPU datasheet, 2021);
# H100 SXM 989 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet, 2023; the 1,979 there
# is with 2:4 sparsity); H200 SXM 989 TFLOP/s (NVIDIA H200 datasheet, 2024, same
# tensor cores as H100). Matched against `jax.Device.device_kind`, case-insensitively.
PEAK_BF16_FLOPS: dict[str, float] = {
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}

TRAINING_MULTIPLIER = 3  # forward + backward (2× forward): Kaplan et al. 2020, §2.1


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs of one token, by term (see the module docstring for each formula).

    Attributes:
        attention: QKV and output projections, all blocks.
        scores: attention scores and the weighted sum of values, all blocks.
        router: gating logits, all blocks.
        experts: the ``top_k`` routed experts, all blocks.
        shared: the shared experts, all blocks.
        head: the output projection to the vocabulary.
    """

    attention: int
    scores: int
    router: int
    experts: int
    shared: int
    head: int

    @property
    def forward(self) -> int:
        """Forward FLOPs per token: the sum of the terms."""
        return sum(dataclasses.astuple(self))

    @property
    def training(self) -> int:
        """Training FLOPs per token: forward and backward."""
        return TRAINING_MULTIPLIER * self.forward


def flops_per_token(model: ModelConfig, *, seq_len: int) -> FlopsPerToken:
    """Count the forward FLOPs of one token of ``model`` at sequence length ``seq_len``.

    Args:
        model: the ``model`` section of a :class:`meshkit.config.Config`.
        seq_len: tokens per sequence (the attention span).

    Returns:
        The :class:`FlopsPerToken` breakdown; ``.training`` is the figure for MFU.

    Raises:
        ValueError: ``seq_len`` below 1.

    Examples:
        >>> from meshkit.config import ModelConfig
        >>> f = flops_per_token(ModelConfig(d_model=64, num_layers=2, d_ff=128,
        ...                                 num_experts=8, top_k=2, vocab_size=16), seq_len=64)
        >>> f.attention, f.training == 3 * f.forward
        (65536, True)
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be a positive integer, got {seq_len!r}")
    d, layers, f = model.d_model, model.num_layers, model.d_ff
    return FlopsPerToken(
        attention=layers * 8 * d * d,
        scores=layers * 4 * seq_len * d,
        router=layers * 2 * d * model.num_experts,
        experts=layers * model.top_k * 6 * d * f,
        shared=layers * model.num_shared_experts * 6 * d * f,
        head=2 * d * model.vocab_size,
    )


@dataclasses.dataclass(frozen=True)
class Utilization:
    """Model FLOP rate of a training run.

    Attributes:
        tflops_per_device: model TFLOP/s per device: tokens/s × training FLOPs per token
            / devices / 1e12.
        mfu: model FLOPs utilisation, ``tflops_per_device`` over the device kind's bf16
            dense peak; ``None`` where the peak is not known (CPUs among them).
    """

    tflops_per_device: float
    mfu: float | None


def utilization(
    tokens_per_s: float, *, training_flops_per_token: float, devices: int, device_kind: str
) -> Utilization:
    """Model TFLOP/s per device, and MFU on a device kind of known peak.

    Args:
        tokens_per_s: global training throughput (all devices together).
        training_flops_per_token: ``flops_per_token(...).training``, or any other count
            of a model's training FLOPs per token (XLA's, a user's).
        devices: devices the run uses (the mesh's size).
        device_kind: ``jax.Device.device_kind`` of those devices.

    Returns:
        A :class:`Utilization`.

    Raises:
        ValueError: ``devices`` below 1.

    Examples:
        >>> u = utilization(1e6, training_flops_per_token=10**9, devices=8,
        ...                 device_kind="NVIDIA H100 80GB HBM3")
        >>> round(u.tflops_per_device, 3), round(u.mfu, 4)
        (125.0, 0.1264)
        >>> utilization(1e6, training_flops_per_token=10**9, devices=8, device_kind="cpu").mfu
    """
    if devices < 1:
        raise ValueError(f"utilization: devices must be >= 1, got {devices}")
    per_device = tokens_per_s * training_flops_per_token / devices
    peak = peak_flops(device_kind)
    return Utilization(per_device / 1e12, None if peak is None else per_device / peak)


def peak_flops(device_kind: str) -> float | None:
    """The bf16 dense peak FLOP/s of one device of a known kind, else ``None``.

    Args:
        device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"``.

    Returns:
        FLOP/s from :data:`PEAK_BF16_FLOPS`, or ``None`` for a kind it does not list
        (CPUs among them), where MFU is not reported.

    Examples:
        >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("cpu")
        (989000000000000.0, None)
    """
    kind = device_kind.lower()
    for name, peak in PEAK_BF16_FLOPS.items():
        if name in kind:
            return peak
    return None
