"""Strategy.mesh: rank r is devices[r]; axis types; process-boundary checks."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from meshkit import Strategy
from meshkit.strategy.mesh import check_process_blocks, default_inner_axes, make_mesh


def test_position_holds_device_of_rank():
    ranks = np.random.default_rng(0).permutation(8).reshape(4, 2)
    s = Strategy(ranks, ("node", "device"))
    devices = jax.devices()
    mesh = s.mesh()
    assert dict(mesh.shape) == {"node": 4, "device": 2}
    for p, d in enumerate(mesh.devices.flat):
        assert d == devices[ranks.flat[p]]
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_explicit_devices_and_axis_types():
    devices = list(reversed(jax.devices()))
    s = Strategy.from_axes({"a": 2, "b": 2})
    mesh = s.mesh(devices, AxisType.Explicit)
    assert list(mesh.devices.flat) == devices[:4]
    assert mesh.axis_types == (AxisType.Explicit,) * 2
    mesh = make_mesh(s, axis_types=(AxisType.Explicit, AxisType.Auto))
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Auto)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": jax.devices()[:4]}, "needs 8 devices, only 4 available"),
        ({"devices": [jax.devices()[0]] * 8}, "distinct"),
        ({"axis_types": (AxisType.Auto,)}, "one per axis"),
        ({"axis_types": "auto"}, "one per axis"),
        ({"inner_axes": ["gpu"]}, r"inner_axes \['gpu'\]"),
    ],
)
def test_make_mesh_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(Strategy.from_axes({"node": 2, "device": 4}), **kwargs)


def test_default_inner_axes():
    s = Strategy.from_axes({"dp": 2, "pp": 2, "ep": 2, "tp": 2})
    assert default_inner_axes(s, 4) == ("ep", "tp")
    assert default_inner_axes(s, 16) == ("dp", "pp", "ep", "tp")
    assert default_inner_axes(Strategy.from_axes({"node": 2, "device": 4}), 2) == ()


def test_process_blocks_accept_node_rows():
    s = Strategy.from_axes({"node": 2, "device": 4})
    check_process_blocks(s, [0, 0, 0, 0, 1, 1, 1, 1], ["device"])
    check_process_blocks(s, [0, 0, 1, 1, 2, 2, 3, 3], [])  # two processes per node
    four = Strategy.from_axes({"dp": 1, "pp": 2, "ep": 2, "tp": 2})
    check_process_blocks(four, [0] * 4 + [1] * 4, default_inner_axes(four, 4))


def test_a_process_straddling_nodes_is_rejected():
    # Four processes of two devices; process 0 holds ranks 0 and 1 in different node rows.
    s = Strategy([[0, 2, 4, 6], [1, 3, 5, 7]], ("node", "device"))
    devices = [_FakeDevice(i, i // 2) for i in range(8)]
    with pytest.raises(ValueError, match=r"process 0 holds ranks \[0, 1\] that differ on the "
                                         r"outer axes \['node'\]"):
        make_mesh(s, devices)
    with pytest.raises(ValueError, match=r"process 1 holds ranks \[2, 3, 4, 5\]"):
        check_process_blocks(Strategy.from_axes({"a": 2, "b": 2, "c": 2}),
                             [0, 0, 1, 1, 1, 1, 2, 2], ["c"])


class _FakeDevice:
    def __init__(self, i: int, process: int) -> None:
        self.id, self.process_index = i, process


def test_straddling_process_boundary_is_rejected():
    # Rank 4 sits in node row 0 but lives on process 1.
    s = Strategy([[0, 1, 2, 4], [3, 5, 6, 7]], ("node", "device"))
    devices = [_FakeDevice(i, i // 4) for i in range(8)]
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 4\] spans processes \[0, 0, 0, 1\]"):
        make_mesh(s, devices)
    with pytest.raises(ValueError, match="spans processes"):
        check_process_blocks(Strategy.from_axes({"node": 4, "device": 2}),
                             [0, 0, 0, 0, 1, 1, 1, 1], ["node"])
