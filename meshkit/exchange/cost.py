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
* ``h800-8x400g``: DeepSeek-V3's cluster (DeepSeek-AI 2024, arXiv 2412.19437, section
  3.2.2: "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50
  GB/s)") — the H100 SXM5's silicon, memory and bf16 peak with NVLink cut for export,
  8 × 400 Gb/s InfiniBand per node.

Deduplicated (:mod:`meshkit.exchange.dedup`, ``N > 1`` and ``M > 1``) — with ``k`` experts per
token reaching ``u`` distinct nodes on average (``nodes_per_token``, ``1 <= u <= k``), a
token crosses to each of its nodes once instead of once per expert, so the node stage
carries ``B·u/k``; the device stage then fans the rows out to the experts and carries the
full ``B``; the local regroupings are those of the two-stage exchange (the routing
metadata, ``2k`` floats per row, is left out)::

    T_dedup = (N−1)·αe + B·(u/k)·(N−1)/N / βe + T_device + T_copy

With ``u = k`` (every expert of a token on its own node) it is ``T_hier``; every
``u < k`` makes it strictly cheaper. The bound ``u <= min(k, max_nodes, N)`` holds
at any routing, so a trace-time choice can use it; since the buffers are padded to
their capacities, meshkit's choices use ``u`` as the buffers carry it
(:func:`meshkit.exchange.capacity.dedup_nodes_per_token`: the bound, or less where a
node's rows are capped at the tokens).

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
import reprlib
from typing import Any

from meshkit._fs import read_text_file
from meshkit._yamlfile import load_yaml
from meshkit.errors import UsageError

__all__ = [
    "CHOOSE_MARGIN",
    "COST_METHODS",
    "FILE_BOUNDS",
    "PRESETS",
    "Link",
    "Topology",
    "choose",
    "default_topology",
    "is_topology_file",
    "link_seconds",
    "load_topology",
    "predict",
    "preset",
    "topology_to_dict",
]

#: Methods :func:`predict` knows.
COST_METHODS = ("flat", "hierarchical", "dedup")
# A less simple plan must be predicted this much faster to be chosen: the model is
# within 25 % of measured steps (``meshkit bench moe``), and what it leaves out (the
# sorts and gathers that build the two-stage and deduplicated buffers) all costs the
# less simple plan, so a predicted win of 2 % is no win.
CHOOSE_MARGIN = 0.05

# Local regroupings of the whole buffer the two-stage exchange needs.
_HIERARCHICAL_COPIES = 2


def _show(value: Any) -> str:
    """A value for an error message, cut while its text is built: a file's value may be a
    400-digit integer or a list of thousands of items."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 80:
        return f"an integer of {len(str(value)) if value.bit_length() < 10_000 else 'many'} digits"
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 8, 8, 60, 60
    return r.repr(value)


def _check_positive_number(value: Any, field: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (10**400)
        number = math.inf
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{field} must be finite and {bound}, got {_show(value)}")
    return number


def _check_count(value: Any, field: str) -> int:
    # operator.index accepts Python and numpy integers but not floats such as 2.0.
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < 1:
        raise ValueError(f"{field} must be an int >= 1, got {_show(value)}")
    return count


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: a per-message latency and a per-device bandwidth.

    Attributes:
        latency_s: cost of one message in seconds (software + hardware), >= 0.
        bandwidth_Bps: bytes per second one device can push through this link, > 0.

    Raises:
        ValueError: a field is not a finite number in range (the message names it).

    Examples:
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
        flops_per_s: FLOP/s one device sustains on the model's matmuls, or ``None``
            (unknown; the exchange model does not need it, the planner does).
        memory_bytes: one device's memory in bytes, or ``None`` (unknown).

    Raises:
        ValueError: a field has the wrong type or is out of range (the message names it).

    Examples:
        >>> t = Topology(2, 8, Link(4e-6, 25e9), Link(1.9e-6, 300e9), 2.039e12)
        >>> t.devices
        16
    """

    nodes: int
    devices_per_node: int
    inter: Link
    intra: Link
    memory_bandwidth_Bps: float
    flops_per_s: float | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", _check_count(self.nodes, "nodes"))
        if self.flops_per_s is not None:
            object.__setattr__(
                self, "flops_per_s", _check_positive_number(self.flops_per_s, "flops_per_s")
            )
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", _check_count(self.memory_bytes,
                                                                  "memory_bytes"))
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


# The share of the bf16 dense peak a transformer's training step sustains, for the
# presets' flops_per_s: 0.4, about the MFU large published runs report (PaLM 540B:
# 46.2 %, Chowdhery et al. 2022, table 3; Megatron-LM GPT 1T on A100: 52 % of peak,
# Narayanan et al. 2021; MoE runs report less). An assumption, not a measurement: run
# `meshkit calibrate` on the real machine for a measured figure.
PRESET_MFU = 0.4
# One device's memory: A100 80 GB SXM and H100 80 GB SXM5 (the data sheets' 80 GB is
# 80 GiB of HBM as the driver reports it, before the runtime's own share).
_DEVICE_MEMORY = 80 * 2**30
# name -> (devices per node, inter link latency, node injection B/s, intra link, memory
# B/s, bf16 dense peak FLOP/s: NVIDIA A100 and H100 SXM datasheets, as meshkit.plan.flops)
_PRESET_SPECS: dict[str, tuple[int, float, float, Link, float, float]] = {
    "a100-8x200g": (8, 4.0e-6, 8 * 200e9 / 8, Link(1.9e-6, 300e9), 2.039e12, 312e12),
    "h100-8x400g": (8, 4.0e-6, 8 * 400e9 / 8, Link(1.9e-6, 450e9), 3.35e12, 989e12),
    "h800-8x400g": (8, 4.0e-6, 8 * 400e9 / 8, Link(1.9e-6, 160e9), 3.35e12, 989e12),
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

    Examples:
        >>> preset("a100-8x200g", nodes=256).devices
        2048
    """
    if name not in _PRESET_SPECS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    per_node, inter_latency, node_bw, intra, memory, peak = _PRESET_SPECS[name]
    if devices_per_node is None:
        devices_per_node = per_node
    devices_per_node = _check_count(devices_per_node, "devices_per_node")
    return Topology(
        nodes=nodes,
        devices_per_node=devices_per_node,
        inter=Link(inter_latency, node_bw / devices_per_node),
        intra=intra,
        memory_bandwidth_Bps=memory,
        flops_per_s=PRESET_MFU * peak,
        memory_bytes=_DEVICE_MEMORY,
    )


# The keys of a topology file (what `meshkit calibrate` writes); `measured` holds the raw
# timings the links were fitted from and is not read back.
_FILE_KEYS = ("devices_per_node", "inter", "intra", "memory_bandwidth_Bps", "flops_per_s",
              "memory_bytes", "measured")
_FILE_REQUIRED = ("devices_per_node", "inter", "intra", "memory_bandwidth_Bps")
#: The physical bounds of a topology file's values, ``key -> (lowest, highest)``, both
#: included. Wide around today's hardware (an H100: 1e15 FLOP/s, 3.35e12 B/s of HBM,
#: 80 GiB, 50e9 B/s a NIC, microseconds a message); a value outside is a typo or a unit
#: mistake, and far enough out it turns predicted step times into inf or NaN (a
#: ``flops_per_s`` of 1e-300 ranked every layout by NaN).
FILE_BOUNDS: dict[str, tuple[float, float]] = {
    "devices_per_node": (1, 2**20),  # the planner's device limit
    "latency_s": (0.0, 1.0),  # a second a message: beyond any network
    "bandwidth_Bps": (1e3, 1e15),  # 1 kB/s .. 1 PB/s per device
    "memory_bandwidth_Bps": (1e6, 1e16),  # 1 MB/s .. 10 PB/s
    "flops_per_s": (1e6, 1e18),  # 1 MFLOP/s .. 1 EFLOP/s per device
    "memory_bytes": (2**20, 2**50),  # 1 MiB .. 1 PiB per device
}


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    """A topology as the plain mapping a topology file holds (``nodes`` left out).

    Args:
        topology: the topology.

    Returns:
        ``{devices_per_node, inter, intra, memory_bandwidth_Bps, flops_per_s,
        memory_bytes}``, the links as ``{latency_s, bandwidth_Bps}``.

    Examples:
        >>> topology_to_dict(preset("a100-8x200g", 2))["inter"]
        {'latency_s': 4e-06, 'bandwidth_Bps': 25000000000.0}
    """
    out = dataclasses.asdict(topology)
    del out["nodes"]
    return out


def _check_keys(raw: dict[Any, Any], where: str, keys: tuple[str, ...],
                required: tuple[str, ...]) -> None:
    strange = [k for k in raw if not isinstance(k, str)]
    if strange:  # sorting a mix of str and int keys would raise TypeError
        raise ValueError(f"{where}: key {_show(strange[0])} is not a string (keys: "
                         f"{', '.join(keys)})")
    unknown = sorted(set(raw) - set(keys))
    missing = [k for k in required if k not in raw]
    if unknown or missing:
        # Keys are strings here; a long one is cut (the list too: at most five).
        shown = ", ".join(_show(k) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        what = f"unknown keys [{shown}]" if unknown else f"missing keys {missing}"
        raise ValueError(f"{where}: {what} (keys: {', '.join(keys)})")


def _check_bounds(value: Any, key: str, field: str) -> None:
    """``value`` (already a finite number or count) within :data:`FILE_BOUNDS`."""
    if value is None:
        return
    low, high = FILE_BOUNDS[field]
    if not low <= value <= high:
        def text(x: float) -> str:
            return f"{x:,}" if isinstance(x, int) else f"{x:g}"

        raise ValueError(f"{key} must be between {text(low)} and {text(high)}, got "
                         f"{_show(value)}")


def _from_file(path: str, nodes: int, devices_per_node: int | None) -> Topology:
    where = f"topology file {path}"
    try:
        text = read_text_file(path, what="topology file")
    except UsageError as e:
        raise ValueError(str(e)) from None
    raw = load_yaml(text, where=where)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with keys "
                         f"{', '.join(_FILE_REQUIRED)}, got {type(raw).__name__}")
    _check_keys(raw, where, _FILE_KEYS, _FILE_REQUIRED)
    links = {}
    for key in ("inter", "intra"):
        link = raw[key]
        if not isinstance(link, dict):
            raise ValueError(f"{where}: {key} must be a mapping of latency_s and "
                             f"bandwidth_Bps, got {_show(link)}")
        fields = ("latency_s", "bandwidth_Bps")
        _check_keys(link, f"{where}: {key}", fields, fields)
        try:
            links[key] = Link(**link)
            for field in fields:
                _check_bounds(getattr(links[key], field), field, field)
        except ValueError as e:
            raise ValueError(f"{where}: {key}.{e}") from None
    try:
        topology = Topology(
            nodes=nodes,
            devices_per_node=raw["devices_per_node"],
            inter=links["inter"],
            intra=links["intra"],
            memory_bandwidth_Bps=raw["memory_bandwidth_Bps"],
            flops_per_s=raw.get("flops_per_s"),
            memory_bytes=raw.get("memory_bytes"),
        )
        for field in ("devices_per_node", "memory_bandwidth_Bps", "flops_per_s",
                      "memory_bytes"):
            _check_bounds(getattr(topology, field), field, field)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if devices_per_node is not None:
        topology = dataclasses.replace(topology, devices_per_node=devices_per_node)
    return topology


def is_topology_file(name: str) -> bool:
    """Whether ``name`` names a topology file rather than a preset (by its suffix).

    Examples:
        >>> is_topology_file("calibrated.yaml"), is_topology_file("h100-8x400g")
        (True, False)
    """
    return name.endswith((".yaml", ".yml"))


def load_topology(name: str, nodes: int, devices_per_node: int | None = None) -> Topology:
    """A preset by name, or a topology file (``*.yaml``, as ``meshkit calibrate`` writes).

    Args:
        name: one of :data:`PRESETS`, or the path of a ``.yaml``/``.yml`` topology file.
        nodes: number of nodes.
        devices_per_node: devices per node; default the preset's (8) or the file's.

    Returns:
        The topology.

    Raises:
        ValueError: an unknown preset; a file that cannot be read, is not YAML, lacks a
            key, has an unknown one or one that is not a string, or holds a value that is
            not a finite number within :data:`FILE_BOUNDS` (each message names the file
            and the key, in one line).

    Examples:
        >>> load_topology("h100-8x400g", nodes=4).devices
        32
        >>> load_topology("tpu-v5", nodes=1)
        Traceback (most recent call last):
        ...
        ValueError: unknown preset 'tpu-v5'; known presets: a100-8x200g, h100-8x400g, h800-8x400g
    """
    if isinstance(name, str) and is_topology_file(name):
        return _from_file(name, nodes, devices_per_node)
    return preset(name, nodes, devices_per_node)


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

    Examples:
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

    Examples:
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
    """The simplest method (flat, then hierarchical, then dedup) that :func:`predict` puts
    within ``CHOOSE_MARGIN`` (5 %) of the fastest.

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

    Examples:
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
    fastest = min(times)
    return next(method for method, time in zip(methods, times, strict=True)
                if time <= fastest * (1 + CHOOSE_MARGIN))


def link_seconds(
    method: str,
    bytes_per_device: float,
    inter: Link,
    *,
    nodes: int,
    devices_per_node: int,
    top_k: int = 1,
    nodes_per_token: float = 1.0,
) -> float:
    """The inter-node part of :func:`predict`: the messages and bytes that cross nodes.

    ``flat``: ``(N−1)·M·αe + (N−1)·M·b / βe``; ``hierarchical``: ``(N−1)·αe + (N−1)·M·b /
    βe``; ``dedup``: the hierarchical one with the bytes times ``u/k``. It leaves out
    what the node link's time overlaps with: flat's bytes inside a node go under its bytes
    across, so what a slower node link adds to an exchange is :func:`predict`'s difference
    between the two topologies, not this term's (``meshkit bench moe --link-rate``).

    Args:
        method: ``"flat"``, ``"hierarchical"`` or ``"dedup"``.
        bytes_per_device: the whole buffer one device sends (as :func:`predict`).
        inter: the link between nodes.
        nodes: ``N``.
        devices_per_node: ``M``.
        top_k: experts per token ``k`` (``"dedup"``).
        nodes_per_token: distinct nodes per token ``u`` (``"dedup"``).

    Returns:
        Seconds.

    Raises:
        ValueError: as :func:`predict`.

    Examples:
        >>> link = Link(latency_s=1e-4, bandwidth_Bps=1e7)
        >>> round(link_seconds("flat", 8e6, link, nodes=2, devices_per_node=4), 4)
        0.4004
        >>> round(link_seconds("dedup", 8e6, link, nodes=2, devices_per_node=4, top_k=4,
        ...                    nodes_per_token=2), 4)
        0.2001
    """
    if method not in COST_METHODS:
        raise ValueError(f"method must be one of {COST_METHODS}, got {method!r}")
    size = _check_bytes(bytes_per_device)
    n, m = _check_count(nodes, "nodes"), _check_count(devices_per_node, "devices_per_node")
    k, u = _check_routing(top_k, nodes_per_token)
    crossing = size * (n - 1) / n
    if method == "flat" or n == 1 or m == 1:
        return (n - 1) * m * inter.latency_s + crossing / inter.bandwidth_Bps
    share = u / k if method == "dedup" else 1.0
    return (n - 1) * inter.latency_s + crossing * share / inter.bandwidth_Bps
