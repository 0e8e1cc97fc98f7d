"""The all-to-all cost model: formulas, presets (Tutel's result) and validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshkit.exchange import cost
from meshkit.exchange.cost import Link, Topology

MiB = 2**20


@pytest.mark.parametrize("name", ["a100-8x200g", "h100-8x400g"])
def test_presets_reproduce_tutel(name: str) -> None:
    """1 MiB: two-stage wins from 16 to 2,048 GPUs; 256 MiB: flat at 16, two-stage at 2,048."""
    for nodes in (2, 4, 8, 16, 32, 64, 128, 256):
        topology = cost.preset(name, nodes)
        assert topology.devices == 8 * nodes
        assert cost.choose(1 * MiB, topology) == "hierarchical", nodes
    assert cost.choose(256 * MiB, cost.preset(name, 2)) == "flat"
    assert cost.choose(256 * MiB, cost.preset(name, 256)) == "hierarchical"


def test_predict_by_hand() -> None:
    # N = M = 2, B = 400 bytes, so one piece b = 100 bytes.
    t = Topology(2, 2, inter=Link(10.0, 50.0), intra=Link(1.0, 100.0), memory_bandwidth_Bps=800.0)
    # flat: αa + 2·αe + max(b/βa, 2b/βe) = 1 + 20 + max(1, 4)
    assert cost.predict("flat", 400, t) == pytest.approx(25.0)
    # node stage 10 + 200/50, device stage 1 + 200/100, two copies 2·2·400/800
    assert cost.predict("hierarchical", 400, t) == pytest.approx(14.0 + 3.0 + 2.0)
    assert cost.choose(400, t) == "hierarchical"


def test_flat_overlaps_links_but_stages_add() -> None:
    # Zero latencies: flat is bounded by the slower link; the two-stage adds its stages.
    t = Topology(2, 2, inter=Link(0.0, 100.0), intra=Link(0.0, 100.0), memory_bandwidth_Bps=1e30)
    assert cost.predict("flat", 400, t) == pytest.approx(max(100 / 100, 200 / 100))
    assert cost.predict("hierarchical", 400, t) == pytest.approx(200 / 100 + 200 / 100)
    assert cost.choose(400, t) == "flat"


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 8), (16, 1)])
def test_one_level_means_flat(nodes: int, per_node: int) -> None:
    t = cost.preset("a100-8x200g", nodes, per_node)
    for size in (0, MiB, 256 * MiB):
        assert cost.predict("hierarchical", size, t) == cost.predict("flat", size, t)
        assert cost.choose(size, t) == "flat"


def test_time_grows_with_bytes_and_nodes() -> None:
    for method in cost.COST_METHODS:
        t = cost.preset("h100-8x400g", 4)
        assert cost.predict(method, MiB, t) < cost.predict(method, 2 * MiB, t)
        big = cost.preset("h100-8x400g", 64)
        assert cost.predict(method, MiB, t) < cost.predict(method, MiB, big)


def test_preset_shares_node_nics_among_devices() -> None:
    eight = cost.preset("a100-8x200g", 2)
    four = cost.preset("a100-8x200g", 2, devices_per_node=4)
    assert eight.devices_per_node == 8
    assert eight.inter.bandwidth_Bps == pytest.approx(200e9 / 8)  # one 200 Gb/s NIC each
    assert four.inter.bandwidth_Bps == pytest.approx(2 * eight.inter.bandwidth_Bps)
    assert four.intra == eight.intra
    assert cost.preset("h100-8x400g", 2).inter.bandwidth_Bps == pytest.approx(400e9 / 8)


def test_default_topology_is_documented_preset() -> None:
    assert cost.default_topology(2, 4) == cost.preset("h100-8x400g", 2, 4)
    assert set(cost.PRESETS) >= {"a100-8x200g", "h100-8x400g"}


def test_numpy_numbers_are_accepted_and_normalised() -> None:
    t = Topology(np.int64(2), np.int32(4), Link(np.float32(1e-6), 1e9), _LINK, np.float64(1e12))
    assert (t.nodes, t.devices_per_node) == (2, 4)
    assert type(t.nodes) is int and type(t.inter.latency_s) is float


def test_dataclasses_are_frozen() -> None:
    t = cost.preset("a100-8x200g", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.nodes = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.inter.latency_s = 0.0  # type: ignore[misc]


# --- validation ---------------------------------------------------------------------

_LINK = Link(1e-6, 1e9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"latency_s": -1.0, "bandwidth_Bps": 1e9}, "latency_s"),
        ({"latency_s": float("nan"), "bandwidth_Bps": 1e9}, "latency_s"),
        ({"latency_s": "1us", "bandwidth_Bps": 1e9}, "latency_s"),
        ({"latency_s": 1e-6, "bandwidth_Bps": 0}, "bandwidth_Bps"),
        ({"latency_s": 1e-6, "bandwidth_Bps": float("inf")}, "bandwidth_Bps"),
        ({"latency_s": 1e-6, "bandwidth_Bps": True}, "bandwidth_Bps"),
    ],
)
def test_link_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        Link(**kwargs)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"nodes": 0}, "nodes"),
        ({"nodes": 2.0}, "nodes"),
        ({"devices_per_node": -1}, "devices_per_node"),
        ({"devices_per_node": True}, "devices_per_node"),
        ({"inter": (1e-6, 1e9)}, "inter"),
        ({"intra": None}, "intra"),
        ({"memory_bandwidth_Bps": 0.0}, "memory_bandwidth_Bps"),
    ],
)
def test_topology_validation(change: dict, field: str) -> None:
    kwargs = {
        "nodes": 2,
        "devices_per_node": 4,
        "inter": _LINK,
        "intra": _LINK,
        "memory_bandwidth_Bps": 1e12,
    } | change
    with pytest.raises(ValueError, match=rf"^{field} must"):
        Topology(**kwargs)


def test_predict_and_choose_validation() -> None:
    t = cost.preset("a100-8x200g", 2)
    with pytest.raises(ValueError, match=r"method must be one of .*'ring'"):
        cost.predict("ring", MiB, t)
    with pytest.raises(ValueError, match=r"^bytes_per_device must"):
        cost.predict("flat", -1, t)
    with pytest.raises(ValueError, match=r"^bytes_per_device must"):
        cost.choose("1MiB", t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"topology must be a Topology"):
        cost.choose(MiB, "a100-8x200g")  # type: ignore[arg-type]


def test_preset_validation() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'v100'.*a100-8x200g"):
        cost.preset("v100", 2)
    with pytest.raises(ValueError, match=r"^devices_per_node must"):
        cost.preset("a100-8x200g", 2, devices_per_node=0)
    with pytest.raises(ValueError, match=r"^nodes must"):
        cost.preset("a100-8x200g", 0)


# ------------------------------------------------------------------ deduplicated exchange
def test_dedup_by_hand() -> None:
    # N = M = 2, B = 400 (piece 100), k = 4 experts on u = 2 nodes: the node stage
    # carries half of hierarchical's 200 bytes; device stage and copies are unchanged.
    t = Topology(2, 2, inter=Link(10.0, 50.0), intra=Link(1.0, 100.0), memory_bandwidth_Bps=800.0)
    assert cost.predict("dedup", 400, t, top_k=4, nodes_per_token=2) == pytest.approx(
        (10.0 + 100 / 50) + 3.0 + 2.0)
    assert cost.predict("dedup", 400, t, top_k=4, nodes_per_token=4) == pytest.approx(
        cost.predict("hierarchical", 400, t))


@pytest.mark.parametrize("nodes", [2, 16, 256])
def test_dedup_never_loses_to_two_stage_and_ties_at_u_equal_k(nodes: int) -> None:
    t = cost.preset("h100-8x400g", nodes)
    for size in (MiB, 256 * MiB):
        hier = cost.predict("hierarchical", size, t)
        assert cost.predict("dedup", size, t, top_k=4, nodes_per_token=4) == hier
        assert cost.predict("dedup", size, t, top_k=4, nodes_per_token=3.9) < hier
        # On a tie, or a win inside the margin, the plain two-stage exchange is kept.
        assert cost.choose(size, t, top_k=4, nodes_per_token=4) != "dedup"
        assert cost.choose(size, t, top_k=8, nodes_per_token=7.9) != "dedup"
    # Small messages (1 MiB): two-stage beats flat, so dedup is the choice once its
    # predicted win over the two-stage exchange passes the margin.
    hier = cost.predict("hierarchical", MiB, t)
    for u in (7.9, 7.5, 6.0, 4.0, 2.0):
        dedup = cost.predict("dedup", MiB, t, top_k=8, nodes_per_token=u)
        expected = "dedup" if dedup * (1 + cost.CHOOSE_MARGIN) < hier else "hierarchical"
        assert cost.choose(MiB, t, top_k=8, nodes_per_token=u) == expected, u
    # At 256 nodes 255 messages' latency outweighs 1 MiB's bytes, which are all u cuts.
    assert cost.choose(MiB, t, top_k=8, nodes_per_token=2) == (
        "dedup" if nodes <= 16 else "hierarchical")


def test_dedup_vs_flat_crossover_on_two_a100_nodes() -> None:
    """256 MiB on 2 × 8 A100 (preset numbers in meshkit.exchange.cost's docstring: βe = 25 GB/s,
    βa = 300 GB/s, βm = 2.039 TB/s, αe = 4 µs, αa = 1.9 µs): flat beats the two-stage
    exchange (Tutel), and dedup beats flat once u/k falls below the r* where
    T_dedup(r*) = T_flat; it is chosen below the r where it is faster by the margin."""
    t = cost.preset("a100-8x200g", 2)
    size = 256 * MiB
    flat = (7 * 1.9e-6 + 8 * 4.0e-6) + max(7 / 16 * size / 300e9, 8 / 16 * size / 25e9)
    rest = 4.0e-6 + (7 * 1.9e-6 + 7 / 8 * size / 300e9) + 2 * 2 * size / 2.039e12
    r_star = (flat - rest) / (size / 2 / 25e9)
    assert 0.75 < r_star < 0.77  # about u/k = 3/4: e.g. top-8 reaching 6 nodes of many
    assert cost.predict("flat", size, t) == pytest.approx(flat)
    assert cost.choose(size, t) == "flat"
    k = 100
    dedup = cost.predict("dedup", size, t, top_k=k, nodes_per_token=k * r_star)
    assert dedup == pytest.approx(flat)
    r_choose = (flat / (1 + cost.CHOOSE_MARGIN) - rest) / (size / 2 / 25e9)
    assert 0.70 < r_choose < r_star - 0.03
    assert cost.choose(size, t, top_k=k, nodes_per_token=k * (r_choose - 0.005)) == "dedup"
    assert cost.choose(size, t, top_k=k, nodes_per_token=k * (r_choose + 0.005)) == "flat"
    # Fine-grained top-4 on 2 nodes reaches at most 2 nodes: u/k <= 1/2, dedup wins.
    assert cost.choose(size, t, top_k=4, nodes_per_token=2) == "dedup"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
        ({"top_k": 2, "nodes_per_token": 3}, r"nodes_per_token must be in \[1, top_k=2\], got 3"),
        ({"top_k": 2, "nodes_per_token": 0.5}, r"nodes_per_token must be in \[1, top_k=2\]"),
        ({"nodes_per_token": float("nan")}, "nodes_per_token must be finite"),
    ],
)
def test_routing_statistics_errors(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        cost.predict("dedup", MiB, cost.preset("h100-8x400g", 2), **kw)
