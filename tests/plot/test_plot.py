"""meshkit.plot: every picture is a real PNG, the exchange model matches a loop reference,
`meshkit plot WORKDIR` writes loss.png, and every error fires."""

import json
import sys

import numpy as np
import pytest

from meshkit import Strategy
from meshkit.cli import main
from meshkit.exchange import cost
from meshkit.plot import (
    exchange_stages,
    plot_cost,
    plot_exchange,
    plot_metrics,
    plot_strategy,
)
from meshkit.plot.cost import _break_even

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def assert_png(path, min_bytes=20_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} has only {len(data)} bytes"
    # IHDR: width and height, big-endian, right after the signature and chunk header.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 200, (width, height)


# --------------------------------------------------------------------------- strategy


@pytest.mark.parametrize(
    ("strategy", "axis"),
    [
        (Strategy.from_axes({"node": 2, "device": 4}), "node"),
        (Strategy(np.random.default_rng(0).permutation(8).reshape(4, 2), ("node", "device")),
         None),
        (Strategy.from_axes({"pp": 2, "ep": 2, "tp": 2}), ("pp", "tp")),
        (Strategy.from_order("tp-ep-pp-dp", tp=2, ep=2, pp=2, dp=2), ("dp", "ep")),
    ],
    ids=["2d", "permuted", "3d", "4d"],
)
def test_plot_strategy_writes_a_png(tmp_path, strategy, axis):
    png = tmp_path / "mesh.png"
    fig = plot_strategy(strategy, axis, path=png)
    assert_png(png, min_bytes=10_000)
    # One panel per outer coordinate beyond two axes, each cell labelled with its rank.
    panels = 1 if len(strategy.axis_sizes) <= 2 else int(np.prod(strategy.axis_sizes[:-2]))
    assert len(fig.axes) == panels
    labels = sorted(int(t.get_text()) for ax in fig.axes for t in ax.texts)
    assert labels == list(range(strategy.size))


def test_plot_strategy_rejects_an_unknown_axis():
    with pytest.raises(ValueError, match="unknown axes"):
        plot_strategy(Strategy.from_axes({"node": 2, "device": 4}), "gpu")


# --------------------------------------------------------------------------- exchange


def _loop_reference(n, m, order):
    """The two stages as the design describes them, one piece at a time."""
    p = n * m
    held = {d: [d * p + q for q in range(p)] for d in range(p)}  # device -> slots

    def node_stage(held):
        # Device (a, b) sends its M pieces for node c, in one message, to device (c, b);
        # the receiver stores them by source node.
        out = {d: [None] * p for d in range(p)}
        for a in range(n):
            for b in range(m):
                for c in range(n):
                    block = held[a * m + b][c * m:(c + 1) * m]
                    out[c * m + b][a * m:(a + 1) * m] = block
        return out

    def device_stage(held):
        # Inside a node, the piece in slot j goes to local device j mod M; the receiver
        # stores it at the sender's local index within the same group of M slots.
        out = {d: [None] * p for d in range(p)}
        for node in range(n):
            for b in range(m):
                for j, piece in enumerate(held[node * m + b]):
                    out[node * m + j % m][(j // m) * m + b] = piece
        return out

    stages = [node_stage, device_stage] if order == "node_first" else [device_stage, node_stage]
    result = [held]
    for stage in stages:
        result.append(stage(result[-1]))
    return [np.array([r[d] for d in range(p)]) for r in result]


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 2), (1, 4), (3, 1), (3, 2)])
@pytest.mark.parametrize("order", ["node_first", "device_first"])
def test_exchange_stages_match_a_loop_reference(n, m, order):
    stages = exchange_stages(n, m, order=order)
    first, second = ("node", "device") if order == "node_first" else ("device", "node")
    assert list(stages) == ["before", f"after {first} stage", f"after {second} stage"]
    for got, want in zip(stages.values(), _loop_reference(n, m, order)):
        np.testing.assert_array_equal(got, want)
    # The end state is the flat all-to-all: device d holds, in slot s, the piece s -> d.
    p = n * m
    final = list(stages.values())[-1]
    np.testing.assert_array_equal(final, np.arange(p * p).reshape(p, p).T)


@pytest.mark.parametrize("order", ["node_first", "device_first"])
def test_plot_exchange_writes_a_png(tmp_path, order):
    png = tmp_path / "exchange.png"
    fig = plot_exchange(2, 4, order=order, path=png)
    assert_png(png)
    assert [ax.get_title().splitlines()[0] for ax in fig.axes] == list(
        exchange_stages(2, 4, order=order))
    # Every cell is labelled source→destination; the last panel holds q→d in slot q.
    last = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
            for t in fig.axes[-1].texts}
    assert last[(5, 3)] == "3→5" and len(last) == 64


def test_plot_exchange_draws_given_stages(tmp_path):
    png = tmp_path / "exchange.png"
    stages = exchange_stages(4, 2)
    given = {"in": stages["before"].ravel(), "out": stages["after device stage"]}
    fig = plot_exchange(4, 2, given, path=png)
    assert_png(png)
    assert [ax.get_title() for ax in fig.axes] == ["in", "out"]
    plot_exchange(8, 8)  # 64 devices: colours only, no labels
    assert not plt_texts()


def plt_texts():
    import matplotlib.pyplot as plt

    return [t for ax in plt.gcf().axes for t in ax.texts]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 4), {}, "nodes must be an int >= 1, got 0"),
        ((2, 2.0), {}, "devices must be an int >= 1, got 2.0"),
        ((2, 4), {"order": "sideways"}, "order must be one of"),
        ((8, 16), {}, "128 devices are too many to draw"),
        ((2, 4, {}), {}, "non-empty mapping"),
        ((2, 4, {"x": np.zeros((8, 4), int)}), {}, r"expected 8x8 integer .* shape \(8, 4\)"),
        ((2, 4, {"x": np.zeros((8, 8))}), {}, "dtype float64"),
        ((2, 4, {"x": np.zeros((8, 8), int)}), {}, r"'x' does not hold every piece .* \[1, 2"),
        ((2, 4, {"x": np.arange(64).reshape(8, 8) + 1}), {}, r"missing \[0\]"),
    ],
)
def test_plot_exchange_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_exchange(*args, **kwargs)


def test_exchange_stages_errors():
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        exchange_stages(True, 2)
    with pytest.raises(ValueError, match="order must be one of"):
        exchange_stages(2, 2, order="flat")


# --------------------------------------------------------------------------- cost


def test_plot_cost_writes_a_png(tmp_path):
    png = tmp_path / "cost.png"
    fig = plot_cost(path=png)
    assert_png(png)
    assert len(fig.axes) == 2 * len(cost.PRESETS)
    legend = [t.get_text() for t in fig.axes[1 + len(cost.PRESETS) - 1].get_legend().get_texts()]
    assert any("break-even" in t and "MiB" in t for t in legend), legend


def test_plot_cost_small_cluster(tmp_path):
    png = tmp_path / "cost.png"
    plot_cost(["a100-8x200g"], sizes=[2**10, 2**20, 2**30], gpus=[8], devices_per_node=4,
              path=png)
    assert_png(png, min_bytes=10_000)


@pytest.mark.parametrize(("name", "gpus"), [("a100-8x200g", 16), ("h100-8x400g", 128)])
def test_break_even_is_where_the_choice_flips(name, gpus):
    topology = cost.preset(name, gpus // 8)
    (size,) = _break_even(topology, np.logspace(10, 32, 23, base=2.0))
    flat = cost.predict("flat", size, topology)
    assert (1 + cost.CHOOSE_MARGIN) * cost.predict("hierarchical", size, topology) == (
        pytest.approx(flat, rel=1e-9))
    assert cost.choose(size * 0.99, topology) == "hierarchical"
    assert cost.choose(size * 1.01, topology) == "flat"


def test_no_break_even_when_one_method_always_wins():
    topology = cost.preset("a100-8x200g", nodes=256)
    assert _break_even(topology, np.logspace(10, 28, 19, base=2.0)) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presets": ["tpu-v9"]}, "unknown preset 'tpu-v9'"),
        ({"presets": "a100-8x200g"}, "non-empty list of names"),
        ({"presets": []}, "non-empty list of names"),
        ({"sizes": [2**20]}, "at least two finite byte counts"),
        ({"sizes": [0, 2**20]}, "at least two finite byte counts"),
        ({"gpus": [12]}, r"multiples of devices_per_node=8, got \[12\]"),
        ({"gpus": []}, "multiples of devices_per_node"),
        ({"gpus": [0]}, "gpus must be an int >= 1"),
        ({"devices_per_node": 0}, "devices_per_node must be an int >= 1"),
    ],
)
def test_plot_cost_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_cost(**kwargs)


# --------------------------------------------------------------------------- metrics


def write_metrics(workdir, steps=20, layers=2, experts=4):
    rng = np.random.default_rng(0)
    rows = []
    for step in range(5, steps + 1, 5):
        load = rng.dirichlet(np.ones(experts), size=layers).round(4).tolist()
        row = {"step": step, "loss": 3.0 / step**0.3, "expert_load": load,
               "tokens_per_s": 1000.0}
        if step % 10 == 0:
            row.update(eval_loss=2.9 / step**0.3, entropy_rate=1.2)
        rows.append(row)
    workdir.mkdir(exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_plot_metrics_draws_loss_entropy_and_expert_load(tmp_path):
    rows = write_metrics(tmp_path / "run")
    png = tmp_path / "loss.png"
    fig = plot_metrics(tmp_path / "run", path=png)
    assert_png(png)
    loss_ax, load_ax = fig.axes
    labels = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert labels[:2] == ["train loss", "eval loss"] and "entropy rate 1.200" in labels[2]
    train_line, eval_line = loss_ax.get_lines()[:2]
    assert list(train_line.get_xdata()) == [5, 10, 15, 20]
    assert list(eval_line.get_xdata()) == [10, 20]
    bars = [p.get_height() for p in load_ax.patches]
    assert bars == pytest.approx(np.ravel(rows[-1]["expert_load"]))
    assert load_ax.get_title() == "expert load at step 20"


def test_plot_metrics_without_expert_load_or_entropy(tmp_path):
    fig = plot_metrics([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    assert len(fig.axes) == 1


def test_plot_metrics_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl in .*train a run"):
        plot_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no run directory or metrics file"):
        plot_metrics(tmp_path / "nope")
    with pytest.raises(ValueError, match="no metrics rows with a loss"):
        plot_metrics([{"step": 1, "eval_loss": 2.0}])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not JSON"):
        plot_metrics(tmp_path)


def test_cli_plot_writes_loss_png(tmp_path, capsys):
    workdir = tmp_path / "run"
    write_metrics(workdir)
    assert main(["plot", str(workdir)]) == 0
    assert_png(workdir / "loss.png")
    assert f"wrote {workdir / 'loss.png'}" in capsys.readouterr().err
    other = tmp_path / "other.png"
    assert main(["plot", str(workdir), "-o", str(other)]) == 0
    assert_png(other)


def test_cli_plot_without_metrics_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit plot: error: no metrics.jsonl in ")
    assert not (tmp_path / "loss.png").exists()


# --------------------------------------------------------------------------- no matplotlib


def test_without_matplotlib_every_drawing_names_the_extra(monkeypatch, tmp_path):
    write_metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    calls = [
        lambda: plot_strategy(Strategy.from_axes({"node": 2, "device": 4})),
        lambda: plot_exchange(2, 4),
        lambda: plot_cost(),
        lambda: plot_metrics(tmp_path),
    ]
    for call in calls:
        with pytest.raises(ImportError, match=r"pip install 'meshkit\[plot\]'"):
            call()
    assert exchange_stages(2, 2)["before"].shape == (4, 4)  # numpy only


def test_node_crossings_counts_rows_per_plan():
    from meshkit.plot import node_crossings, plot_node_crossings

    # 2 nodes × 2 devices, 8 experts (2 per device): token 0 sends all 4 choices to node
    # 1 (devices 0 and 1), token 1 two of them (expert 4 on dev 0, expert 6 on dev 1).
    rows = node_crossings([[4, 5, 6, 7], [0, 4, 1, 6]], nodes=2, devices=2, num_experts=8)
    assert rows["flat"] == [(0, 1, 0), (0, 1, 0), (0, 1, 1), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert rows["two-stage"] == [(0, 1, 0)] * 4 + [(1, 1, 1)] * 2  # to the peer device
    assert rows["dedup"] == [(0, 1, 0), (1, 1, 1)]  # once per (token, node)
    fig = plot_node_crossings([[4, 5, 6, 7], [0, 4, 1, 6]], devices=2, num_experts=8)
    assert [ax.get_title() for ax in fig.axes] == [
        "flat: 6 rows cross nodes", "two-stage: 6 rows cross nodes", "dedup: 2 rows cross nodes"]
    for bad, match in (([[8]], r"expert ids must be in \[0, 8\)"),
                       ([1, 2], r"\[tokens, k\] integer array")):
        with pytest.raises(ValueError, match=match):
            node_crossings(bad, nodes=2, devices=2, num_experts=8)
    with pytest.raises(ValueError, match="not divisible by 2×2 devices"):
        node_crossings([[0]], nodes=2, devices=2, num_experts=6)
