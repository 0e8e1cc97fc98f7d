"""The context methods' cost model, auto's choice and the causal block counts (no JAX)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from meshkit.choices import CONTEXT_METHODS
from meshkit.config import context_method as cm
from meshkit.exchange.cost import Link, Topology
from meshkit.strategy.ranks import Strategy

# A link whose seconds are its bytes (1 B/s, no latency), and one whose seconds are its
# messages (1 s each, bandwidth beyond any byte count here).
BYTES = Link(latency_s=0.0, bandwidth_Bps=1.0)
MESSAGES = Link(latency_s=1.0, bandwidth_Bps=1e30)
FREE = Link(latency_s=0.0, bandwidth_Bps=1e30)
# c = 4 devices of n = T/c = 4 tokens; 4 heads and 4 kv heads of width 2 in float32:
# Q = b·n·H·h·d = 1·4·4·2·4 = 128 bytes a device, KV = 128 too.
SHAPE: dict[str, Any] = dict(seq_len=16, batch=1, heads=4, kv_heads=4, head_dim=2, dtype_bytes=4)
Q = KV = 128


def _predict(method: str, sizes: tuple[int, ...], links: tuple[Link, ...], **kw: Any) -> float:
    return cm.predict(method, **{**SHAPE, **kw}, context_sizes=sizes, links=links)


def test_the_simplicity_order_holds_every_method_but_auto() -> None:
    assert sorted(cm.SIMPLICITY) == sorted(set(CONTEXT_METHODS) - {"auto"})


def test_bytes_against_a_hand_count() -> None:
    # all_gather: K and V each gather 3 blocks of 128 bytes; dK, dV reduce-scatter the same.
    assert _predict("all_gather", (4,), (BYTES,)) == 2 * 3 * KV + 2 * 3 * KV
    # ring: 3 forward steps of K and V (2·128 bytes); 3 backward steps of K, V, dK, dV and
    # one taking dK, dV home.
    assert _predict("ring", (4,), (BYTES,)) == 3 * 2 * KV + 3 * 4 * KV + 2 * KV
    # ulysses: q, k, v in and o out forward, dO in and dq, dk, dv out backward; each
    # all-to-all sends 3 of its 4 quarters.
    assert _predict("ulysses", (4,), (BYTES,)) == (4 * Q + 4 * KV) * 3 // 4
    # hierarchical on 2 × 2: the same 8 all-to-alls over the inner pair (half of each
    # tensor leaves), then a ring of 2 over the outer pair with the whole KV again.
    assert _predict("hierarchical", (2, 2), (BYTES, BYTES)) == (
        (4 * Q + 4 * KV) // 2 + 1 * 2 * KV + 1 * 4 * KV + 2 * KV)
    # GQA: one kv head moves a quarter of KV's bytes (ring: only K/V move).
    assert _predict("ring", (4,), (BYTES,), kv_heads=1) == (3 * 2 + 3 * 4 + 2) * KV // 4


def test_messages_against_a_hand_count() -> None:
    # 4 collectives of 3 messages; 3 + 4 ring steps; 8 all-to-alls of 3 messages.
    assert _predict("all_gather", (4,), (MESSAGES,)) == 12
    assert _predict("ring", (4,), (MESSAGES,)) == 7
    assert _predict("ulysses", (4,), (MESSAGES,)) == 24


def test_a_peer_is_reached_over_the_slowest_link_it_needs() -> None:
    # 2 nodes × 4 devices, the node link 1 B/s and the device link free: of a device's 7
    # peers, the other node's 4 are reached over the node link (T = 32: n = 4 as before).
    assert _predict("all_gather", (2, 4), (BYTES, FREE), seq_len=32) == 4 * 4 * KV
    # A ring over both axes crosses nodes at some step: each step waits on the node link.
    ring = _predict("ring", (2, 4), (BYTES, FREE), seq_len=32)
    assert ring == (7 * 2 + 7 * 4 + 2) * KV
    # Hierarchical: the all-to-alls stay on the free link, only the outer ring pays.
    assert _predict("hierarchical", (2, 4), (BYTES, FREE), seq_len=32) == (2 + 4 + 2) * KV


def test_the_ring_overlaps_compute_and_the_others_do_not() -> None:
    flops = 4 * 1 * 16**2 * 4 * 2 / 4 / 2  # causal forward FLOPs a device
    one = dict(flops_per_s=flops)  # the forward's compute takes 1 s
    assert _predict("ring", (4,), (FREE,), **one) == pytest.approx(1 + 2.5)
    assert _predict("all_gather", (4,), (FREE,), **one) == pytest.approx(1 + 2.5)
    assert _predict("all_gather", (4,), (BYTES,), **one) == pytest.approx(4 * 3 * KV + 3.5)
    # Steps whose bytes take longer than their compute cost the bytes (a quarter second
    # of compute each against 256 or 512 seconds of transfer).
    assert _predict("ring", (4,), (BYTES,), **one) == pytest.approx(
        3 * 2 * KV + 0.25 + 3 * 4 * KV + 2.5 * 0.25 + 2 * KV)
    assert _predict("ring", (4,), (FREE,), causal=False, **one) == pytest.approx(2 * 3.5)


def _fake_times(monkeypatch: pytest.MonkeyPatch, times: dict[str, float]) -> None:
    monkeypatch.setattr(cm, "predict", lambda method, **_: times[method])


@pytest.mark.parametrize(("ring", "picked"), [(0.96, "all_gather"), (0.94, "ring")])
def test_auto_keeps_the_simplest_unless_another_is_5_percent_faster(
        monkeypatch: pytest.MonkeyPatch, ring: float, picked: str) -> None:
    _fake_times(monkeypatch, {"all_gather": 1.0, "ring": ring, "ulysses": 2.0,
                              "hierarchical": 2.0})
    choice = cm.choose(**SHAPE, context_sizes=(2, 2), links=(BYTES, BYTES))
    assert choice.method == picked
    assert choice.describe().startswith(f"{picked} (cost model")


def test_auto_never_picks_what_the_heads_or_axes_rule_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_times(monkeypatch, {"all_gather": 1.0, "ring": 1.0, "ulysses": 0.1,
                              "hierarchical": 0.1})
    # 6 heads do not divide among 4: Ulysses is out; one axis: hierarchical is out.
    choice = cm.choose(**{**SHAPE, "heads": 6}, context_sizes=(4,), links=(BYTES,))
    assert choice.method == "all_gather"
    assert set(choice.refused) == {"ulysses", "hierarchical"}
    assert "heads 6" in choice.refused["ulysses"]
    assert "2 or more context axes" in choice.refused["hierarchical"]
    # 2 kv heads divide among the inner 2 but not among all 4: hierarchical only.
    choice = cm.choose(**{**SHAPE, "kv_heads": 2}, context_sizes=(2, 2), links=(BYTES, BYTES))
    assert choice.method == "hierarchical" and set(choice.refused) == {"ulysses"}


@pytest.mark.parametrize(("kw", "culprit"), [
    ({"method": "p2p"}, "method"),
    ({"seq_len": 12}, "seq_len 12"),
    ({"batch": 0}, "batch"),
    ({"links": (BYTES, BYTES)}, "links"),
    ({"context_sizes": ()}, "context_sizes"),
    ({"flops_per_s": -1.0}, "flops_per_s"),
    ({"method": "ulysses", "heads": 6}, "heads 6"),
    ({"method": "hierarchical"}, "2 or more context axes"),
])
def test_each_bad_input_names_its_culprit(kw: dict[str, object], culprit: str) -> None:
    args: dict[str, object] = {"method": "ring", **SHAPE, "context_sizes": (4,),
                               "links": (BYTES,), **kw}
    method = args.pop("method")
    with pytest.raises(ValueError, match=culprit):
        cm.predict(method, **args)  # type: ignore[arg-type]


def test_axis_links_on_two_nodes() -> None:
    inter, intra = Link(4e-6, 1e9), Link(2e-6, 1e11)
    topology = Topology(2, 4, inter, intra, 1e12)
    # cpn's groups (0, 4), (1, 5), ... cross the nodes; cpd's (0..3), (4..7) do not.
    node_first = Strategy.from_axes({"cpn": 2, "cpd": 4})
    assert cm.axis_links(node_first, ("cpn", "cpd"), topology) == (inter, intra)
    # Swapped: cpd's groups (0, 2, 4, 6) cross, cpn's (0, 1) stay on a node.
    device_first = Strategy.from_axes({"cpd": 4, "cpn": 2})
    assert cm.axis_links(device_first, ("cpn", "cpd"), topology) == (intra, inter)


NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]


def _config(*overrides: str) -> Any:
    from meshkit.config import load_config

    return load_config(None, ["model.d_model=64", "model.num_heads=8", "train.seq_len=4096",
                              "train.batch_size=4", *NO_EXPERTS, *overrides])


def test_a_config_is_read_into_choose() -> None:
    from meshkit.exchange.cost import default_topology

    # No exchange node axes: the 16 devices are one node's.
    config = _config("mesh.axes={cpn: 2, cpd: 8}", "parallel.context=[cpn, cpd]")
    topology = default_topology(1, 16)
    expected = cm.choose(seq_len=4096, batch=4, heads=8, kv_heads=8, head_dim=8,
                         dtype_bytes=4, context_sizes=(2, 8),
                         links=(topology.intra, topology.intra),
                         flops_per_s=topology.flops_per_s)
    assert cm.resolve(config) == expected.method
    assert cm.picked(config) == expected.describe()
    ring = config.replace(parallel={"context_method": "ring"})
    assert cm.resolve(ring) == "ring" and cm.picked(ring) is None


@pytest.mark.parametrize(("kv", "refused"), [
    (8, {"ulysses"}),  # 4 kv heads a tensor rank: the inner 4 divide them, all 8 do not
    (2, {"ulysses", "hierarchical"}),  # 1 kv head a tensor rank
    (1, {"ulysses", "hierarchical"}),  # 1 kv head, replicated on both tensor ranks
])
def test_heads_are_counted_per_tensor_rank(kv: int, refused: set[str]) -> None:
    config = _config("mesh.axes={tp: 2, cpn: 2, cpd: 4}", "parallel.tensor=tp",
                     "parallel.context=[cpn, cpd]", f"model.num_kv_heads={kv}")
    choice = cm._choose_config(config)
    assert set(choice.refused) == refused
    assert choice.method == cm.resolve(config)


def _brute_blocks(seq_len: int, c: int, block: int, zigzag: bool) -> list[int]:
    chunk = seq_len // (2 * c) if zigzag else seq_len // c
    pieces = [(i, 2 * c - 1 - i) for i in range(c)] if zigzag else [(i,) for i in range(c)]
    q = np.arange(seq_len)[:, None]
    mask = np.arange(seq_len)[None, :] <= q  # causal: key position <= query position
    out = []
    for mine in pieces:
        rows = np.concatenate([np.arange(k * chunk, (k + 1) * chunk) for k in mine])
        count = 0
        for qb, kb in itertools.product(range(0, len(rows), block), range(0, seq_len, block)):
            count += bool(mask[rows[qb:qb + block]][:, kb:kb + block].any())
        out.append(count)
    return out


@pytest.mark.parametrize(("seq_len", "c", "block"), [(32, 2, 4), (48, 3, 2), (64, 4, 8)])
def test_causal_blocks_against_the_mask(seq_len: int, c: int, block: int) -> None:
    for zigzag in (True, False):
        assert list(cm.causal_blocks(seq_len, c, block, zigzag=zigzag)) == _brute_blocks(
            seq_len, c, block, zigzag)


def test_zigzag_is_balanced_and_contiguous_is_not() -> None:
    zig = cm.causal_blocks(8192, 8, 128)
    flat = cm.causal_blocks(8192, 8, 128, zigzag=False)
    assert max(zig) <= 1.1 * min(zig)
    assert max(flat) > 5 * min(flat)
    assert sum(zig) == sum(flat)
    with pytest.raises(ValueError, match="block 48"):
        cm.causal_blocks(8192, 8, 48)
