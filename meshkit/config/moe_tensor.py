"""What the tensor axes split in an MoE layer: its tokens or its experts' hidden width.

``parallel.moe_tensor`` (:data:`meshkit.choices.MOE_TENSOR_MODES`):

* ``tokens``: each tensor rank routes and runs its own ``1/t`` of the (replicated)
  tokens with whole experts, and the outputs are all-gathered. Each rank holds every
  local expert whole.
* ``ffn``: every tensor rank routes the same tokens and runs the same exchange, but
  holds ``1/t`` of each expert's hidden width (Megatron-core's expert tensor
  parallelism): column-parallel gate and up, row-parallel down, and one all-reduce of
  the combined ``[n, d]`` outputs (the combine is linear, so summing after it moves
  ``k·c`` times fewer bytes than summing the experts' rows).
* ``auto``: :func:`choose` weighs both with the exchange's cost model.

Per MoE layer and device, with ``n`` tokens, ``k`` experts per token, capacity factor
``c``, ``E/P`` local experts of width ``f`` and ``t`` tensor ranks, ``ffn`` holds
``(1 − 1/t)·3·(E/P)·d·f`` fewer weights (each with its gradient and two AdamW moments)
and ``c·k·n·2·d·(1 − 1/t)`` more kept activations (the rows it dispatches are all ``n``
tokens', not ``n/t``); it sends ``t`` times the exchange's bytes and all-reduces where
``tokens`` all-gathers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from meshkit.exchange import cost

if TYPE_CHECKING:
    from meshkit.config import Config

__all__ = ["Choice", "choose", "picked", "resolve"]

# A weight's bytes with its gradient and AdamW's two moments, float32.
_STATE_BYTES = 16
_FLOAT = 4
# Exchanges per MoE layer and step: dispatch and combine, forward and backward.
_EXCHANGES = 4


@dataclasses.dataclass(frozen=True)
class Choice:
    """The two modes' predicted cost per device, and the pick.

    Attributes:
        mode: ``"tokens"`` or ``"ffn"``.
        seconds: mode → predicted communication and expert compute seconds per step.
        bytes: mode → expert weights (with gradients and AdamW moments) plus the
            activations the MoE layers keep, per device.
    """

    mode: str
    seconds: dict[str, float]
    bytes: dict[str, float]

    def describe(self) -> str:
        """One line for the start-up log.

        Examples:
            >>> line = Choice("ffn", {"tokens": 1e-3, "ffn": 1.02e-3},
            ...               {"tokens": 40 * 2**20, "ffn": 12 * 2**20}).describe()
            >>> for part in line.split("; "):
            ...     print(part)
            ffn (cost model: 2.0 % slower than tokens
            MoE memory 12.0 MiB per device against 40.0)
        """
        other = "tokens" if self.mode == "ffn" else "ffn"
        change = (self.seconds[self.mode] / self.seconds[other] - 1) * 100
        pace = f"{abs(change):.1f} % {'slower' if change > 0 else 'faster'} than {other}"
        mib = 2**20
        return (f"{self.mode} (cost model: {pace}; MoE memory "
                f"{self.bytes[self.mode] / mib:.1f} MiB per device against "
                f"{self.bytes[other] / mib:.1f})")


def choose(config: Config) -> Choice:
    """Pick ``tokens`` or ``ffn`` for a config's MoE layers.

    The mode that holds less memory per device, unless it is predicted more than
    :data:`meshkit.exchange.cost.CHOOSE_MARGIN` (5 %) slower than the other; then the
    faster. Time counts the exchanges (:func:`meshkit.exchange.cost.predict` on the
    config's topology, ``exchange.topology``), the tensor collectives (ring all-gather
    or all-reduce on the node's link) and the experts' matmuls.

    Args:
        config: a validated config with MoE layers and tensor axes.

    Returns:
        The :class:`Choice`.

    Examples:
        >>> from meshkit.config import load_config
        >>> config = load_config(None, ["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp",
        ...     "exchange.node_axis=[]", "exchange.device_axis=[]"])
        >>> choose(config).mode  # 256 tokens a device: latency decides
        'tokens'
        >>> wide = config.replace(model={"d_model": 4096, "d_ff": 14336},
        ...                       train={"seq_len": 4096})
        >>> choose(wide).mode  # the matmuls decide, and ffn holds a quarter of the experts
        'ffn'
    """
    m, shape = config.model, config.strategy().shape
    t = math.prod(shape[a] for a in config.axes_with_role("tensor"))
    nodes = math.prod(shape[a] for a in config.node_axes)
    devices = math.prod(shape[a] for a in config.device_axes)
    topology = (cost.default_topology(nodes, devices) if config.exchange.topology is None
                else cost.load_topology(config.exchange.topology, nodes=nodes,
                                        devices_per_node=devices))
    local = config.train.batch_size // config.batch_devices // config.parallel.microbatches
    n = local * config.train.seq_len
    d, f, k = m.d_model, m.d_ff, m.top_k
    rows = max(m.capacity_factor, 1.0) * k * n  # dispatched rows per device, all tensor ranks'
    local_experts = m.num_experts // (nodes * devices)
    layers = m.num_layers - m.dense_layers
    flops_per_s = topology.flops_per_s or 1e15
    link = topology.intra

    def ring(bytes_: float) -> float:  # one all-gather (or reduce-scatter) over t ranks
        return (t - 1) * link.latency_s + (t - 1) / t * bytes_ / link.bandwidth_Bps

    def exchange(bytes_: float) -> float:
        if nodes * devices == 1:
            return 0.0
        return cost.predict("flat", bytes_, topology) * _EXCHANGES

    experts_flops = 6 * rows * 3 * d * f
    seconds = {
        "tokens": exchange(rows / t * d * _FLOAT) + 3 * ring(n * d * _FLOAT)
        + experts_flops / t / flops_per_s,
        "ffn": exchange(rows * d * _FLOAT) + 4 * ring(n * d * _FLOAT)
        + experts_flops / t / flops_per_s,
    }
    weights = 3 * local_experts * d * f * _STATE_BYTES
    bytes_ = {
        "tokens": weights + rows / t * (2 * d + 2 * f) * _FLOAT,
        "ffn": weights / t + rows * (2 * d + 2 * f / t) * _FLOAT,
    }
    seconds = {mode: s * layers for mode, s in seconds.items()}
    bytes_ = {mode: b * layers for mode, b in bytes_.items()}
    lean = min(bytes_, key=bytes_.__getitem__)
    fast = min(seconds, key=seconds.__getitem__)
    mode = lean if seconds[lean] <= seconds[fast] * (1 + cost.CHOOSE_MARGIN) else fast
    return Choice(mode, seconds, bytes_)


def resolve(config: Config) -> str:
    """``parallel.moe_tensor`` as the model runs it: ``tokens`` or ``ffn``.

    ``auto`` asks :func:`choose` where there are MoE layers and tensor axes; with no
    tensor axes both modes are the same, and ``tokens`` is returned.

    Args:
        config: a validated config.

    Returns:
        ``"tokens"`` or ``"ffn"``.

    Examples:
        >>> from meshkit.config import Config
        >>> resolve(Config())
        'tokens'
    """
    mode = config.parallel.moe_tensor
    if mode != "auto":
        return mode
    if not config.axes_with_role("tensor") or config.model.num_experts == 0:
        return "tokens"
    return choose(config).mode


def picked(config: Config) -> str | None:
    """What ``auto`` picked and why, for the start-up line; ``None`` where the config
    names the mode or nothing is picked (no MoE layers or no tensor axes).

    Args:
        config: a validated config.

    Returns:
        :meth:`Choice.describe`'s line, or ``None``.

    Examples:
        >>> from meshkit.config import Config
        >>> picked(Config()) is None
        True
    """
    if (config.parallel.moe_tensor != "auto" or not config.axes_with_role("tensor")
            or config.model.num_experts == 0):
        return None
    return choose(config).describe()
