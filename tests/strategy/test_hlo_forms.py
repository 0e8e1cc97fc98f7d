"""Every form XLA prints a collective's device groups in, read exactly or refused.

The literal lines are what JAX 0.10's XLA prints (the mesh forms come from programs
``jax.jit`` partitions, the explicit ones from ``shard_map``, the async ones from XLA's
own printer); the compiled tests check the groups against what the mesh axes imply.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import Strategy
from meshkit.strategy.hlo import collectives, groups_as_ranks

HEADER = "HloModule m, num_partitions=8"
FLAT = ", use_global_device_ids=true"  # global ids: what every jit/shard_map reduce has


def _groups(groups: str, *, op: str = "all-reduce", attrs: str = FLAT,
            header: str = HEADER) -> tuple[tuple[int, ...], ...]:
    line = f"  %c = f32[8]{{0}} {op}(f32[8]{{0}} %x), channel_id=1, replica_groups={groups}"
    (c,) = collectives(f"{header}\n{line}{attrs}, to_apply=%add\n")
    return c.groups


# ------------------------------------------------------------------ printed forms
@pytest.mark.parametrize(("text", "want"), [
    ("{{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("{{0,4,2,6},{1,5,3,7}}", ((0, 4, 2, 6), (1, 5, 3, 7))),
    ("{{0,1,2,3,4,5,6,7}}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
])
def test_explicit_lists(text, want):
    attrs = "" if text == "{}" else FLAT  # XLA rejects {} with global ids
    assert _groups(text, op="all-to-all" if text == "{}" else "all-reduce", attrs=attrs) == want


@pytest.mark.parametrize(("text", "want"), [
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[2,4]<=[2,4]T(1,0)", ((0, 4, 1, 5), (2, 6, 3, 7))),
    # Reshape dims: iota(8) as [2,2,2], transposed, then read as the groups.
    ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("[2,4]<=[2,2,2]T(1,0,2)", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
])
def test_iota_lists(text, want):
    assert _groups(text) == want


MESH = "mesh['axis_0'=2,'axis_1'=4]"


@pytest.mark.parametrize(("text", "want"), [
    # The repro prints the first; meshkit used to answer one group of 8.
    (f"{MESH} {{'axis_1'}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    (f"{MESH} {{'axis_0'}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    (f"{MESH} {{'axis_0','axis_1'}}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    (f"{MESH} {{'axis_1','axis_0'}}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    # Size-1 axes, as jit prints for a mesh it reshaped.
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    # Device ids: an iota (reshape dims, transpose) or a flat list, over the mesh shape.
    ("mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}",
     ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['axis_0'=8,'axis_1'=1], device_ids=(0,4,1,5,2,6,3,7) {'axis_0'}",
     ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) {'axis_2'}",
     ((0, 4), (2, 6), (1, 5), (3, 7))),
    (f"{MESH}, device_ids=(7,6,5,4,3,2,1,0) {{'axis_1'}}", ((7, 6, 5, 4), (3, 2, 1, 0))),
    # Sub-axes 'x:(pre)size': the middle factor of x = [pre, size, rest].
    ("mesh['axis_0'=8] {'axis_0':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    (f"{MESH} {{'axis_1':(1)2}}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    (f"{MESH} {{'axis_1':(2)2,'axis_0'}}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['axis_0'=8] {'axis_0':(4)2,'axis_0':(1)2}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    # No axes: every device alone.
    (f"{MESH} {{}}", tuple((i,) for i in range(8))),
    # Names need not be quoted.
    ("mesh[x=2,y=4] {y}", ((0, 1, 2, 3), (4, 5, 6, 7))),
])
def test_mesh_axes(text, want):
    assert _groups(text) == want


@pytest.mark.parametrize("shape", [{"a": 2, "b": 4}, {"a": 4, "b": 2}, {"a": 2, "b": 2, "c": 2}])
def test_mesh_axes_are_strategy_groups(shape):
    # The mesh form and Strategy.groups follow one rule: named axes last, in the order
    # named; so every subset and order of axes gives the same groups, member order too.
    import itertools

    strategy = Strategy.from_axes(shape)
    names = list(shape)
    mesh = "mesh[" + ",".join(f"'{n}'={s}" for n, s in shape.items()) + "]"
    for k in range(1, len(names) + 1):
        for axes in itertools.permutations(names, k):
            text = mesh + " {" + ",".join(f"'{a}'" for a in axes) + "}"
            want = tuple(tuple(g) for g in strategy.groups(axes).tolist())
            assert _groups(text) == want, text


# ------------------------------------------------------------------ group modes
def _one(header: str, line: str) -> tuple[tuple[int, ...], ...]:
    (c,) = collectives(f"{header}\n  {line}")
    return c.groups


def test_modes_read_ids_as_xla_does():
    # Which ids a group holds depends on channel_id and use_global_device_ids (XLA's
    # GetCollectiveOpGroupMode); all come back as ids replica * partitions + partition.
    four = "HloModule m, num_partitions=4"
    two_by_two = "HloModule m, replica_count=2, num_partitions=2"
    # No channel_id: replica ids, the same groups within each partition.
    no_channel = "%c = f32[8] all-reduce(%x), replica_groups={}, to_apply=%add"
    assert _one(four, no_channel) == ((0,), (1,), (2,), (3,))
    assert _one(two_by_two, no_channel) == ((0, 2), (1, 3))
    # channel_id but no global ids on an all-reduce: replica ids, all their partitions.
    ar = "%c = f32[8] all-reduce(%x), channel_id=1, replica_groups={{0},{1}}, to_apply=%add"
    assert _one(two_by_two, ar) == ((0, 1), (2, 3))
    assert _one(four, ar.replace("{{0},{1}}", "{}")) == ((0, 1, 2, 3),)
    # channel_id on an all-to-all (it has no global ids): partition ids, per replica.
    a2a = "%c = f32[8] all-to-all(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}"
    assert _one(two_by_two, a2a) == ((0, 1), (2, 3))
    # Global ids are as printed.
    assert _groups("{{0,3},{1,2}}", header=two_by_two) == ((0, 3), (1, 2))


def test_source_target_pairs():
    ring = "{{0,1},{1,2},{2,3},{3,0}}"
    line = "%p = f32[2]{0} collective-permute(f32[2]{0} %x), channel_id=1, source_target_pairs="
    assert _one(HEADER, line + ring) == ((0, 1), (1, 2), (2, 3), (3, 0))
    # Without a channel_id the ids are replicas, paired within each partition.
    line = "%p = f32[2]{0} collective-permute(f32[2]{0} %x), source_target_pairs={{0,1}}"
    assert _one("HloModule m, replica_count=2, num_partitions=2", line) == ((0, 2), (1, 3))


# As XLA 0.10 prints them (jaxlib's HLO parser and printer): native starts, and async
# wrappers in their "<op>-start" sugar; the "-done" halves are not collectives.
ASYNC = """HloModule m, num_partitions=8

ENTRY %e (x: f32[8], y: f32[4]) -> (f32[8], f32[16], f32[8], f32[8], f32[2], /*index=5*/f32[8]) {
  %x = f32[8]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %ars2 = (f32[8]{0}, f32[4]{0}) all-reduce-start(%x, %y), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
  %ard2 = (f32[8]{0}, f32[4]{0}) all-reduce-done(%ars2)
  %ars = f32[8]{0} all-reduce-start(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%x), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[16]{0} all-gather-done(%ags)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %a2as = ((f32[8]{0}), f32[8]{0}) all-to-all-start(%x), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %a2ad = f32[8]{0} all-to-all-done(%a2as)
  %rss = ((f32[8]{0}), f32[2]{0}) reduce-scatter-start(%x), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
  %rsd = f32[2]{0} reduce-scatter-done(%rss)
  ROOT %t = (f32[8]{0}, f32[16]{0}, f32[8]{0}, f32[8]{0}, f32[2]{0}, /*index=5*/f32[8]{0}) tuple(%ard, %agd, %cpd, %a2ad, %rsd, /*index=5*/%ard)
}
"""  # noqa: E501  (HLO lines as printed)


def test_async_start_forms():
    found = [(c.name, c.op, c.groups, c.shapes, c.bytes) for c in collectives(ASYNC)]
    assert found == [
        ("ars2", "all-reduce", ((0, 1), (2, 3), (4, 5), (6, 7)), ((8,), (4,)), 48),
        ("ars", "all-reduce", ((0, 4), (1, 5), (2, 6), (3, 7)), ((8,),), 32),
        ("ags", "all-gather", ((0, 4), (1, 5), (2, 6), (3, 7)), ((16,),), 64),
        ("cps", "collective-permute", ((0, 1), (1, 0)), ((8,),), 32),
        ("a2as", "all-to-all", ((0, 1, 2, 3), (4, 5, 6, 7)), ((8,),), 32),
        ("rss", "reduce-scatter", ((0, 1, 2, 3), (4, 5, 6, 7)), ((2,),), 8),
    ]


def test_quoted_text_is_not_read():
    text = HEADER + "\n" + "\n".join([
        '  %f = f32[8]{0} fusion(%x), kind=kLoop, metadata={op_name="a all-reduce(b)"}',
        "  %c = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8]"
        ', use_global_device_ids=true, metadata={op_name="replica_groups={{0,1}}"}',
    ])
    (c,) = collectives(text)
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("groups", "attrs", "message"), [
    ("foo[2,4] {'a'}", FLAT, "unrecognised replica_groups form: replica_groups=foo[2,4] {'a'}"),
    ("maximal_mesh[device_id=0] {}", FLAT, "replica_groups=maximal_mesh[device_id=0] {}"),
    ("{{0,1},{2,3}} extra", FLAT, "replica_groups={{0,1},{2,3}} extra"),
    ("[4,2]<=[8]T(1,0)", FLAT, "replica_groups=[4,2]<=[8]T(1,0)"),
    ("[4,2]<=[2,4]T(0,0)", FLAT, "T(...) is not a permutation"),
    ("[8]<=[8]", FLAT, "want [groups,size]"),
    (f"{MESH} {{'axis_9'}}", FLAT, "no mesh axis 'axis_9'"),
    (f"{MESH} {{'axis_1':(1)2,'axis_1':(1)2}}", FLAT, "sub-axes of 'axis_1' overlap"),
    (f"{MESH} {{'axis_1':(1)3}}", FLAT, "sub-axes do not divide 'axis_1'"),
    (f"{MESH}, device_ids=(0,1,2) {{'axis_1'}}", FLAT, "3 device_ids, mesh 8"),
    ("{{0,8}}", FLAT, "ids [8] outside the 8"),
    ("{}", FLAT, "replica_groups={} with use_global_device_ids=true"),
    ("{{0,1}}", ", use_global_device_ids=maybe", "use_global_device_ids=maybe"),
])
def test_unknown_or_impossible_groups_raise(groups, attrs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        _groups(groups, attrs=attrs)
    assert "in: %c = f32[8]{0} all-reduce(" in str(err.value)  # quotes the instruction


def test_groups_that_need_a_device_count_raise_without_one():
    # A lowered (not compiled) module's header states neither count.
    lowered = "HloModule jit_f, entry_computation_layout={(f32[8]{0})->f32[8]{0}}"
    with pytest.raises(ValueError, match=re.escape("replica_groups={} needs the device count")):
        _groups("{}", op="all-to-all", attrs="", header=lowered)
    with pytest.raises(ValueError, match="a cross-replica collective needs the device count"):
        collectives(f"{lowered}\n  %c = f32[8] all-reduce(%x), replica_groups={{{{0,1}}}}")
    # Explicit global or partition ids name their devices themselves.
    assert _groups("{{0,1},{2,3}}", header=lowered) == ((0, 1), (2, 3))


def test_collectives_without_readable_groups_raise():
    with pytest.raises(ValueError, match=r"no replica_groups; in: %c = f32\[8\]"):
        collectives(f"{HEADER}\n  %c = f32[8] all-gather(%x), channel_id=1, dimensions={{0}}")
    with pytest.raises(ValueError, match=re.escape("unrecognised source_target_pairs: {{0,1,2}}")):
        collectives(f"{HEADER}\n  %p = f32[8] collective-permute(%x), channel_id=1,"
                    " source_target_pairs={{0,1,2}}")
    with pytest.raises(ValueError, match="cannot read this collective instruction: %c = f32"):
        collectives(f"{HEADER}\n  %c = f32[8 all-reduce(%x), replica_groups={{{{0}}}}")
    with pytest.raises(ValueError, match="all-reduce-scatter carries device groups but is no"):
        collectives(f"{HEADER}\n  %c = f32[8] all-reduce-scatter(%x), replica_groups={{}}")


# ------------------------------------------------------------------ compiled programs
@pytest.fixture(scope="module")
def dp_tp():
    strategy = Strategy.from_axes({"dp": 2, "tp": 4})
    mesh = strategy.mesh()
    return strategy, mesh, lambda *spec: NamedSharding(mesh, P(*spec))


def _compiled(fn, out, x):
    return collectives(jax.jit(fn, out_shardings=out).lower(x).compile())


def test_jit_reduce_over_tp_is_the_tp_groups(dp_tp):
    # The repro: XLA prints mesh['axis_0'=2,'axis_1'=4] {'axis_1'}.
    _, _, sharded = dp_tp
    x = jax.device_put(jnp.ones((2, 4)), sharded("dp", "tp"))
    (c,) = _compiled(lambda x: jnp.sin(x).sum(axis=1), sharded("dp"), x)
    assert (c.op, c.groups) == ("all-reduce", ((0, 1, 2, 3), (4, 5, 6, 7)))


def test_jit_reduce_over_dp_is_the_dp_groups(dp_tp):
    _, _, sharded = dp_tp
    x = jax.device_put(jnp.ones((2, 4)), sharded("dp", "tp"))
    (c,) = _compiled(lambda x: jnp.sin(x).sum(axis=0), sharded("tp"), x)
    assert (c.op, c.groups) == ("all-reduce", ((0, 4), (1, 5), (2, 6), (3, 7)))


def test_jit_all_gather_concatenates_in_group_order(dp_tp):
    # Sharded over (tp, dp): XLA prints the mesh with device_ids=([2,4]T(1,0)), and
    # the group must list the devices in the order their blocks are concatenated.
    _, mesh, sharded = dp_tp
    x = jax.device_put(jnp.ones((8, 2)), sharded(("tp", "dp")))
    (c,) = _compiled(lambda x: x * 2, sharded(), x)
    assert (c.op, c.groups) == ("all-gather", ((0, 4, 1, 5, 2, 6, 3, 7),))
    index = x.sharding.devices_indices_map(x.shape)
    starts = [index[mesh.devices.flat[p]][0].start for p in c.groups[0]]
    assert starts == sorted(starts)


def test_jit_all_to_all_and_permute(dp_tp):
    _, _, sharded = dp_tp
    x = jax.device_put(jnp.ones((8, 8)), sharded("tp", None))
    (a2a,) = _compiled(lambda x: x * 2, sharded(None, "tp"), x)
    assert (a2a.op, a2a.groups) == ("all-to-all", ((0, 1, 2, 3), (4, 5, 6, 7)))
    (cp,) = _compiled(lambda x: jnp.roll(x, 1, axis=0), sharded("tp", None), x)
    assert cp.op == "collective-permute"
    assert sorted(cp.groups) == sorted((d, d // 4 * 4 + (d + 1) % 4) for d in range(8))


def test_jit_groups_on_a_permuted_strategy_are_its_groups():
    # Positions are logical ids; through groups_as_ranks they are the strategy's groups.
    strategy = Strategy(np.random.default_rng(19).permutation(8).reshape(2, 4), ("dp", "tp"))
    mesh = strategy.mesh()
    x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P("dp", "tp")))
    for axis, keep, other in ((1, "dp", "tp"), (0, "tp", "dp")):
        (c,) = _compiled(lambda x, a=axis: x.sum(axis=a), NamedSharding(mesh, P(keep)), x)
        got = sorted(tuple(sorted(g)) for g in groups_as_ranks(c.groups, strategy))
        assert got == sorted(tuple(sorted(g)) for g in strategy.groups(other).tolist())


@pytest.mark.parametrize("axes", [("b",), ("c", "a"), ("b", "c", "a")])
def test_shard_map_collectives_keep_their_explicit_groups(axes):
    strategy = Strategy.from_axes({"a": 2, "b": 2, "c": 2})
    mesh = strategy.mesh()
    spec = P(strategy.axis_names)
    x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, spec))
    size = int(np.prod([strategy.shape[a] for a in axes]))

    def body(x):
        tiled = jnp.tile(x, size)
        return (jax.lax.all_gather(x, axes, tiled=True)
                + jax.lax.psum_scatter(tiled, axes, tiled=True).sum()
                + jax.lax.all_to_all(tiled, axes, 0, 0, tiled=True))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    want = tuple(tuple(g) for g in strategy.groups(axes).tolist())
    found = {c.op: c.groups for c in collectives(f.lower(x).compile())}
    assert found == {"all-gather": want, "reduce-scatter": want, "all-to-all": want}
