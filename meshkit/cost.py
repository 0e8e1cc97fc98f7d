"""A latency–bandwidth cost model for flat vs two-stage all-to-all (plain Python).

Notation: ``N`` nodes of ``M`` devices, ``P = N·M``; ``B`` = ``bytes_per_device``, the
whole buffer one device sends (its piece for itself included); ``b = B / P`` one piece.
Links: ``inter`` between nodes (latency ``αe``, bandwidth ``βe``), ``intra`` inside a
node (``αa``, ``βa``); ``βm`` the device's memory bandwidth.

``βe`` is **per device**: the node's total injection bandwidth divided by ``M``. In both
methods all ``M`` devices of a node send across nodes at the same time, so each gets its
share of the node's NICs (with one NIC per GPU, as on the presets, that is one NIC).

Flat — one all-to-all; a device sends ``M−1`` pieces over ``intra`` and ``(N−1)·M``
over ``inter``. The per-message costs are paid one after another (each peer is a step
for the sending device); the bytes on the two links flow at the same time::

    T_flat = (M−1)·αa + (N−1)·M·αe + max((M−1)·b / βa, (N−1)·M·b / βe)

Hierarchical (``N > 1`` and ``M > 1``) — the node stage sends ``N−1`` messages of ``M``
pieces over ``inter``; the device stage sends ``M−1`` messages of ``N`` pieces over
``intra``; the stages run one after the other; and the pieces are regrouped twice in
local memory (between the stages and at the end), each copy reading and writing ``B``::

    T_node   = (N−1)·αe + (N−1)·M·b / βe        (= (N−1)·αe + B·(N−1)/N / βe)
    T_device = (M−1)·αa + (M−1)·N·b / βa        (= (M−1)·αa + B·(M−1)/M / βa)
    T_copy   = 2 · 2·B / βm
    T_hier   = T_node + T_device + T_copy

With ``N == 1`` or ``M == 1`` the two-stage exchange is the flat one (meshkit emits one
collective), so ``T_hier = T_flat``. Bytes across nodes are the same for both methods;
the two-stage one trades ``(N−1)·(M−1)`` inter-node message costs for an extra
intra-node pass and two local copies, so it wins at small messages and at large ``N``
and loses for large messages on few nodes.

Sources of the preset numbers:

* Latencies are the per-step hardware latencies of NCCL's own tuning model
  (``hwLat`` in NVIDIA/nccl ``src/graph/tuning.cc``, ring algorithm, LL128 protocol):
  1.9 µs over NVLink, 4.0 µs over the network. These are per-message software+hardware
  costs, larger than the raw InfiniBand wire latency (about 1 µs).
* ``a100-8x200g``: Tutel's testbed, Azure NDm A100 v4 — 8 × A100 80 GB SXM per node,
  NVLink 3 through NVSwitch (12 links × 25 GB/s = 300 GB/s per direction per GPU,
  600 GB/s bidirectional), 8 × 200 Gb/s HDR InfiniBand per node (one per GPU:
  25 GB/s per device), HBM2e 2,039 GB/s (NVIDIA A100 datasheet).
* ``h100-8x400g``: e.g. Azure ND H100 v5 / DGX H100 — 8 × H100 80 GB SXM5 per node,
  NVLink 4 (18 links × 25 GB/s = 450 GB/s per direction, 900 GB/s bidirectional),
  8 × 400 Gb/s NDR InfiniBand per node (50 GB/s per device), HBM3 3.35 TB/s (NVIDIA
  H100 datasheet).

Deduplicated (:mod:`meshkit.dedup`, ``N > 1`` and ``M > 1``) — with ``k`` experts per
token reaching ``u`` distinct nodes on average (``nodes_per_token``, ``1 <= u <= k``), a
token crosses to each of its nodes once instead of once per expert, so the node stage
carries ``B·u/k``; the device stage then fans the rows out to the experts and carries the
full ``B``; the local regroupings are those of the two-stage exchange (the routing
metadata, ``2k`` floats per row, is left out)::

    T_dedup = (N−1)·αe + B·(u/k)·(N−1)/N / βe + T_device + T_copy

With ``u = k`` (every expert of a token on its own node) it is ``T_hier``; every
``u < k`` makes it strictly cheaper. The bound ``u <= min(k, max_nodes, N)`` holds
at any routing, so a trace-time choice can use it.

With these numbers the model reproduces Tutel's qualitative result (Hwang et al.,
"Tutel: Adaptive Mixture-of-Experts at Scale", MLSys 2023): at 1 MiB per device the
two-stage exchange wins from 16 to 2,048 GPUs; at 256 MiB flat wins at 16 GPUs and the
two-stage one wins at 2,048.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Any

__all__ = [
    "COST_METHODS",
    "PRESETS",
    "Link",
    "Topology",
    "choose",
    "default_topology",
    "predict",
    "preset",
]

#: Methods :func:`predict` knows.
COST_METHODS = ("flat", "hierarchical", "dedup")

# Local regroupings of the whole buffer the two-stage exchange needs.
_HIERARCHICAL_COPIES = 2


def _check_positive_number(value: Any, field: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{field} must be finite and {bound}, got {value!r}")
    return float(value)


def _check_count(value: Any, field: str) -> int:
    # operator.index accepts Python and numpy integers but not floats such as 2.0.
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < 1:
        raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    return count


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: a per-message latency and a per-device bandwidth.

    Attributes:
        latency_s: cost of one message in seconds (software + hardware), >= 0.
        bandwidth_Bps: bytes per second one device can push through this link, > 0.

    Raises:
        ValueError: a field is not a finite number in range (the message names it).

    Example:
        >>> Link(latency_s=4e-6, bandwidth_Bps=25e9).bandwidth_Bps
        25000000000.0
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "latency_s", _check_positive_number(self.latency_s, "latency_s", allow_zero=True)
        )
        object.__setattr__(
            self, "bandwidth_Bps", _check_positive_number(self.bandwidth_Bps, "bandwidth_Bps")
        )


@dataclasses.dataclass(frozen=True)
class Topology:
    """Nodes of identical devices: sizes, the two links and memory bandwidth.

    Attributes:
        nodes: number of nodes ``N`` (>= 1).
        devices_per_node: devices per node ``M`` (>= 1).
        inter: the link between nodes; its bandwidth is per device (the node's total
            injection bandwidth divided by ``devices_per_node``).
        intra: the link between devices of one node (per device, one direction).
        memory_bandwidth_Bps: a device's local memory bandwidth, for re-layout copies.

    Raises:
        ValueError: a field has the wrong type or is out of range (the message names it).

    Example:
        >>> t = Topology(2, 8, Link(4e-6, 25e9), Link(1.9e-6, 300e9), 2.039e12)
        >>> t.devices
        16
    """

    nodes: int
    devices_per_node: int
    inter: Link
    intra: Link
    memory_bandwidth_Bps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", _check_count(self.nodes, "nodes"))
        object.__setattr__(
            self, "devices_per_node", _check_count(self.devices_per_node, "devices_per_node")
        )
        for field in ("inter", "intra"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"{field} must be a Link, got {getattr(self, field)!r}")
        object.__setattr__(
            self,
            "memory_bandwidth_Bps",
            _check_positive_number(self.memory_bandwidth_Bps, "memory_bandwidth_Bps"),
        )

    @property
    def devices(self) -> int:
        """Total number of devices ``P = nodes · devices_per_node``."""
        return self.nodes * self.devices_per_node


# name -> (devices per node, inter link latency, node injection B/s, intra link, memory B/s)
_PRESET_SPECS: dict[str, tuple[int, float, float, Link, float]] = {
    "a100-8x200g": (8, 4.0e-6, 8 * 200e9 / 8, Link(1.9e-6, 300e9), 2.039e12),
    "h100-8x400g": (8, 4.0e-6, 8 * 400e9 / 8, Link(1.9e-6, 450e9), 3.35e12),
}
#: Names accepted by :func:`preset`.
PRESETS = tuple(_PRESET_SPECS)


def preset(name: str, nodes: int, devices_per_node: int | None = None) -> Topology:
    """A :class:`Topology` with the link numbers of a known node type.

    The numbers and their sources are in this module's docstring. The node's NICs are
    shared by its devices, so with ``devices_per_node`` other than 8 the per-device
    inter-node bandwidth is the node's total divided by ``devices_per_node``.

    Args:
        name: one of :data:`PRESETS` (``"a100-8x200g"``, ``"h100-8x400g"``).
        nodes: number of nodes.
        devices_per_node: devices per node; default 8, as in the named node type.

    Returns:
        The topology.

    Raises:
        ValueError: unknown ``name``, or ``nodes``/``devices_per_node`` not an int >= 1.

    Example:
        >>> preset("a100-8x200g", nodes=256).devices
        2048
    """
    if name not in _PRESET_SPECS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    per_node, inter_latency, node_bw, intra, memory = _PRESET_SPECS[name]
    if devices_per_node is None:
        devices_per_node = per_node
    devices_per_node = _check_count(devices_per_node, "devices_per_node")
    return Topology(
        nodes=nodes,
        devices_per_node=devices_per_node,
        inter=Link(inter_latency, node_bw / devices_per_node),
        intra=intra,
        memory_bandwidth_Bps=memory,
    )


def default_topology(nodes: int, devices_per_node: int) -> Topology:
    """The topology ``meshkit.all_to_all(..., topology=None)`` assumes.

    It is ``preset("h100-8x400g", nodes, devices_per_node)``: current-generation GPU
    nodes, with the mesh's own ``N`` and ``M``. On a single host (simulated CPU devices)
    this describes no real hardware; pass a topology to decide for your cluster.

    Args:
        nodes: number of nodes ``N`` (product of the node axes' sizes).
        devices_per_node: devices per node ``M`` (product of the device axes' sizes).

    Returns:
        The topology.

    Raises:
        ValueError: a size is not an int >= 1.

    Example:
        >>> default_topology(2, 4).inter.bandwidth_Bps
        100000000000.0
    """
    return preset("h100-8x400g", nodes, devices_per_node)


def _check_bytes(bytes_per_device: Any) -> float:
    return _check_positive_number(bytes_per_device, "bytes_per_device", allow_zero=True)


def _check_routing(top_k: Any, nodes_per_token: Any) -> tuple[int, float]:
    k = _check_count(top_k, "top_k")
    u = _check_positive_number(nodes_per_token, "nodes_per_token")
    if not 1 <= u <= k:
        raise ValueError(f"nodes_per_token must be in [1, top_k={k}], got {nodes_per_token!r}")
    return k, u


def predict(
    method: str,
    bytes_per_device: float,
    topology: Topology,
    *,
    top_k: int = 1,
    nodes_per_token: float = 1.0,
) -> float:
    """Predicted time of one all-to-all, by the formulas in this module's docstring.

    Args:
        method: ``"flat"``, ``"hierarchical"`` or ``"dedup"``.
        bytes_per_device: the whole buffer one device sends, in bytes (>= 0); for an
            MoE, the non-deduplicated dispatch buffer (one row per assignment).
        topology: the hardware.
        top_k: experts per token ``k`` (used by ``"dedup"``).
        nodes_per_token: mean distinct nodes per token ``u``, ``1 <= u <= k`` (used by
            ``"dedup"``).

    Returns:
        Seconds.

    Raises:
        ValueError: unknown ``method``, negative or non-numeric ``bytes_per_device``,
            ``topology`` not a :class:`Topology`, ``top_k`` not an int >= 1 or
            ``nodes_per_token`` outside ``[1, top_k]``.

    Example:
        >>> t = preset("a100-8x200g", nodes=2)
        >>> predict("hierarchical", 2**20, t) < predict("flat", 2**20, t)
        True
        >>> predict("dedup", 2**20, t, top_k=4, nodes_per_token=1) < predict(
        ...     "hierarchical", 2**20, t)
        True
    """
    if method not in COST_METHODS:
        raise ValueError(f"method must be one of {COST_METHODS}, got {method!r}")
    size = _check_bytes(bytes_per_device)
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {topology!r}")
    k, u = _check_routing(top_k, nodes_per_token)
    n, m = topology.nodes, topology.devices_per_node
    piece = size / (n * m)
    inter, intra = topology.inter, topology.intra
    if method == "flat" or n == 1 or m == 1:
        latency = (m - 1) * intra.latency_s + (n - 1) * m * inter.latency_s
        transfer = max(
            (m - 1) * piece / intra.bandwidth_Bps, (n - 1) * m * piece / inter.bandwidth_Bps
        )
        return latency + transfer
    node_bytes = (n - 1) * m * piece * (u / k if method == "dedup" else 1.0)
    node_stage = (n - 1) * inter.latency_s + node_bytes / inter.bandwidth_Bps
    device_stage = (m - 1) * intra.latency_s + (m - 1) * n * piece / intra.bandwidth_Bps
    copies = _HIERARCHICAL_COPIES * 2 * size / topology.memory_bandwidth_Bps
    return node_stage + device_stage + copies


def choose(
    bytes_per_device: float,
    topology: Topology,
    *,
    top_k: int = 1,
    nodes_per_token: float | None = None,
) -> str:
    """The method :func:`predict` says is fastest; on a tie the simpler one (flat, then
    hierarchical, then dedup).

    Args:
        bytes_per_device: the whole buffer one device sends, in bytes (>= 0).
        topology: the hardware.
        top_k: experts per token ``k``.
        nodes_per_token: mean distinct nodes per token; ``None`` leaves ``"dedup"`` out
            (a plain all-to-all, not an MoE dispatch).

    Returns:
        ``"flat"``, ``"hierarchical"`` or ``"dedup"``.

    Raises:
        ValueError: as :func:`predict`.

    Example:
        >>> choose(256 * 2**20, preset("a100-8x200g", nodes=2))
        'flat'
        >>> choose(256 * 2**20, preset("a100-8x200g", nodes=256))
        'hierarchical'
        >>> choose(256 * 2**20, preset("a100-8x200g", nodes=2), top_k=8, nodes_per_token=1)
        'dedup'
    """
    methods = COST_METHODS if nodes_per_token is not None else COST_METHODS[:2]
    times = [predict(method, bytes_per_device, topology, top_k=top_k,
                     nodes_per_token=nodes_per_token or 1.0) for method in methods]
    return methods[times.index(min(times))]
