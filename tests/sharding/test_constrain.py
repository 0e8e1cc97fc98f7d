"""Activations by logical names: ``meshkit.constrain`` puts an activation where the rules
say, read back from the compiled program, on meshkit's Auto mesh and on an Explicit one."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit

SHAPE = (8, 4, 16)  # batch, sequence, width


def _compiled(mesh, rules, *names):
    """A jitted model step whose hidden activation is constrained by ``names``, compiled
    under the mesh and the rules in effect (as the trainer traces)."""

    def step(x, w):
        hidden = meshkit.constrain(jnp.tanh(x @ w), *names)
        return hidden * 2

    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    w = jax.ShapeDtypeStruct((SHAPE[-1], SHAPE[-1]), jnp.float32)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()):
        return jax.jit(step).lower(x, w).compile()


def _local_elements(spec, mesh) -> int:
    """Elements of one device's shard of the activation under ``spec``."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(SHAPE) // math.prod(sizes[a] for e in spec if e for a in
                                         ((e,) if isinstance(e, str) else e))


def _tanh_elements(hlo: str) -> list[int]:
    """Elements of each tanh in the partitioned program (XLA may flatten its shape)."""
    dims = re.findall(r"= f32\[([\d,]*)\]\S* tanh\(", hlo)
    return [math.prod(int(d) for d in shape.split(",")) for shape in dims]


@pytest.mark.parametrize(
    ("axes", "roles", "names", "want"),
    [
        ({"dp": 2, "tp": 4}, {"data": "dp", "tensor": "tp"}, ("batch", "sequence", "heads"),
         P("dp", None, "tp")),
        ({"dp": 2, "tp": 4}, {"data": "dp", "tensor": "tp"}, ("batch", "sequence", "embed"),
         P("dp", None, None)),
        # The batch takes fsdp; the width, a weight's fsdp dimension, stays whole.
        ({"fsdp": 8}, {"fsdp": "fsdp"}, ("batch", "sequence", "embed"), P("fsdp", None, None)),
        ({"fsdp": 8}, {"fsdp": "fsdp"}, (None, None, "embed"), P(None, None, "fsdp")),
    ],
)
def test_the_activation_is_where_the_rules_say(axes, roles, names, want):
    mesh = meshkit.Strategy.from_axes(axes).mesh()
    rules = meshkit.ShardingRules(**roles).extend(sequence=None)
    compiled = _compiled(mesh, rules, *names)
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, want), len(SHAPE))
    # The partitioned program computes the activation on each device's shard only.
    assert _tanh_elements(compiled.as_text()) == [_local_elements(want, mesh)]


def test_an_explicit_mesh_is_resharded():
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rules = meshkit.ShardingRules(data="dp", tensor="tp").extend(sequence=None)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones(SHAPE), P())
        y = jax.jit(lambda x: meshkit.constrain(x, "batch", "sequence", "heads",
                                                rules=rules))(x)
    assert y.sharding.spec == P("dp", None, "tp")


def test_without_a_mesh_the_activation_is_left_as_it_is():
    x = jnp.ones(SHAPE)
    assert meshkit.constrain(x, "batch", "sequence", "embed") is x


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (("batch", "sequence"), r"2 names \('batch', 'sequence'\) for an array of 3 dim"),
        (("batch", "seq", "embed"), r"logical axis 'seq' is not in the rules .*"
                                    r"rules\.extend\(seq=\.\.\.\)"),
    ],
)
def test_bad_names_are_named(names, match):
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp").extend(sequence=None)
    with pytest.raises(ValueError, match=match):
        _compiled(mesh, rules, *names)
