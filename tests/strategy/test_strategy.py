"""Strategy: coordinates, groups, neighbours, views, constructors and every error."""

import itertools
import math

import numpy as np
import pytest

from meshkit import Strategy


def _loop_groups(s: Strategy, axes: tuple[str, ...]) -> list[list[int]]:
    """Obvious reference: per-rank loop over coordinates."""
    out: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for r in range(s.size):
        c = s.coords(r)
        key = tuple(c[a] for a in s.axis_names if a not in axes)
        out.setdefault(key, []).append((tuple(c[a] for a in axes), r))
    return [[r for _, r in sorted(members)] for _, members in sorted(out.items())]


STRATEGIES = [
    Strategy.from_axes({"node": 2, "device": 4}),
    Strategy.from_axes({"node": 4, "device": 2}),
    Strategy(np.random.default_rng(0).permutation(24).reshape(2, 3, 4), ("a", "b", "c")),
    Strategy(
        np.random.default_rng(1).permutation(16).reshape(2, 2, 2, 2), ("dp", "pp", "ep", "tp")
    ),
]


@pytest.mark.parametrize("s", STRATEGIES, ids=repr)
def test_groups_match_per_rank_reference(s):
    for k in range(1, len(s.axis_names) + 1):
        for axes in itertools.permutations(s.axis_names, k):
            got = s.groups(axes)
            want = _loop_groups(s, axes)
            assert got.tolist() == want, axes
            for r in range(s.size):
                g = s.group(r, axes)
                assert r in g and list(g) in want
            assert got.shape == (s.size // math.prod(s.shape[a] for a in axes),
                                 math.prod(s.shape[a] for a in axes))


@pytest.mark.parametrize("s", STRATEGIES, ids=repr)
def test_coords_and_rank_are_inverse(s):
    for r in range(s.size):
        c = s.coords(r)
        assert s.rank(**c) == r
        assert s.ranks[tuple(c.values())] == r


def test_node_device_example():
    s = Strategy.from_axes({"node": 2, "device": 4})
    assert s.coords(5) == {"node": 1, "device": 1}
    assert s.group(5, "node") == (1, 5)
    assert s.group(5, "device") == (4, 5, 6, 7)
    assert s.group(5, ("device", "node")) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert s.groups("node").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert s.neighbors(4, "device") == (7, 5)
    assert s.neighbors(5, "node") == (1, 1)
    assert s.shape == {"node": 2, "device": 4} and s.size == 8
    assert s.axis_names == ("node", "device") and s.axis_sizes == (2, 4)


def test_permuted_ranks():
    s = Strategy([[3, 0], [1, 2]], ("x", "y"))
    assert s.coords(0) == {"x": 0, "y": 1}
    assert s.group(0, "x") == (0, 2)
    assert s.groups("y").tolist() == [[3, 0], [1, 2]]
    assert s.neighbors(3, "y") == (0, 0)


def test_ranks_read_only():
    s = Strategy.from_axes({"a": 2, "b": 2})
    with pytest.raises(ValueError):
        s.ranks[0, 0] = 3


def test_from_axes_fill_and_world_size():
    assert Strategy.from_axes({"dp": -1, "tp": 2}, world_size=8).shape == {"dp": 4, "tp": 2}
    assert Strategy.from_axes({"dp": 4, "tp": 2}, world_size=8).size == 8


def _megatron_groups(world, order, sizes, mask):
    """Megatron-LM's generate_masked_orthogonal_rank_groups, written out."""
    def stride(shape):
        out, acc = [], 1
        for s in shape:
            out.append(acc)
            acc *= s
        return out

    def decompose(i, shape):
        return [(i // d) % s for s, d in zip(shape, stride(shape))]

    gstride = stride(sizes)
    mshape = [s for s, m in zip(sizes, mask) if m]
    ushape = [s for s, m in zip(sizes, mask) if not m]
    mstride = [d for d, m in zip(gstride, mask) if m]
    ustride = [d for d, m in zip(gstride, mask) if not m]
    gsize = math.prod(mshape)
    groups = []
    for gi in range(world // gsize):
        gidx = decompose(gi, ushape)
        groups.append([
            sum(a * b for a, b in zip(decompose(ri, mshape), mstride))
            + sum(a * b for a, b in zip(gidx, ustride))
            for ri in range(gsize)
        ])
    return groups


def test_from_order_matches_megatron():
    sizes = {"tp": 2, "cp": 1, "ep": 3, "dp": 2, "pp": 2}
    order = "tp-cp-ep-dp-pp"
    s = Strategy.from_order(order, **sizes)
    assert s.axis_names == ("pp", "dp", "ep", "cp", "tp")
    tokens = order.split("-")
    for k in range(1, len(tokens) + 1):
        for subset in itertools.combinations(tokens, k):
            mask = [t in subset for t in tokens]
            want = _megatron_groups(s.size, order, [sizes[t] for t in tokens], mask)
            # Megatron lists group members innermost-first; ours are outer → inner.
            assert s.groups(tuple(reversed(subset))).tolist() == want, subset


def test_from_config():
    s = Strategy.from_config({"mesh": {"axes": {"node": 2, "device": 2},
                                       "ranks": [[3, 2], [1, 0]]}})
    assert s.ranks.tolist() == [[3, 2], [1, 0]] and s.axis_names == ("node", "device")
    assert Strategy.from_config({"mesh": {"axes": {"a": 4}}}).size == 4
    assert Strategy.from_config({"axes": {"a": -1}, "ranks": [1, 0]}).shape == {"a": 2}


def test_from_config_does_not_read_files(tmp_path):
    # One YAML loader (meshkit.config.load_config) for the CLI and the library.
    path = tmp_path / "c.yaml"
    path.write_text("mesh:\n  axes: {node: 2}\n")
    for given in (path, str(path)):
        with pytest.raises(TypeError, match=r"not the path .*use meshkit\.load_config"):
            Strategy.from_config(given)


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        ([[0, 2**64 - 1]], r"out of range 0\.\.1: \[18446744073709551615\]"),
        ([[0, 2**70]], r"out of range 0\.\.1: \[1180591620717411303424\]"),
        ([[0, -(2**70)]], r"out of range 0\.\.1: \[-1180591620717411303424\]"),
        ([[0, 1], [2]], "rectangular array of integers"),
        ([[0, "1"]], "must be integers, got dtype <U"),
        ([[0, None]], "rectangular array of integers"),
    ],
)
def test_odd_rank_ids_are_reported_as_written(ranks, message):
    with pytest.raises(ValueError, match=message):
        Strategy(ranks, ("a", "b"))


def test_too_many_ranks_fail_before_allocating():
    with pytest.raises(ValueError, match=r"1,099,511,627,776 ranks, more than the 16,777,216"):
        Strategy.from_axes({"node": 2**40})
    with pytest.raises(ValueError, match=r"more than the 16,777,216"):
        Strategy.from_axes({"node": -1}, world_size=2**30)


def test_mesh_delegates_to_make_mesh():
    import jax
    from jax.sharding import AxisType

    s = Strategy([[1, 0]], ("node", "device"))
    devices = jax.devices()[:2]
    mesh = s.mesh(devices, AxisType.Explicit)
    assert mesh.axis_names == ("node", "device") and mesh.devices.shape == (1, 2)
    assert mesh.devices.tolist() == [[devices[1], devices[0]]]  # rank r is devices[r]
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert s.mesh(devices).axis_types == (AxisType.Auto, AxisType.Auto)
    with pytest.raises(ValueError, match=r"needs 2 devices, only 1 available"):
        s.mesh(devices[:1])
    with pytest.raises(ValueError, match=r"inner_axes \['gpu'\] are not axes of the strategy"):
        s.mesh(devices, inner_axes=["gpu"])
    with pytest.raises(ValueError, match=r"axis_types must be one AxisType or one per axis"):
        s.mesh(devices, [AxisType.Auto])


def test_view():
    s = Strategy(np.random.default_rng(2).permutation(8).reshape(4, 2), ("dp", "tp"))
    v = s.view({"edp": 2, "ep": 4})
    assert v.ranks.ravel().tolist() == s.ranks.ravel().tolist()
    assert v.shape == {"edp": 2, "ep": 4}
    assert s.view({"x": -1, "y": 2}).shape == {"x": 4, "y": 2}


def test_repr_and_str():
    s = Strategy.from_axes({"node": 2, "device": 4})
    assert repr(s) == "Strategy(node=2, device=4)"
    assert "[[0 1 2 3]" in str(s)
    assert s == Strategy.from_axes({"node": 2, "device": 4}) and hash(s) == hash(s.view(s.shape))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Strategy([0, 1, 1, 3], ["a"]), r"duplicates \[1\], missing \[2\]"),
        (lambda: Strategy([0, 1, 5], ["a"]), r"out of range 0..2: \[5\]"),
        (lambda: Strategy([0, -1], ["a"]), r"out of range"),
        (lambda: Strategy([0.5, 1.0], ["a"]), "must be integers"),
        (lambda: Strategy(["0", "1"], ["a"]), "must be integers"),
        (lambda: Strategy([[0, 1]], ["a"]), "1 axis names"),
        (lambda: Strategy([[0, 1]], ["a", "a"]), "duplicate axis names"),
        (lambda: Strategy([[0, 1]], ["a", ""]), "non-empty strings"),
        (lambda: Strategy(np.zeros((0,), int), ["a"]), "empty"),
        (lambda: Strategy.from_axes({"a": 2.5}), "'a': size must be an integer"),
        (lambda: Strategy.from_axes({"a": 0}), "'a': size must be positive"),
        (lambda: Strategy.from_axes({"a": -2}), "'a': size must be positive"),
        (lambda: Strategy.from_axes({"a": -1, "b": -1}, 4), r"at most one.*\['a', 'b'\]"),
        (lambda: Strategy.from_axes({"a": -1, "b": 2}), "'a' is -1 but no world_size"),
        (lambda: Strategy.from_axes({"a": -1, "b": 3}, 8), "do not divide world_size 8"),
        (lambda: Strategy.from_axes({"a": 2, "b": 3}, 8), "multiply to 6, not world_size 8"),
        (lambda: Strategy.from_axes({}), "at least one axis"),
        (lambda: Strategy.from_order("tp-dp-tp", tp=2), r"repeats \['tp'\]"),
        (lambda: Strategy.from_order("tp--dp"), "empty token"),
        (lambda: Strategy.from_order("tp-dp", tp=2, ep=2), r"\['ep'\] have sizes > 1"),
        (lambda: Strategy.from_config({"mesh": {}}), r"config has no mesh\.axes mapping"),
        (lambda: Strategy.from_config({"mesh": 5}), r"config has no mesh\.axes mapping"),
        (lambda: Strategy.from_config([("axes", {"a": 2})]),
         r"mesh config must be a mapping, got list"),
        (lambda: Strategy.from_config({"axes": [2, 4]}),
         r"mesh\.axes must be a non-empty mapping, got \[2, 4\]"),
        (lambda: Strategy.from_config({"mesh": {"axes": {}}}),
         r"mesh\.axes must be a non-empty mapping, got \{\}"),
        (lambda: Strategy.from_config({"axes": None}),
         r"mesh\.axes must be a non-empty mapping, got None"),
        (lambda: Strategy.from_config({"axes": {"a": 2}, "rankz": 1}), r"unknown keys.*rankz"),
        (lambda: Strategy.from_config({"axes": {"a": 2, "b": 2}, "ranks": [[0, 1, 2, 3]]}),
         r"shape \(1, 4\) but mesh.axes gives \(2, 2\)"),
    ],
)
def test_construction_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


S = Strategy.from_axes({"node": 2, "device": 4})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: S.group(0, "gpu"), r"group: unknown axes \['gpu'\]"),
        (lambda: S.group(0, ["node", "node"]), r"group: axes named twice: \['node'\]"),
        (lambda: S.group(0, []), "no axes given"),
        (lambda: S.groups(["device", "gpu"]), r"groups: unknown axes \['gpu'\]"),
        (lambda: S.groups(("node", "node")), "named twice"),
        (lambda: S.group(8, "node"), "rank 8 out of range 0..7"),
        (lambda: S.coords(-1), "rank -1 out of range"),
        (lambda: S.coords(1.0), "rank must be an integer"),
        (lambda: S.neighbors(0, "gpu"), r"unknown axes \['gpu'\]"),
        (lambda: S.neighbors(0, ("node",)), "one axis name"),
        (lambda: S.neighbors(9, "node"), "rank 9 out of range"),
        (lambda: S.rank(node=0), r"missing \['device'\]"),
        (lambda: S.rank(node=0, device=0, gpu=1), r"unknown \['gpu'\]"),
        (lambda: S.rank(node=2, device=0), r"node=2 out of range 0..1"),
        (lambda: S.rank(node=0, device=-1), r"device=-1 out of range"),
        (lambda: S.view({"a": 3, "b": 3}), "multiply to 9, not world_size 8"),
        (lambda: S.view({"a": -1, "b": 3}), "do not divide world_size 8"),
    ],
)
def test_query_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_strategy_module_does_not_import_jax():
    import subprocess
    import sys

    import meshkit.strategy.ranks

    # Load the file alone, so meshkit/__init__.py (which may import JAX) stays out.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {meshkit.strategy.ranks.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "sys.exit('jax' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
